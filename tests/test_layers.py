"""The layers of docs/ARCHITECTURE.md import one way only, the engine's and the service's
sub-packages included."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "neuron_trio"
NEURON = {"config", "errors", "failpoints", "gpu", "engine", "executor", "service", "http"}
TOP = NEURON | {"daemon", "cli", "status"}

# The engine's shared vocabulary, which its sub-packages may use: plain data, no torch.
ENGINE_CORE = {"engine.types", "engine.block_pool", "engine.kv_events", "engine.c_heap"}
# The engine's own modules beside its sub-packages, and speculation (a part of the step):
# they join gguf, model and text together.
ENGINE_TOP = {
    f"engine.{p.stem}"
    for p in (PACKAGE / "engine").glob("*.py")
    if p.stem != "__init__" and f"engine.{p.stem}" not in ENGINE_CORE
} | {"engine.speculation"}
SERVICE_ACTORS = {"service.node", "service.model_actor"}

# unit (a module or package under neuron_trio) -> what it must not import: modules or packages
# under neuron_trio (a name forbids everything below it), or third-party roots.
FORBIDDEN: dict[str, set[str]] = {
    "config": TOP - {"config", "errors"} | {"torch", "trio"},
    "errors": TOP - {"errors"},
    "failpoints": TOP - {"failpoints", "errors"} | {"trio"},
    "gpu": {"engine", "executor", "service", "http", "daemon", "cli", "status", "torch"},
    "engine": {"executor", "service", "http", "daemon", "cli", "trio", "starlette", "hypercorn"},
    "engine.types": {"engine", "torch"} - {"engine.types"},
    "engine.c_heap": {"engine", "torch"} - {"engine.c_heap"},
    "engine.block_pool": {"torch", "engine.gguf", "engine.model", "engine.text"} | ENGINE_TOP,
    "engine.gguf": {"engine.model", "engine.text"} | ENGINE_TOP,
    "engine.model": {"engine.text"} | ENGINE_TOP,
    "engine.text": {"engine.model"} | ENGINE_TOP,
    # Speculation proposes from a sequence's tokens or a draft model: never from its text.
    "engine.speculation": {"engine.text"},
    "executor": {"service", "http", "daemon", "cli", "status", "starlette", "hypercorn"},
    "executor.tp": {"executor.executor", "executor.api"},
    # The service sees the engine through one face, executor/api.py (ALLOWED below).
    "service": {"engine", "executor", "http", "daemon", "cli", "status", "starlette", "hypercorn"},
    "service.wedge": SERVICE_ACTORS,
    "service.process": SERVICE_ACTORS | {"service.wedge", "service.metrics", "torch"},
    "service.metrics": SERVICE_ACTORS | {"service.wedge", "service.process"},
    # The actors' parts, one idea each (a request's way through a model: the queue, the
    # executor's calls, a prompt's intake; a model's start; the KV events): none imports the
    # actors.
    "service.requests": SERVICE_ACTORS,
    "service.kv_events": SERVICE_ACTORS,
    "service.model_start": SERVICE_ACTORS,
    # What the node reports (node_report reads the actors to write it): no torch.
    "service.documents": {"torch"},
    # What `neuron status` decodes: plain types, neither torch nor trio.
    "service.documents.node_document": SERVICE_ACTORS | {"torch", "trio"},
    "service.wedge.records": SERVICE_ACTORS | {"torch", "trio"},
    "http": {"engine", "executor", "daemon", "cli", "status", "torch"},
}

# unit -> what it may import although FORBIDDEN names something above it.
ALLOWED: dict[str, set[str]] = {"service": {"executor.api"}}


def _imports(path: Path) -> set[str]:
    """What `path` imports: modules under neuron_trio without the prefix (`engine.gguf.file`,
    and for `from neuron_trio.engine.gguf import quant` also `engine.gguf.quant`), or the
    top-level names of other packages."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module.startswith("neuron_trio"):
                names += [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "neuron_trio":
                if len(parts) > 1:
                    found.add(".".join(parts[1:]))
            else:
                found.add(parts[0])
    return found


def _forbids(forbidden: set[str], name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def _unit_files(unit: str) -> list[Path]:
    base = PACKAGE.joinpath(*unit.split("."))
    if base.is_dir():
        return sorted(base.rglob("*.py"))
    return [base.with_suffix(".py")]


@pytest.mark.parametrize("unit", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(unit: str) -> None:
    files = _unit_files(unit)
    assert files and all(f.exists() for f in files), f"{unit}: no such module or package"
    violations = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in files
        if "_nccl_cffi" not in path.name
        for name in sorted(_imports(path))
        if _forbids(FORBIDDEN[unit], name) and not _forbids(ALLOWED.get(unit, set()), name)
    ]
    assert not violations, violations


def test_every_package_is_in_a_layer() -> None:
    """A new package (or a renamed one) must be given its place in the table."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages <= NEURON, packages - NEURON
    for parent in ("engine", "executor", "service"):
        subs = {f"{parent}.{p.name}" for p in (PACKAGE / parent).iterdir() if p.is_dir()}
        subs = {s for s in subs if (PACKAGE.joinpath(*s.split(".")) / "__init__.py").exists()}
        assert subs <= set(FORBIDDEN), subs - set(FORBIDDEN)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nfrom neuron_trio.http import app\nfrom neuron_trio.engine.model.load import loader\n"
    )
    found = _imports(bad)
    assert {"torch", "http", "http.app", "engine.model.load", "engine.model.load.loader"} <= found
    assert _forbids(FORBIDDEN["engine.text"], "engine.model.load.loader")
    assert not _forbids(FORBIDDEN["engine.text"], "engine.types")


def test_the_service_sees_the_engine_through_executor_api_only() -> None:
    service = FORBIDDEN["service"]
    for name in ("engine.types", "engine.block_pool", "executor.executor", "executor.tp"):
        assert _forbids(service, name) and not _forbids(ALLOWED["service"], name), name
    assert _forbids(ALLOWED["service"], "executor.api.SequenceEvent")


MOST_MODULES_A_FOLDER = 14


def test_every_folder_holds_at_most_14_modules() -> None:
    """A folder that outgrows this is split by concept (as engine/text/structured and tools
    were from engine/text), so that each folder can be read as one idea."""
    crowded = {
        str(folder.relative_to(PACKAGE)): n
        for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := len([m for m in folder.glob("*.py") if m.name != "__init__.py"]))
        > MOST_MODULES_A_FOLDER
    }
    assert not crowded, crowded
