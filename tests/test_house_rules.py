"""The package layout is layered: no import cycle between memfit's packages (and so none between modules)."""

import ast
import collections
from pathlib import Path

import memfit

ROOT = Path(memfit.__file__).parent


def _package(module: str) -> str:
    """``memfit.planner.trace`` -> ``planner``; top-level modules (``memfit.errors``) are their own node."""
    return module.split(".")[1]


def package_graph() -> dict[str, set[str]]:
    """Edges between packages from every import statement, at any depth (a lazy import counts too).
    ``__main__`` modules are entry points that nothing imports, and are left out."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in ROOT.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        module = ".".join(("memfit", *path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "memfit"]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.startswith("memfit.") and _package(target) != _package(module):
                    edges[_package(module)].add(_package(target))
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_import_graph_has_no_cycle():
    edges = package_graph()
    assert "planner" in edges and "step" in edges["planner"] and "planner" in edges["train"]
    assert _cycle(edges) is None, _cycle(edges)


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_nothing_below_commands_sees_argparse():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("commands", "cli.py"):
            continue
        assert "argparse" not in path.read_text(), rel


def test_tests_never_import_from_benchmarks():
    """Logic a test needs lives in the library; benchmarks are only run, as subprocesses."""
    tests = Path(__file__).parent
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("benchmarks"), path.relative_to(tests)
            if isinstance(node, ast.Attribute):
                assert node.attr != "spec_from_file_location", path.relative_to(tests)
