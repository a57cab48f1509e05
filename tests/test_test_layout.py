"""The test tree's own layout: helpers that several test files share live in fixture modules
(names not starting with `test_`), never in a `test_*.py` that another one imports: importing a
test module runs its collection-time code twice and makes its tests look like the importer's."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PACKAGE = ROOT / "neuron_trio"


def _module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _absolute(path: Path, root: Path, node: ast.ImportFrom) -> str:
    """The module `node` imports from, a relative import resolved against `path`'s package."""
    if node.level == 0:
        return node.module or ""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_test_module(name: str) -> bool:
    """`name` (dotted) is a test module under tests/: a part of it starts with `test_`."""
    parts = name.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") for p in parts)


def imported_test_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every test module (tests.….test_x) that the file at `path` imports, at any depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, root, node)
            # `from tests.service import test_sources` imports the module by its name.
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n for n in names if _is_test_module(n)}
    return {_owning_test_module(n) for n in found}


def _owning_test_module(name: str) -> str:
    """`tests.service.test_node.World` -> `tests.service.test_node`."""
    parts = name.split(".")
    last = max(i for i, p in enumerate(parts) if p.startswith("test_"))
    return ".".join(parts[: last + 1])


def test_no_test_module_imports_another() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in sorted(imported_test_modules(path))
        if name != _module_name(path)
    ]
    assert not violations, "\n".join(violations)


def _misplaced(tests: Path, package: Path) -> list[str]:
    """Each `test_<module>.py` named after a module of the package whose folder does not mirror
    that module's (tests/engine/text/ for neuron_trio/engine/text/chat.py); a test named after
    its own folder (tests/engine/model/test_model.py) is at home."""
    folders: dict[str, set[Path]] = {}
    for module in package.rglob("*.py"):
        folders.setdefault(module.stem, set()).add(module.parent.relative_to(package))
    return [
        f"{test.relative_to(tests)} tests {', '.join(str(f / name) for f in sorted(homes))}"
        for test in sorted(tests.rglob("test_*.py"))
        for name in [test.stem.removeprefix("test_")]
        if (homes := folders.get(name))
        and (folder := test.parent.relative_to(tests)) not in homes
        and folder.name != name
    ]


def test_a_test_named_after_a_module_sits_in_its_mirrored_folder() -> None:
    misplaced = _misplaced(TESTS, PACKAGE)
    assert not misplaced, "\n".join(misplaced)


def test_the_mirror_check_sees_a_misplaced_test(tmp_path: Path) -> None:
    for path in ("pkg/engine/text/chat.py", "pkg/engine/model/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    for path in ("tests/engine/test_chat.py", "tests/engine/model/test_model.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    assert _misplaced(tmp_path / "tests", tmp_path / "pkg") == [
        "engine/test_chat.py tests engine/text/chat"
    ]


def test_the_checker_sees_each_import_form(tmp_path: Path) -> None:
    folder = tmp_path / "tests" / "service"
    folder.mkdir(parents=True)
    bad = folder / "test_bad.py"
    bad.write_text(
        "from tests.service.test_node import World\n"
        "from .test_model_actor import Harness\n"
        "from ..engine.test_scheduler import _engine\n"
        "from tests.service import test_sources, fakes\n"
        "def f():\n    import tests.e2e.test_drills as drills\n"
        "from tests.service.node_fixtures import World\n"
    )
    assert imported_test_modules(bad, tmp_path) == {
        "tests.service.test_node",
        "tests.service.test_model_actor",
        "tests.engine.test_scheduler",
        "tests.service.test_sources",
        "tests.e2e.test_drills",
    }
