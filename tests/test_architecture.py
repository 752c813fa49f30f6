"""The layers of docs/architecture.md hold: data flows one way, no module imports a higher layer, no cycle.

Read from the source with `ast`, so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exlnb"

# Lowest first. A module may import its own layer and those below; every module must be in one.
LAYERS = (
    ("engines", ("exlnb.engines",)),
    ("prompts, measures and model folders", ("exlnb.templates", "exlnb.analysis", "exlnb.models", "exlnb.quantize",
                                              "exlnb.random_model", "exlnb.datasets", "exlnb.metrics")),
    ("session", ("exlnb.streaming", "exlnb.token_records", "exlnb.engine_thread", "exlnb.session")),
    ("generation", ("exlnb.chat", "exlnb.request", "exlnb.generation", "exlnb.workload", "exlnb.loadtest",
                    "exlnb.bench_result")),
    ("widgets and magics", ("exlnb.widgets", "exlnb.magics")),
    ("experiments and notebooks", ("exlnb.experiments", "exlnb.report")),
    ("the package's front door", ("exlnb",)),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The exlnb modules `name` imports anywhere in its source (`from pkg import module` names the module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {module for module in found if module in MODULES and module != name}


def layer_of(name: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS here and to docs/architecture.md")
    return max(matches)[1]


GRAPH = {name: imported_modules(name) for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_layer(name):
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {other} ({LAYERS[layer_of(other)][0]})"
        for other in sorted(GRAPH[name])
        if layer_of(other) > layer_of(name)
    ]
    assert not upward, "; ".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other) :] + [other]
            if other not in state and (cycle := visit(other, [*path, other])):
                return cycle
        state[name] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_there_is_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def private_attribute_uses(source: str) -> list[str]:
    """`thing._name` where `thing` is not `self`, `cls` or `super()`: reaching into another object's private state."""
    return [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and not (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")
    ]


@pytest.mark.parametrize("package", ["experiments", "widgets"])
def test_experiments_and_widgets_reach_into_no_private_state(package):
    uses = [
        f"{path.relative_to(PACKAGE.parent)} {use}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for use in private_attribute_uses(path.read_text())
    ]
    assert uses == []


def test_the_private_state_check_sees_reads_and_writes():
    source = "engine._pool = engine._scheduler.pool\nself._own = 1\nkind = engine.__class__\n"

    assert sorted(private_attribute_uses(source)) == ["line 1: ._pool", "line 1: ._scheduler"]


def test_importing_exlnb_in_a_script_does_not_load_the_widget_libraries():
    code = "import sys, exlnb; print(sorted(m for m in ('anywidget', 'traitlets', 'ipywidgets') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)

    assert run.stdout.strip() == "[]"
