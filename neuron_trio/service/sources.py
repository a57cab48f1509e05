"""Model sources: `builtin:NAME`, a local path under `node.model_dirs`, `hf:REPO/FILE.gguf`.

Every function here blocks (file system, network): call them on a worker thread from trio.
Hub downloads go through huggingface_hub into the standard hub cache, so `HF_HOME`,
`HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_ENDPOINT` work as everywhere else (they are read when
huggingface_hub is first imported). Foreign errors become SourceError here, once.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuron_trio.config import NeuronConfig
from neuron_trio.errors import SourceError
from neuron_trio.executor.api import builtin_model_path
from neuron_trio.service.process.download_progress import ByteProgress, reporting_tqdm

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class HubFile:
    repo_id: str
    filename: str
    revision: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf:{self.repo_id}{rev}/{self.filename}"


@dataclass(frozen=True)
class HubLimits:
    """What a runtime load (POST /v1/models) may fetch from the hub: repos matching one of
    `allow_repos` (`fnmatch` globs), files of at most `max_bytes`."""

    allow_repos: tuple[str, ...]
    max_bytes: int

    @classmethod
    def from_config(cls, config: NeuronConfig) -> HubLimits:
        return cls(tuple(config.node.hf_allow_repos), config.node.hf_max_download_bytes)

    def check_repo(self, source: str, hub: HubFile) -> None:
        if not any(fnmatch.fnmatchcase(hub.repo_id, p) for p in self.allow_repos):
            allowed = ", ".join(self.allow_repos) or "none"
            raise SourceError(
                f"source {source!r}: repository {hub.repo_id} is not one a runtime load may "
                f"fetch (node.hf_allow_repos: {allowed})"
            )

    def check_size(self, source: str, size: int | None) -> None:
        if size is None:
            raise SourceError(f"source {source!r}: the hub does not say how large the file is")
        if size > self.max_bytes:
            raise SourceError(
                f"source {source!r}: the file is {size} bytes, more than a runtime load may "
                f"download (node.hf_max_download_bytes = {self.max_bytes})"
            )


def parse_hub_source(source: str) -> HubFile:
    """`hf:OWNER/NAME[@REVISION]/PATH/FILE.gguf` -> HubFile; SourceError if malformed."""
    rest = source.removeprefix("hf:")
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts):
        raise SourceError(
            f"source {source!r}: expected hf:OWNER/REPO/FILE.gguf (optionally OWNER/REPO@REVISION)"
        )
    name, _, revision = parts[1].partition("@")
    filename = "/".join(parts[2:])
    if not filename.endswith(".gguf"):
        raise SourceError(f"source {source!r}: only GGUF files are supported (FILE.gguf)")
    return HubFile(f"{parts[0]}/{name}", filename, revision or None)


def _within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def resolve_local(source: str, model_dirs: list[Path]) -> Path:
    """A local GGUF file that lies under one of `model_dirs` once symlinks are resolved.

    A relative path is looked up in each model directory in turn. Error messages quote the
    source as given, never where it resolves to (a symlink's target is nobody's business).
    """
    roots = [d.expanduser().resolve() for d in model_dirs]
    listed = ", ".join(str(d) for d in model_dirs) or "(none configured)"
    raw = Path(source.removeprefix("file:")).expanduser()
    candidates = [raw] if raw.is_absolute() else [d / raw for d in roots]
    for candidate in candidates:
        resolved = candidate.resolve()
        if not any(_within(resolved, root) for root in roots):
            raise SourceError(
                f"source {source!r} is outside the model directories (node.model_dirs: {listed})"
            )
        if resolved.is_file():
            return resolved
    where = str(candidates[0]) if raw.is_absolute() else f"any of {listed}"
    raise SourceError(f"source {source!r}: no such file in {where}")


def check_cache_dir(cache_dir: Path) -> None:
    """Raise SourceError naming `cache_dir` if it cannot be created or written."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceError(
            f"hub cache directory {cache_dir} cannot be created: {exc.strerror or exc} "
            "(set HF_HOME or HF_HUB_CACHE to a writable directory)"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".neuron-write-check-", dir=cache_dir)
    except OSError as exc:
        raise SourceError(
            f"hub cache directory {cache_dir} is not writable: {exc.strerror or exc} "
            "(set HF_HOME or HF_HUB_CACHE to a writable directory)"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _check_before_download(source: str, hub: HubFile, limits: HubLimits, cache_dir: Path) -> bool:
    """With `limits`: the repo is allowed and the file, unless already cached, is small
    enough (its size asked of the hub before a byte of it is fetched). True if cached."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

    limits.check_repo(source, hub)
    cached = try_to_load_from_cache(
        hub.repo_id, hub.filename, cache_dir=cache_dir, revision=hub.revision
    )
    if isinstance(cached, str):
        return True
    meta = get_hf_file_metadata(hf_hub_url(hub.repo_id, hub.filename, revision=hub.revision))
    limits.check_size(source, meta.size)
    return False


def resolve_hub(
    source: str,
    *,
    progress: Progress | None = None,
    quiet: bool = False,
    on_bytes: ByteProgress | None = None,
    limits: HubLimits | None = None,
) -> Path:
    """Download `hf:REPO/FILE.gguf` into the hub cache (or find it there); return its path.

    With `limits` (a runtime load), the repo must be allowed and the file small enough,
    both checked before the download starts. `on_bytes(done, total)` follows the download
    (service.process.download_progress).
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub import errors as hub_errors

    # huggingface_hub gives its logger a stderr handler of its own: its retries would print
    # twice, once bare. The root logger's handler (cli.setup_logging) prints them once.
    hub_logger = logging.getLogger("huggingface_hub")
    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    hub = parse_hub_source(source)
    cache_dir = Path(constants.HF_HUB_CACHE)
    offline = bool(constants.HF_HUB_OFFLINE)
    if not offline:
        check_cache_dir(cache_dir)
    if progress:
        where = "the hub cache (HF_HUB_OFFLINE)" if offline else constants.ENDPOINT
        progress(f"fetching {hub} from {where} into {cache_dir}")
    tqdm_class = None
    if limits is not None and offline:
        limits.check_repo(source, hub)  # nothing will be downloaded
    elif limits is not None:
        try:
            _check_before_download(source, hub, limits, cache_dir)
        except SourceError:
            raise
        except Exception as exc:
            raise SourceError(f"source {source!r}: cannot ask the hub for its size: {exc}") from exc
    if quiet or on_bytes is not None:
        tqdm_class = reporting_tqdm(on_bytes or (lambda done, total: None), quiet=quiet)
    try:
        path = hf_hub_download(
            hub.repo_id,
            hub.filename,
            revision=hub.revision,
            cache_dir=cache_dir,
            local_files_only=offline,
            tqdm_class=tqdm_class,
        )
    except hub_errors.LocalEntryNotFoundError as exc:
        if offline:
            raise SourceError(
                f"source {source!r}: not in the hub cache {cache_dir} and HF_HUB_OFFLINE is set"
            ) from exc
        raise SourceError(f"source {source!r}: cannot reach {constants.ENDPOINT}: {exc}") from exc
    except hub_errors.RepositoryNotFoundError as exc:
        raise SourceError(
            f"source {source!r}: repository {hub.repo_id} not found (or gated)"
        ) from exc
    except hub_errors.RevisionNotFoundError as exc:
        raise SourceError(f"source {source!r}: revision {hub.revision} not found") from exc
    except hub_errors.EntryNotFoundError as exc:
        raise SourceError(f"source {source!r}: {hub.filename} not found in {hub.repo_id}") from exc
    except hub_errors.HfHubHTTPError as exc:
        raise SourceError(f"source {source!r}: hub error: {exc}") from exc
    except OSError as exc:
        raise SourceError(f"source {source!r}: {exc.strerror or exc} ({cache_dir})") from exc
    except Exception as exc:  # network stacks raise their own types (httpx, requests)
        raise SourceError(f"source {source!r}: download failed: {exc}") from exc
    return Path(str(path))


def resolve_source(
    source: str,
    config: NeuronConfig,
    *,
    progress: Progress | None = None,
    on_bytes: ByteProgress | None = None,
    limits: HubLimits | None = None,
) -> Path:
    """The local GGUF file for `source`; blocking (may download). Raises SourceError.

    `progress`, when given, receives one-line human messages (for STATUS= and the log).
    `limits` (runtime loads) bound what may be fetched from the hub.
    """
    if source.startswith("builtin:"):
        return builtin_model_path(source.removeprefix("builtin:"))
    if source.startswith("hf:"):
        return resolve_hub(source, progress=progress, quiet=True, on_bytes=on_bytes, limits=limits)
    return resolve_local(source, config.model_dir_paths)


def pull(source: str, config: NeuronConfig) -> Path:
    """`neuron pull SOURCE`: fetch into the local cache with a progress bar on stderr.

    Built-in and local sources are only located (there is nothing to fetch).
    """
    if source.startswith("hf:"):
        return resolve_hub(source, progress=lambda msg: log.info("%s", msg), quiet=False)
    return resolve_source(source, config)
