"""Typed settings: `neuron.toml` decoded into msgspec Structs, then environment overrides.

Every error names the file and the key (or the line, for invalid TOML) and maps to exit 78.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from neuron_trio.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_CONFIG_PATH = Path("/etc/neuron/neuron.toml")
BUILTIN_MODEL_NAME = "smollm2-135m"
BUILTIN_MODEL_SOURCE = "builtin:smollm2-135m"
# The tenant of an admin key that is in no tenant's keys_file (and acts for no other).
OPERATOR_TENANT = "operator"

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
ModelName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
# A tenant's name, as metrics labels and logs show it; "key-…" is kept for api_key_file's keys.
TenantName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
_ZMQ_ENDPOINT_RE = re.compile(r"^(tcp://[^\s/]+:(?P<port>\d{1,5}|\*)|ipc://\S+|inproc://\S+)$")
_LISTEN_RE = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})$")


def default_state_dir() -> Path:
    """The XDG state directory of the user running neuron without a config file."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "neuron"


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    listen: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:8080"])
    tls_cert: str | None = None
    tls_key: str | None = None
    api_key_file: str | None = None
    # When set, POST/DELETE /v1/models need this key (403 with another valid key, 401 with none).
    admin_key_file: str | None = None
    # A listener on a non-loopback address without api_key_file is refused (exit 78) unless
    # this says, explicitly, that an open API is wanted (e.g. behind an authenticating proxy).
    allow_unauthenticated: bool = False
    max_body_bytes: PositiveInt = 1_048_576
    drain_timeout_s: PositiveFloat = 100.0
    max_queue: NonNegativeInt = 64
    # Open connections; one accepted beyond it is closed at once. Keep it below the unit's
    # LimitNOFILE (65536), which also covers model files, NCCL sockets and the journal.
    max_connections: PositiveInt = 4096
    # Open connections from one peer address; one more from it is closed at once. When the
    # node is full, a connection doing nothing (never a complete request, or idle) makes room
    # for a new one; one with a request in flight is never closed for it.
    max_connections_per_peer: PositiveInt = 256
    # The longest wait for the next piece of a request body; past it: 408.
    read_timeout_s: PositiveFloat = 30.0
    # Messages in one chat request; more: 400.
    max_messages: PositiveInt = 2048
    # Which requests may reuse each other's cached prompt prefixes (KV blocks): "tenant" (the
    # default), only requests of the same tenant ([[tenants]], or one per key of
    # api_key_file) or of tenants in the same `prefix_cache_group`, and the same
    # `cache_salt`, so tenants never learn each other's prompts from timing (without keys
    # there is one tenant: nothing to keep apart); "api_key", the same as "tenant" (its
    # older name; needs keys); "none", an explicit opt-out: any two requests with the same
    # `cache_salt` (or none) share, whatever their tenants.
    prefix_cache_isolation: Literal["tenant", "api_key", "none"] = "tenant"
    # When set, GET /metrics needs a key from this file (Authorization: Bearer). Unset with
    # api_key_file set: /metrics needs the admin key (admin_key_file) or, without one, an API
    # key. Without any key file /metrics is open.
    metrics_key_file: str | None = None
    # Origins whose web pages may call the API from a browser (CORS, http/cors.py): each
    # "http(s)://HOST[:PORT]" exactly as the browser sends it, or "*"; at most 64. Empty (the
    # default): no CORS headers, and an OPTIONS needs the key like any other request.
    cors_allow_origins: list[str] = msgspec.field(default_factory=list)


class NodeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    state_dir: str = ""  # empty: the XDG default, filled in by load_config
    model_dirs: list[str] = msgspec.field(default_factory=list)  # empty: [state_dir/models]
    # Models loaded at once (default ones included); a runtime load beyond it: 409.
    max_models: PositiveInt = 8
    # `hf:` repos a runtime load (POST /v1/models) may fetch: "OWNER/NAME" or a glob such as
    # "bartowski/*". Empty: none. Default models (written by the operator) are not limited.
    hf_allow_repos: list[str] = msgspec.field(default_factory=list)
    # The largest file a runtime load may download, checked before the download starts.
    hf_max_download_bytes: PositiveInt = 32 << 30
    # The most seconds one model's build (reading, converting and placing its weights, its
    # tokenizer) may take, downloads and warm-up not included: past it the load fails (422/500
    # at run time, exit 69 for a default model) instead of holding its slot forever.
    load_timeout_s: PositiveFloat = 900.0
    # The packed-weight cache (engine/model/load/weight_cache.py): under dtype "auto" on the CPU
    # the first load of a model file writes its packed layers here and later loads map them
    # (a 0.5B model: ready in a few seconds instead of tens; the built-in model: ~1 s sooner
    # and ~60 MB less resident). About 1.1-1.3x the GGUF file per model; the least recently
    # used entries go past weight_cache_max_mb. Files under weight_cache_min_mb are not
    # cached (0: every file). Empty dir: state_dir/cache/weights. false: every load packs
    # from the file, nothing is written.
    weight_cache: bool = True
    weight_cache_dir: str = ""
    weight_cache_max_mb: PositiveInt = 16384
    weight_cache_min_mb: NonNegativeInt = 0


class WatchdogConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`[watchdog]`: the deadlines every model's steps run under (service/wedge/watchdog.py).
    The one place their defaults are written; the docs name the keys. A model's own
    `watchdog = {...}` overrides any of them for that model (`watchdog_for`). `[tp]`, their
    old section, is still read as an alias (a deprecation is logged once)."""

    # A step (or probe) running longer is a wedge: 503 for its requests, the model recovers.
    step_timeout_s: PositiveFloat = 30.0
    # How long a wedged step's abort may take before the deadman writes forensics, exits 70.
    abort_deadline_s: PositiveFloat = 60.0
    # An idle model runs one tiny step this often, so a wedge shows before a request hits it.
    probe_interval_s: PositiveFloat = 30.0


TpConfig = WatchdogConfig  # the old name, for code written against [tp]


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A model's `[default_models.speculative]`: decode steps verify a draft of the next
    tokens in one forward (engine/speculation/speculative.py); greedy and sampled output unchanged."""

    # "ngram": prompt lookup, the draft copied from where the text's last tokens occurred
    # before (code edits, quoted documents, extracted fields); "draft": a small model of the
    # same vocabulary (`source`) proposes the tokens greedily (engine/speculation/draft_model.py)
    method: Literal["ngram", "draft"] = "ngram"
    # the most tokens a draft has (each sequence adapts below it to its acceptance)
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # "draft" only: the draft model's file, the syntax of a model's `source` (builtin:, hf:,
    # a path or a name in node.model_dirs); its vocabulary must be the target's, token for
    # token. It runs on the target's first device, whole (not split under tp).
    source: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None

    def __post_init__(self) -> None:
        if self.method == "draft" and self.source is None:
            raise ValueError('method "draft" needs `source`, the draft model\'s file')
        if self.method != "draft" and self.source is not None:
            raise ValueError('`source` is for method "draft" only')


