"""The layers of docs/architecture.md hold: data flows one way, no module imports a higher layer, no cycle.

Read from the source with `ast`, so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exlnb"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Lowest first. A module may import its own layer and those below. An entry names one module, or with ".*" a
# package and every module in it, where no entry names the module itself: so an engine's modules, new ones
# included, are engines, and the shared vocabulary beside them is named one by one. A module no entry covers
# fails the test: it must be placed, not assumed.
LAYERS = (
    (
        "engine vocabulary",
        (
            "exlnb.engines",
            "exlnb.engines.base",
            "exlnb.engines.checks",
            "exlnb.engines.sampling",
            "exlnb.engines.declaration",
            "exlnb.engines.constraint",
            "exlnb.engines.schema_refs",
            "exlnb.engines.grammar",
            "exlnb.engines.tokenizer",
            "exlnb.engines.text",
            "exlnb.engines.vocab",
            "exlnb.engines.token_info",
            "exlnb.engines.registry",
            "exlnb.engines.formats",
            "exlnb.engines.options",
            "exlnb.engines.delivery",
            "exlnb.engines.job_options",
            "exlnb.engines.views",
        ),
    ),
    ("engines", ("exlnb.engines.*",)),  # cpu/, exllamav2*, exllamav3*, library_engine, remote/, ...
    (
        "prompts, measures and model folders",
        (
            "exlnb.templates.*",
            "exlnb.analysis",
            "exlnb.models",
            "exlnb.quantize",
            "exlnb.random_model",
            "exlnb.datasets",
            "exlnb.metrics",
            "exlnb.divergence",
        ),
    ),
    (
        "session",
        (
            "exlnb.streaming",
            "exlnb.token_records",
            "exlnb.near_ties",
            "exlnb.sample_tree",
            "exlnb.engine_thread",
            "exlnb.session.*",
        ),
    ),
    (
        "generation",
        (
            "exlnb.chat",
            "exlnb.request",
            "exlnb.generation",
            "exlnb.prepared_prompt",
            "exlnb.workload",
            "exlnb.loadtest",
            "exlnb.bench_result",
            "exlnb.scoring",
            "exlnb.branching",
            "exlnb.noise_floor",
            "exlnb.trees",
            "exlnb.tree_reference",
        ),
    ),
    ("widgets and magics", ("exlnb.widgets.*", "exlnb.magic_arguments", "exlnb.magics", "exlnb.quality_magics")),
    ("experiments and notebooks", ("exlnb.experiments.*", "exlnb.report", "exlnb.spread")),
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


def covers(entry: str, name: str) -> bool:
    package = entry.removesuffix(".*")
    return name == package or (entry.endswith(".*") and name.startswith(package + "."))


def layer_of(name: str) -> int:
    """The layer of the entry that names `name` itself, else of the innermost package entry that holds it."""
    matches = [
        (entry == name, len(entry), index)
        for index, (_, entries) in enumerate(LAYERS)
        for entry in entries
        if covers(entry, name)
    ]
    if not matches:
        raise AssertionError(f"{name} is in no layer: place it in LAYERS here and in docs/architecture.md")
    best = max(matches)
    if [m[:2] for m in matches].count(best[:2]) > 1:
        raise AssertionError(f"{name} is placed in several layers: keep one entry for it in LAYERS")
    return best[2]


GRAPH = {name: imported_modules(name) for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_has_its_place_in_one_layer(name):
    layer_of(name)


def test_a_module_left_out_of_the_layers_fails_rather_than_landing_on_top():
    with pytest.raises(AssertionError, match="exlnb.newcomer is in no layer"):
        layer_of("exlnb.newcomer")


def test_a_module_is_placed_by_its_own_entry_before_its_package_s():
    names = ("exlnb.engines.registry", "exlnb.engines.newcomer", "exlnb.engines", "exlnb.widgets.newcomer", "exlnb")
    assert [LAYERS[layer_of(name)][0] for name in names] == [
        "engine vocabulary",
        "engines",
        "engine vocabulary",
        "widgets and magics",
        "the package's front door",
    ]


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


def documented_layers() -> dict[str, list[str]]:
    """docs/architecture.md's layer table: each layer's name and the paths its row names, in its order."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("| Layer | Modules | Owns |") :].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return {row[0].removeprefix("| "): re.findall(r"`([^`]+)`", row[1]) for row in rows}


def test_the_documented_layer_table_names_modules_that_exist_in_the_layers_placed_here():
    documented = documented_layers()

    assert list(documented) == [name for name, _ in LAYERS]
    for layer, paths in documented.items():
        for path in paths:
            found = PACKAGE / path if (PACKAGE / path).exists() else PACKAGE.parent / path
            assert found.exists(), f"docs/architecture.md's layer table names {path}, which does not exist"
            if found.is_relative_to(PACKAGE):
                name = module_name(found / "__init__.py" if found.is_dir() else found)
                assert LAYERS[layer_of(name)][0] == layer, f"{path} is in the {layer} row, not in its layer here"


def test_the_layer_table_check_sees_a_module_that_is_gone(monkeypatch, tmp_path):
    page = tmp_path / "architecture.md"
    page.write_text(ARCHITECTURE.read_text().replace("`engines/views.py`", "`engines/view.py`"))
    monkeypatch.setattr(sys.modules[__name__], "ARCHITECTURE", page)

    with pytest.raises(AssertionError, match="names engines/view.py, which does not exist"):
        test_the_documented_layer_table_names_modules_that_exist_in_the_layers_placed_here()


MODULE_LINES_AT_MOST = 450  # the house's limit (issue 43): a module longer than this is asking to be split


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_longer_than_the_house_allows(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MODULE_LINES_AT_MOST, f"{MODULES[name]} has {lines} lines; split it by what its parts do"
