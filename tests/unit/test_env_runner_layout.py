"""The environment library's layout shows its concepts: task sets, harnesses and runtimes
each in a subpackage, and no import cycle among its modules (counting the imports made
only for type checking: a cycle there is still two modules that cannot be read apart)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "env_runner" / "treadle" / "env_runner"
PREFIX = "treadle.env_runner"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PREFIX, *parts])


def top_level_imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports at module level (in ``if`` blocks such
    as ``if TYPE_CHECKING:`` too; imports inside functions are deferred and left out)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If):
            body.extend(node.body + node.orelse)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith(PREFIX + ".")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: top_level_imports(path) & modules.keys() - {name} for name, path in modules.items()
    }


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_env_runner_layout_has_no_import_cycle() -> None:
    edges = graph()
    assert f"{PREFIX}.environments" in edges  # the walk found the package
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_env_runner_layout_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_env_runner_layout_harnesses_and_runtimes_stand_alone() -> None:
    """Environments are built from harnesses and runtimes, never the reverse."""
    edges = graph()
    below = [m for m in edges if m.startswith((f"{PREFIX}.harnesses", f"{PREFIX}.runtimes"))]
    assert {f"{PREFIX}.harnesses.command", f"{PREFIX}.runtimes.sandbox"} <= set(below)
    for module in below:
        assert f"{PREFIX}.environments" not in edges[module], module
    for module in (m for m in below if m.startswith(f"{PREFIX}.runtimes")):
        assert not any(m.startswith(f"{PREFIX}.harnesses") for m in edges[module]), module


def test_env_runner_layout_concepts_have_their_subpackages() -> None:
    for sub, files in {
        "tasksets": ["base.py"],
        "harnesses": ["base.py", "chat.py", "command.py", "agents.py"],
        "runtimes": ["base.py", "local.py", "sandbox.py", "container.py"],
    }.items():
        for name in ["__init__.py", *files]:
            assert (PACKAGE / sub / name).is_file(), f"{sub}/{name}"
    assert (PACKAGE / "service.py").is_file()