class WatchdogOverride(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A model's `watchdog = {...}`: the `[watchdog]` keys it sets for itself."""

    step_timeout_s: PositiveFloat | None = None
    abort_deadline_s: PositiveFloat | None = None
    probe_interval_s: PositiveFloat | None = None


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`[kv_events]`: the prefix cache's changes published for a KV-aware router, in vLLM's
    KV-events format (msgpack over ZeroMQ), so that llm-d's indexer can route a conversation
    to the node that holds its prefix. Off unless enabled."""

    enabled: bool = False
    # The PUB socket. As vLLM decides it: an address with "*" or "::", or ipc:// / inproc://,
    # is bound; any other is connected to (a central indexer that binds).
    endpoint: str = "tcp://127.0.0.1:5557"
    # A ROUTER socket (always bound) that replays missed batches from a sequence number;
    # empty: no replay.
    replay_endpoint: str = ""
    # Every batch's topic; {host} (this machine's name) and {model} are filled in. llm-d reads
    # "kv@<pod>@<model>".
    topic: str = "kv@{host}@{model}"
    # Batches kept for replay (also at most 64 MiB of them).
    replay_batches: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10_000
    # The events carry prompt tokens and have no authentication: an endpoint that is not
    # loopback (tcp://*, tcp://0.0.0.0, a remote indexer, …) is refused (exit 78) unless this
    # says, explicitly, that an unauthenticated feed off this machine is wanted. A tenant's
    # isolated (salted) blocks are never published; with prefix_cache_isolation = "none"
    # (the operator's opt-in) every cached block is.
    allow_unauthenticated: bool = False


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A `[[tenants]]` entry: a team sharing the node, known by its keys, shown by its name.

    Keys live in `keys_file` (one per line), never in this document: /v1/node, logs and
    metrics name tenants only. A tenant without keys_file is reached only through an admin
    key's `X-Neuron-Tenant` header (a router that authenticates its clients itself)."""

    name: TenantName
    keys_file: str | None = None
    # The tenant's share of the node's tokens against the others' (fair service).
    weight: PositiveFloat = 1.0
    # Its sequences running at once, its requests waiting, its tokens (prompt and
    # completion) in any minute; past one: 429 with Retry-After. None: no limit of its own.
    max_sequences: PositiveInt | None = None
    max_queued: NonNegativeInt | None = None
    tokens_per_minute: PositiveInt | None = None
    # Tenants naming the same group share cached prompt prefixes (e.g. one system prompt for
    # all); None: the tenant's prefix cache is its own.
    prefix_cache_group: TenantName | None = None


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One model to load: a `[[default_models]]` entry, or the body of `POST /v1/models`."""

    name: ModelName
    source: Annotated[str, msgspec.Meta(min_length=1)]
    tp: PositiveInt = 1
    devices: Literal["auto", "cpu"] | list[NonNegativeInt] = "auto"
    dtype: Dtype = "auto"
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    context: Annotated[int, msgspec.Meta(ge=16, le=1_048_576)] = 4096
    # The KV cache's memory budget in MiB (in all: split over the ranks under tp > 1); 0: enough for max_batch
    # sequences of `context` tokens. Sequences share it in blocks of 16 tokens as they grow,
    # so max_batch limits concurrency, not memory.
    kv_cache_mb: Annotated[int, msgspec.Meta(ge=0, le=16 << 20)] = 0
    # Reuse the K/V of a prompt prefix seen before; false: every prompt is computed from scratch.
    prefix_cache: bool = True
    # A chat request without max_tokens may generate this many tokens (cut to what the context
    # leaves after the prompt); 0: to the end of the context, as OpenAI does.
    default_max_tokens: Annotated[int, msgspec.Meta(ge=0, le=1_048_576)] = 0
    # How the model writes tool calls (engine/text/tools/tool_call_format.py); "auto": read from its
    # chat template (Hermes/Qwen unless the template writes Llama 3.x's or Mistral's syntax).
    tool_call_format: Literal["auto", "hermes", "llama3", "mistral", "mistral_args"] = "auto"
    # This model's own watchdog deadlines, over `[watchdog]`'s (e.g. a long prefill on a CPU:
    # `watchdog = {step_timeout_s = 120}`); None: the node's.
    watchdog: WatchdogOverride | None = None
    # Speculative decoding (`speculative = {method = "ngram", num_tokens = 4}`); None: off.
    speculative: SpeculativeConfig | None = None


class NeuronConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    watchdog: WatchdogConfig = msgspec.field(default_factory=WatchdogConfig)
    kv_events: KvEventsConfig = msgspec.field(default_factory=KvEventsConfig)
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)
    default_models: list[ModelConfig] = msgspec.field(
        default_factory=lambda: [ModelConfig(name=BUILTIN_MODEL_NAME, source=BUILTIN_MODEL_SOURCE)]
    )
    # Where this config came from ("<built-in default>" without a file); not a TOML key.
    source_path: str = "<built-in default>"

    @property
    def state_path(self) -> Path:
        return Path(self.node.state_dir)

    @property
    def weight_cache_path(self) -> Path:
        """Where packed weights are cached (`node.weight_cache_dir`, default under state_dir)."""
        return Path(self.node.weight_cache_dir or Path(self.node.state_dir) / "cache" / "weights")

    @property
    def model_dir_paths(self) -> list[Path]:
        return [Path(p) for p in self.node.model_dirs]


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "server": ServerConfig,
    "node": NodeConfig,
    "watchdog": WatchdogConfig,
    "tp": WatchdogConfig,  # the old name of [watchdog]: _fold_tp_alias
    "kv_events": KvEventsConfig,
}


def watchdog_for(config: NeuronConfig, spec: ModelConfig) -> WatchdogConfig:
    """The deadlines `spec`'s steps run under: its own `watchdog` keys over `[watchdog]`."""
    if spec.watchdog is None:
        return config.watchdog
    own = {k: v for k, v in msgspec.structs.asdict(spec.watchdog).items() if v is not None}
    return msgspec.structs.replace(config.watchdog, **own)


_tp_alias_warned = False


def _fold_tp_alias(data: dict[str, Any], origin: str, from_env: dict[str, str]) -> dict[str, str]:
    """`[tp]` (and NEURON_TP_*) read as `[watchdog]`, logging the deprecation once per
    process; a key set in both is an error. Returns {"watchdog.key": "tp.key"} for the keys
    moved, so that an error names what the operator wrote."""
    global _tp_alias_warned
    tp = data.pop("tp", None)
    if tp is None:
        return {}
    if not isinstance(tp, dict):
        raise ConfigError(f"{origin}: key tp: [tp] is not a table")
    watchdog = data.setdefault("watchdog", {})
    if not isinstance(watchdog, dict):
        raise ConfigError(f"{origin}: key watchdog: [watchdog] is not a table")
    moved: dict[str, str] = {}
    for key, value in tp.items():
        # NEURON_TP_X overrides the file's watchdog.X, as any variable overrides the file.
        from_file = f"tp.{key}" not in from_env or f"watchdog.{key}" in from_env
        if key in watchdog and from_file:
            raise ConfigError(
                f"{origin}: key tp.{key}: also set as watchdog.{key}; [tp] is the old name "
                "of [watchdog]: set it there only"
            )
        watchdog[key] = value
        moved[f"watchdog.{key}"] = f"tp.{key}"
    if not _tp_alias_warned:
        _tp_alias_warned = True
        log.warning(
            "%s: [tp] (and NEURON_TP_*) is the old name of [watchdog] (NEURON_WATCHDOG_*): "
            "read as [watchdog]; rename it",
            origin,
        )
    return moved


def parse_listen(address: str) -> tuple[str, int]:
    """Split "HOST:PORT" (IPv6 as "[::1]:PORT"); raise ValueError naming what is wrong."""
    match = _LISTEN_RE.match(address)
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT with a port from 1 to 65535")
    return match["host"].strip("[]"), int(match["port"])


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; any other name or address is exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def has_api_keys(config: NeuronConfig) -> bool:
    """Whether any key is configured for /v1: api_key_file, or a tenant's keys_file."""
    return config.server.api_key_file is not None or any(
        t.keys_file is not None for t in config.tenants
    )


def exposed_listeners(config: NeuronConfig) -> list[str]:
    """The `server.listen` addresses that are refused: not loopback, with no API key, and
    no explicit `allow_unauthenticated`."""
    server = config.server
    if has_api_keys(config) or server.allow_unauthenticated:
        return []
    exposed = []
    for address in server.listen:
        try:
            host, _ = parse_listen(address)
        except ValueError:
            continue  # reported on its own
        if not is_loopback_host(host):
            exposed.append(address)
    return exposed


def _msgspec_path(message: str) -> tuple[str, str]:
    """Turn msgspec's "…  - at `$.tp.step_timeout_s`" into ("tp.step_timeout_s", "…")."""
    detail, _, where = message.rpartition(" - at `")
    if not detail:  # an error at the root has no " - at …"
        detail, key = message, ""
    else:
        key = where.rstrip("`").removeprefix("$").removeprefix(".")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", detail)
    if unknown:
        key = f"{key}.{unknown[1]}" if key else unknown[1]
        detail = "unknown key"
    return key, detail


def _decode(data: dict[str, Any], origin: str, from_env: dict[str, str]) -> NeuronConfig:
    data = dict(data)
    if "source_path" in data:  # not a TOML key, whatever the Struct says
        raise ConfigError(f"{origin}: key source_path: unknown key")
    renamed = _fold_tp_alias(data, origin, from_env)
    try:
        return msgspec.convert(data, NeuronConfig, strict=True)
    except msgspec.ValidationError as exc:
        key, detail = _msgspec_path(str(exc))
        if key in renamed:
            key = renamed[key]
        if key in from_env:
            key = f"{key} (from {from_env[key]})"
        raise ConfigError(f"{origin}: key {key or '<root>'}: {detail}") from None


def _field_kind(struct: type[msgspec.Struct], key: str) -> str:
    """ "str", "list" or "other": how an environment value for `key` is read."""
    field = next(f for f in msgspec.structs.fields(struct) if f.name == key)
    kind = typing.get_origin(field.type) or field.type
    if kind is list:
        return "list"
    if field.type is str or field.type == (str | None):
        return "str"
    return "other"


def _parse_env_value(raw: str, kind: str = "other") -> Any:
    """An override's value: strings as given; lists as TOML arrays or comma-separated;
    anything else as a TOML value (numbers, booleans), or the raw string (which then fails
    type checking, naming the variable)."""
    if kind == "str":
        return raw
    if kind == "list" and not raw.lstrip().startswith("["):
        return [part.strip() for part in raw.split(",") if part.strip()]
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _env_overrides(data: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    """Apply NEURON_<SECTION>_<KEY>=value in place; return {"section.key": variable}."""
    applied: dict[str, str] = {}
    for var, raw in sorted(environ.items()):
        if not var.startswith("NEURON_"):
            continue
        rest = var.removeprefix("NEURON_").lower()
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue  # NEURON_FAILPOINTS, NEURON_NCCL_LIBRARY, …: not config keys
        key = rest.removeprefix(section + "_")
        if key not in _SECTIONS[section].__struct_fields__:
            raise ConfigError(f"environment: {var}: unknown key {section}.{key}")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{var}: [{section}] is not a table")
        table[key] = _parse_env_value(raw, _field_kind(_SECTIONS[section], key))
        applied[f"{section}.{key}"] = var
    return applied


MAX_CORS_ORIGINS = 64
_ORIGIN_RE = re.compile(
    r"^https?://(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::(?P<port>\d{1,5}))?$"
)


def cors_origin_problem(origins: list[str]) -> str | None:
    """Why `server.cors_allow_origins` is unusable, or None."""
    if len(origins) > MAX_CORS_ORIGINS:
        return f"{len(origins)} origins; at most {MAX_CORS_ORIGINS}"
    for i, value in enumerate(origins):
        match = _ORIGIN_RE.match(value)
        port = match.group("port") if match else None
        if value != "*" and (not match or (port is not None and not 0 < int(port) < 65536)):
            return (
                f"[{i}] {value[:80]!r} is not an origin: http(s)://HOST[:PORT] with no path "
                'or trailing "/" (as a browser sends it), or "*"'
            )
    return None


def _validate(config: NeuronConfig, origin: str) -> None:
    def fail(key: str, detail: str) -> None:
        raise ConfigError(f"{origin}: key {key}: {detail}")

    if not config.server.listen:
        fail("server.listen", "needs at least one HOST:PORT")
    for i, address in enumerate(config.server.listen):
        try:
            parse_listen(address)
        except ValueError as exc:
            fail(f"server.listen[{i}]", str(exc))
    if (config.server.tls_cert is None) != (config.server.tls_key is None):
        fail("server.tls_cert", "tls_cert and tls_key must be set together")
    cors_problem = cors_origin_problem(config.server.cors_allow_origins)
    if cors_problem is not None:
        fail("server.cors_allow_origins", cors_problem)
    if config.server.prefix_cache_isolation == "api_key" and not has_api_keys(config):
        fail(
            "server.prefix_cache_isolation",
            '"api_key" needs server.api_key_file or a tenant with keys_file',
        )
    _validate_tenants(config, fail)
    for key in ("tls_cert", "tls_key", "api_key_file", "admin_key_file", "metrics_key_file"):
        value = getattr(config.server, key)
        if value is not None and not Path(value).is_file():
            fail(f"server.{key}", f"{value} is not a readable file")
    exposed = exposed_listeners(config)
    if exposed:
        fail(
            "server.listen",
            f"{', '.join(exposed)} is not a loopback address and server.api_key_file is not "
            "set: anyone who can reach it could use and load models. Set api_key_file, or "
            "server.allow_unauthenticated = true if that is really wanted",
        )
    if config.kv_events.enabled:
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(config.kv_events, key)
            match = _ZMQ_ENDPOINT_RE.match(value)
            port = match.group("port") if match else None
            if (value or key == "endpoint") and (
                not match or (port not in (None, "*") and not 0 < int(port) < 65536)
            ):
                fail(
                    f"kv_events.{key}",
                    f"{value!r} is not tcp://HOST:PORT, ipc://PATH or inproc://NAME",
                )
            if value and not config.kv_events.allow_unauthenticated and not _zmq_is_local(value):
                fail(
                    f"kv_events.{key}",
                    f"{value!r} is not a loopback address: anyone who can reach it reads "
                    "the prompts' tokens, unauthenticated. Use tcp://127.0.0.1:PORT or "
                    "ipc://, or kv_events.allow_unauthenticated = true if that is really wanted",
                )
        try:
            config.kv_events.topic.format(host="h", model="m")
        except (KeyError, IndexError, ValueError) as exc:
            fail("kv_events.topic", f"only {{host}} and {{model}} may be filled in ({exc!r})")
    if len(config.default_models) > config.node.max_models:
        fail(
            "default_models",
            f"{len(config.default_models)} models but node.max_models = {config.node.max_models}",
        )
    seen: set[str] = set()
    for i, model in enumerate(config.default_models):
        if model.name in seen:
            fail(f"default_models[{i}].name", f"duplicate model name {model.name!r}")
        seen.add(model.name)
        if isinstance(model.devices, list):
            if len(model.devices) != model.tp:
                fail(
                    f"default_models[{i}].devices",
                    f"lists {len(model.devices)} devices but tp = {model.tp}",
                )
            if len(set(model.devices)) != len(model.devices):
                fail(f"default_models[{i}].devices", "lists a device twice")


def _zmq_is_local(endpoint: str) -> bool:
    """An ipc:// or inproc:// endpoint, or tcp:// on a loopback address ("*" is every
    interface)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return is_loopback_host(host)


def _validate_tenants(config: NeuronConfig, fail: Callable[[str, str], None]) -> None:
    seen: set[str] = set()
    for i, tenant in enumerate(config.tenants):
        if tenant.name in seen:
            fail(f"tenants[{i}].name", f"duplicate tenant name {tenant.name!r}")
        if tenant.name.startswith("key-") or tenant.name == OPERATOR_TENANT:
            fail(
                f"tenants[{i}].name",
                f'{tenant.name!r}: "key-…" and "{OPERATOR_TENANT}" name keys of '
                "api_key_file and admin_key_file",
            )
        seen.add(tenant.name)
        if tenant.keys_file is not None and not Path(tenant.keys_file).is_file():
            fail(f"tenants[{i}].keys_file", f"{tenant.keys_file} is not a readable file")


def _fill_defaults(config: NeuronConfig, origin: str) -> NeuronConfig:
    state_dir = config.node.state_dir or str(default_state_dir())
    model_dirs = config.node.model_dirs or [str(Path(state_dir) / "models")]
    node = msgspec.structs.replace(config.node, state_dir=state_dir, model_dirs=model_dirs)
    return msgspec.structs.replace(config, node=node, source_path=origin)


def config_from_mapping(
    data: dict[str, Any], *, origin: str, environ: dict[str, str] | None = None
) -> NeuronConfig:
    """Decode an already-parsed TOML document plus environment overrides."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    from_env = _env_overrides(data, dict(os.environ) if environ is None else environ)
    config = _decode(data, origin, from_env)
    _validate(config, origin)
    return _fill_defaults(config, origin)


def load_config(path: str | Path | None, *, environ: dict[str, str] | None = None) -> NeuronConfig:
    """Load `path` (None: the built-in default) and apply NEURON_* overrides.

    Raises ConfigError, naming the file and the key or line.
    """
    if path is None:
        return config_from_mapping({}, origin="<built-in default>", environ=environ)
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        detail = str(exc)
        if "line" not in detail:  # "(at end of document)": name the line all the same
            detail += f" (the document ends at line {max(1, len(text.splitlines()))})"
        raise ConfigError(f"{path}: invalid TOML: {detail}") from None
    return config_from_mapping(data, origin=str(path), environ=environ)
