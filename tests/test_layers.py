"""The layers of docs/DESIGN.md import one way only."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "neuron_trio"

# layer -> modules (top-level names under neuron_trio, or third-party roots) it must not import
FORBIDDEN = {
    "config": {"gpu", "engine", "parallel", "service", "http", "daemon", "cli", "torch", "trio"},
    "errors": {"config", "gpu", "engine", "parallel", "service", "http", "daemon", "cli"},
    "failpoints": {"gpu", "engine", "parallel", "service", "http", "daemon", "cli", "trio"},
    "gpu": {"engine", "parallel", "service", "http", "daemon", "cli", "torch"},
    "engine": {"parallel", "service", "http", "daemon", "cli", "trio", "starlette", "hypercorn"},
    "parallel": {"service", "http", "daemon", "cli", "starlette", "hypercorn"},
    "service": {"http", "daemon", "cli", "starlette", "hypercorn"},
    "http": {"engine", "parallel", "daemon", "cli", "torch"},
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.add(parts[1] if parts[0] == "neuron_trio" and len(parts) > 1 else parts[0])
    return found


def _layer_files(layer: str) -> list[Path]:
    if (PACKAGE / layer).is_dir():
        return sorted((PACKAGE / layer).rglob("*.py"))
    return [PACKAGE / f"{layer}.py"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer: str) -> None:
    violations = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _layer_files(layer)
        if path.exists() and "_nccl_cffi" not in path.name
        for name in _imports(path) & FORBIDDEN[layer]
    ]
    assert not violations, violations


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom neuron_trio.http import app\n")
    assert {"torch", "http"} <= _imports(bad)
