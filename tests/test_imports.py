"""Every memfit module imports with only the core dependencies (no optional extras, no GPU)."""

import importlib
import pkgutil

import memfit


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(memfit.__path__, prefix="memfit.")]
    assert "memfit.train.loop" in names and "memfit.cli" in names
    for name in names:
        importlib.import_module(name)


def test_core_never_imports_benchmarks_or_tests():
    import pathlib

    for path in pathlib.Path(memfit.__path__[0]).rglob("*.py"):
        text = path.read_text()
        assert "import benchmarks" not in text and "from benchmarks" not in text, path
        assert "from tests" not in text and "import conftest" not in text, path
