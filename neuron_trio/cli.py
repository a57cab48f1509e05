"""The `neuron` command: serve (the daemon), gpus, check-config, pull, status.

Exit codes (sysexits, docs/DESIGN.md): 0 clean; 64 bad usage; 69 a model could not be loaded or
fetched; 70 the deadman fired; 78 bad config. Messages go to stderr; stdout carries only
what a command was asked for (`gpus --json`: exactly one JSON document; `pull`: the path).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from neuron_trio.config import NeuronConfig, exposed_listeners, load_config, parse_listen
from neuron_trio.errors import EX_CONFIG, EX_OK, EX_UNAVAILABLE, EX_USAGE, ConfigError, NeuronError
from neuron_trio.failpoints import ENV_VAR as FAILPOINTS_ENV
from neuron_trio.failpoints import parse as parse_failpoints
from neuron_trio.service.process.signals import flush_logs

log = logging.getLogger("neuron")

LOG_LEVEL_ENV = "NEURON_LOG_LEVEL"
SYSTEM_CONFIG = "/etc/neuron/neuron.toml"  # deploy/neuron.service's; `status` reads it by default
NVML_TIMEOUT_S = 5.0

# syslog priorities, as journald reads them from a "<N>" line prefix.
_SYSLOG_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


class SingleLineFormatter(logging.Formatter):
    """One record, one line (a traceback is folded into it with " | ").

    Under journald (`$JOURNAL_STREAM` set) the line starts with the syslog priority
    ("<4>") and carries no timestamp: the journal adds its own, and reads the level.
    """

    def __init__(self, *, journal: bool) -> None:
        fmt = (
            "%(name)s: %(message)s"
            if journal
            else "%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        super().__init__(fmt)
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\r", "")
        text = " | ".join(line for line in text.split("\n") if line.strip())
        if self.journal:
            priority = _SYSLOG_PRIORITY.get(record.levelno, 6 if record.levelno < 30 else 4)
            text = f"<{priority}>{text}"
        return text


def setup_logging(environ: dict[str, str] | None = None) -> None:
    """Readable single-line records to stderr, level from $NEURON_LOG_LEVEL (default INFO)."""
    env = os.environ if environ is None else environ
    raw = env.get(LOG_LEVEL_ENV, "INFO").strip().upper() or "INFO"
    level = logging.getLevelName(raw)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SingleLineFormatter(journal=bool(env.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else logging.INFO)
    if not isinstance(level, int):
        log.warning("%s=%r is not a log level; using INFO", LOG_LEVEL_ENV, raw)
    # Libraries that log every request or connection at INFO.
    for noisy in ("httpx", "httpcore", "hpack", "h2", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class UsageParser(argparse.ArgumentParser):
    """argparse, but bad usage exits 64 (EX_USAGE), not 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def _listen(value: str) -> str:
    try:
        parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def build_parser() -> UsageParser:
    parser = UsageParser(
        prog="neuron",
        description="GPU inference daemon. With no command: serve.",
        epilog="exit codes: 0 ok, 64 usage, 69 model unavailable, 70 deadman, 71 cannot listen, 78 bad config",
    )
    parser.add_argument(
        "--config",
        dest="top_config",
        metavar="PATH",
        help="TOML config (default: none, the built-in default: 127.0.0.1:8080, built-in model)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon (the default command)")
    serve.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help="TOML config")
    serve.add_argument(
        "--listen",
        metavar="HOST:PORT",
        action="append",
        type=_listen,
        help="listen here instead of server.listen (repeatable)",
    )

    gpus = sub.add_parser(
        "gpus",
        help="what NVML sees, live, and the NCCL library found",
        description="Exit 0, also without a GPU or driver; 69 if NVML hangs or fails.",
    )
    gpus.add_argument("--json", action="store_true", help="one JSON document on stdout")
    gpus.add_argument(
        "--timeout", type=float, default=NVML_TIMEOUT_S, metavar="S", help="NVML read timeout"
    )

    check = sub.add_parser("check-config", help="validate a config file: exit 0, or 78")
    check.add_argument("--config", metavar="PATH", required=True, default=argparse.SUPPRESS)

    pull = sub.add_parser("pull", help="fetch a model into the local cache")
    pull.add_argument(
        "source", metavar="SOURCE", help='"hf:REPO/FILE.gguf", "builtin:NAME" or a path'
    )
    pull.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help="TOML config")

    status = sub.add_parser(
        "status",
        help="one screen: state, models, queues, watchdog, the last forensics report",
        description=(
            "Read /v1/node and /metrics of the running daemon (with the API key of the "
            f"config; default config {SYSTEM_CONFIG} when it exists). Exit 0 when the node "
            "is serving, 69 when it is not (starting, draining, recovering, wedged, down)."
        ),
    )
    status.add_argument("--url", metavar="URL", help="default: the config's first listen address")
    status.add_argument("--json", action="store_true", help="one JSON document on stdout")
    status.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help="TOML config")
    return parser


def _config_path(args: argparse.Namespace) -> str | None:
    path = getattr(args, "config", None) or args.top_config
    return str(path) if path else None


# --- commands ---------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(_config_path(args))
        if args.listen:
            config = msgspec.structs.replace(
                config, server=msgspec.structs.replace(config.server, listen=list(args.listen))
            )
            exposed = exposed_listeners(config)
            if exposed:
                raise ConfigError(
                    f"--listen {', '.join(exposed)}: not a loopback address and "
                    f"server.api_key_file is not set in {config.source_path} (set it, or "
                    "server.allow_unauthenticated = true if an open API is really wanted)"
                )
    except ConfigError as exc:
        log.error("%s", exc)
        return EX_CONFIG
    from neuron_trio.service import heap

    heap.defer_collections()  # until the daemon has imported torch (service/heap.py)
    from neuron_trio import daemon  # heavy (torch, hypercorn): only when serving

    return daemon.run(config)


