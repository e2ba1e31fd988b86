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


def test_the_train_command_imports_the_trainer_only_where_a_process_trains():
    """A torchrun launcher and a supervisor only start processes: importing ``memfit train``'s command must not
    pull in transformers, PEFT, DeepSpeed, the planner or the trainer (seconds before any rank starts)."""
    import json
    import subprocess
    import sys

    probe = (
        "import json, sys\n"
        "import memfit.cli, memfit.commands.train\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft', 'deepspeed')"
        " or m.startswith(('memfit.planner', 'memfit.train.loop', 'memfit.models')))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == []
