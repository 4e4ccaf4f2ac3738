"""No import cycle among llm_packing's modules, counting the imports made inside functions: a cycle hidden behind a
function-level import still ties two modules into one, and breaks as soon as either import moves to the top."""

import ast
import pathlib

import llm_packing


PACKAGE = pathlib.Path(llm_packing.__file__).parent


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (`from .x import y`, `from . import x`, `llm_packing.x`)."""
    modules = {path.stem for path in package.glob("*.py")}
    graph = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llm_packing."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[1] for a in node.names if a.name.startswith("llm_packing.")}
        graph[path.stem] = (imported & modules) - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None."""
    state = {}  # module -> "open" while on the current path, "done" once fully explored

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert {"layout", "dataset", "collator", "streaming"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "c.py").write_text("import llm_packing.a\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_the_packed_layout_has_one_home():
    # The modules that lay out or check packed rows take the rules from layout.py, not from each other.
    graph = import_graph()
    for module in ("dataset", "streaming", "collator", "documents", "token_columns"):
        assert "layout" in graph[module], module
    assert "dataset" not in graph["collator"] | graph["documents"] | graph["streaming"]