def nccl_status() -> dict[str, Any]:
    try:
        from neuron_trio.executor.tp.nccl_lib import describe

        return dict(describe())
    except Exception as exc:
        return {"error": f"NCCL status unavailable: {exc}"}


def gpus_document(timeout_s: float = NVML_TIMEOUT_S) -> dict[str, Any]:
    from neuron_trio.gpu.nvml import NvmlProbe

    doc = NvmlProbe().read_sync(timeout_s).to_dict()
    doc["nccl"] = nccl_status()
    return doc


def _human_gpus(doc: dict[str, Any]) -> str:
    lines = []
    if not doc["available"]:
        lines.append(f"no GPU/driver: {doc.get('reason')}")
    else:
        lines.append(f"driver {doc['driver_version']}, CUDA {doc['cuda_version']}")
    for g in doc["gpus"]:
        if g.get("error"):
            lines.append(f"GPU {g['index']}: {g['error']}")
            continue
        gib = 2**30
        extras = [
            f"util {g['utilization_gpu_pct']}%" if g["utilization_gpu_pct"] is not None else "",
            f"{g['temperature_c']}C" if g["temperature_c"] is not None else "",
            f"{g['power_w']:.0f}W" if g["power_w"] is not None else "",
        ]
        lines.append(
            f"GPU {g['index']}: {g['name']} {g['uuid']} bus {g['pci_bus_id']} "
            f"mem {g['memory_used_bytes'] / gib:.1f}/{g['memory_total_bytes'] / gib:.1f} GiB "
            + " ".join(e for e in extras if e)
        )
    nccl = doc["nccl"]
    if "error" in nccl:
        lines.append(f"NCCL: {nccl['error']}")
    else:
        details = ", ".join(f"{k} {v}" for k, v in nccl.items())
        lines.append(f"NCCL: {details}")
    return "\n".join(lines)


def cmd_gpus(args: argparse.Namespace) -> int:
    doc = gpus_document(args.timeout)
    if args.json and not doc["available"]:
        # A message, not data: stderr, so stdout stays one JSON document.
        print(f"neuron: no GPU/driver: {doc.get('reason')}", file=sys.stderr)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(_human_gpus(doc) + "\n")
    return EX_UNAVAILABLE if doc.get("error") else EX_OK


def cmd_check_config(args: argparse.Namespace) -> int:
    path = _config_path(args)
    try:
        config = load_config(path)
        failpoints = os.environ.get(FAILPOINTS_ENV, "")
        if failpoints:
            parse_failpoints(failpoints)
    except ConfigError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        return EX_CONFIG
    models = ", ".join(m.name for m in config.default_models) or "none"
    print(
        f"{path}: ok (listen {', '.join(config.server.listen)}; models {models})", file=sys.stderr
    )
    return EX_OK


def cmd_pull(args: argparse.Namespace) -> int:
    try:
        config: NeuronConfig = load_config(_config_path(args))
    except ConfigError as exc:
        log.error("%s", exc)
        return EX_CONFIG
    try:
        from neuron_trio.service.sources import pull
    except ImportError as exc:
        log.error("pull is unavailable: %s", exc)
        return EX_UNAVAILABLE
    try:
        path: Path = pull(args.source, config)
    except NeuronError as exc:
        log.error("%s", exc)
        return int(getattr(exc, "exit_code", EX_UNAVAILABLE))
    sys.stdout.write(f"{path}\n")
    return EX_OK


def cmd_status(args: argparse.Namespace) -> int:
    from neuron_trio import status

    path = _config_path(args)
    if path is None and Path(SYSTEM_CONFIG).is_file():
        path = SYSTEM_CONFIG
    try:
        config = load_config(path)
        key = status.api_key(config)
    except ConfigError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        return EX_CONFIG
    url = args.url or status.default_url(config)
    try:
        found = status.fetch_status(url, key=key, config=config)
    except status.StatusError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        if args.json:
            sys.stdout.write(json.dumps({"url": url, "serving": False, "error": str(exc)}) + "\n")
        return EX_UNAVAILABLE
    sys.stdout.write(status.as_json(found, url=url) if args.json else status.render(found, url=url))
    return found.exit_code()


COMMANDS = {
    "serve": cmd_serve,
    "gpus": cmd_gpus,
    "check-config": cmd_check_config,
    "pull": cmd_pull,
    "status": cmd_status,
}


def use_pci_bus_order(environ: dict[str, str] | None = None) -> None:
    """Make CUDA number GPUs as NVML does (PCI bus order); before anything initialises CUDA.

    GPU indices in the config, `neuron gpus` and placement are NVML's; CUDA's default order
    is fastest first, which on a mixed machine is another numbering.
    """
    env: Any = os.environ if environ is None else environ
    order = env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if order != "PCI_BUS_ID":
        log.warning(
            "CUDA_DEVICE_ORDER=%s: GPU indices in the config and placement are NVML's (PCI bus "
            "order) and may name other GPUs than CUDA's numbering",
            order,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    use_pci_bus_order()
    command = args.command or "serve"
    if command == "serve" and not hasattr(args, "listen"):
        args.listen = None
    try:
        return COMMANDS[command](args)
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The console script: `main`, then a prompt exit once the daemon has stopped.

    After a drain every model is unloaded and the logs are flushed; what is left is the
    interpreter's teardown of torch and its thread pools (about 2 s for the built-in model),
    which only delays systemd's view of a clean stop.
    """
    code = main()
    flush_logs()
    os._exit(code)


if __name__ == "__main__":
    entry()
