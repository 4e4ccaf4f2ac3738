"""The package's layers, read from its import statements (those inside functions too: a cycle or an upward import
hidden behind a function-level import still ties two layers together, and breaks as soon as the import moves up).

- No import cycle among the modules.
- Each sub-package imports only the layers below it (`LAYERS`), as its `__init__` docstring says.
- The packing engine and the data path never import torch or transformers, so that planning needs neither.
"""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

import llm_packing


PACKAGE = pathlib.Path(llm_packing.__file__).parent

# Layer (a top-level module or sub-package) -> the layers it may import besides itself. `cli` and the package's own
# `__init__` (which imports lazily) may import anything.
LAYERS = {
    "errors": set(),
    "_moved": set(),
    "core": {"errors"},
    "_compat": {"errors"},
    "data": {"core", "errors"},
    "hook": {"core", "errors", "_compat"},
    "batches": {"core", "errors", "_compat", "hook"},
    "parallel": {"core", "errors", "_compat", "hook"},
    "trainers": {"core", "errors", "_compat", "hook", "batches", "data", "parallel"},
    "demo": {"core", "errors"},
    "train": {"cli"},
}
# Single modules of another layer a layer may import besides: the collator decodes the video frames `pack_dataset`
# planned with the same frame sampling (`batches/__init__`).
MODULES = {"batches": {"data.video"}}
# Third-party packages a layer must not import.
FORBIDDEN = {"core": {"torch", "transformers", "datasets", "pyarrow", "trl"}, "data": {"torch", "transformers", "trl"}}
# Modules allowed one of their layer's forbidden packages: data.video hands a video processor transformers' own
# `VideoMetadata`, imported in the functions that take that processor (so transformers is loaded already).
FORBIDDEN_EXCEPT = {"data.video": {"transformers"}}


def module_names(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    """Dotted module name inside the package (`hook.masks`, `__init__` for the package itself) -> its file."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return names


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom, known) -> set[str]:
    """The package modules an ImportFrom names, as dotted names."""
    if node.level == 0:
        if not (node.module or "").startswith("llm_packing."):
            return set()
        base = node.module.removeprefix("llm_packing.")
    else:
        here = module.split(".") if path.name == "__init__.py" and module != "__init__" else module.split(".")[:-1]
        here = [] if module == "__init__" else here
        anchor = here[: len(here) - (node.level - 1)] if node.level > 1 else here
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    targets = {f"{base}.{alias.name}" if base else alias.name for alias in node.names}
    found = {target for target in targets if target in known}
    return found or ({base} if base in known else {_longest_known(base, known)} - {None})


def _longest_known(name: str, known) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from .x import y`, `from . import x`, `llm_packing.x`)."""
    modules = module_names(package)
    graph = {}
    for module, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                imported |= _resolve(module, path, node, modules)
            elif isinstance(node, ast.Import):
                imported |= {_longest_known(a.name.removeprefix("llm_packing."), modules) for a in node.names
                             if a.name.startswith("llm_packing.")} - {None}
        graph[module] = imported - {module}
    return graph


def third_party_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def layer_of(module: str) -> str:
    return module.split(".")[0]


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
    graph = package_graph()
    assert {"core.rows", "data.pack", "batches.collator", "hook.masks", "hook.support.architectures"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_sees_function_level_imports_in_sub_packages(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .sub.b import x\n")
    (tmp_path / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (tmp_path / "c.py").write_text("import llm_packing.a\n")
    graph = import_graph(tmp_path)
    assert graph == {"__init__": set(), "sub": set(), "a": {"sub.b"}, "sub.b": {"a"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "sub.b", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


@functools.cache
def package_graph() -> dict[str, set[str]]:
    return import_graph()


@pytest.mark.parametrize("module", sorted(module_names()))
def test_each_module_imports_only_the_layers_below_it(module):
    layer = layer_of(module)
    if layer in ("cli", "__init__"):
        return
    upward = {target for target in package_graph()[module]
              if layer_of(target) not in LAYERS[layer] | {layer} and target not in MODULES.get(layer, set())}
    assert not upward, f"{module} ({layer}) imports {sorted(upward)}; it may import {sorted(LAYERS[layer])}"
    forbidden = third_party_imports(module_names()[module]) & FORBIDDEN.get(layer, set())
    forbidden -= FORBIDDEN_EXCEPT.get(module, set())
    assert not forbidden, f"{module} imports {sorted(forbidden)}"


def test_the_layer_check_catches_an_upward_import(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "bins.py").write_text("def f():\n    from ..hook import masks\n")
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "__init__.py").write_text("")
    (tmp_path / "hook" / "masks.py").write_text("import torch\n")
    graph = import_graph(tmp_path)
    assert graph["core.bins"] == {"hook.masks"}
    assert layer_of("hook.masks") not in LAYERS["core"]


def test_every_layer_is_declared_and_says_what_it_may_import():
    for layer in {layer_of(module) for module in module_names()} - {"__init__", "cli"}:
        assert layer in LAYERS, f"new layer {layer!r}: add it to LAYERS with what it may import"
    for init in PACKAGE.rglob("__init__.py"):
        assert "May import" in (ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""), init


def test_at_most_eight_top_level_modules():
    assert len(list(PACKAGE.glob("*.py"))) <= 8, sorted(path.name for path in PACKAGE.glob("*.py"))


def test_the_packed_row_rules_have_one_home():
    # The modules that lay out or check packed rows take the rules from core/rows.py, not from each other.
    graph = package_graph()
    for module in ("data.pack", "data.streaming", "batches.collator", "cli.documents", "data._io.token_columns"):
        assert "core.rows" in graph[module], module
    assert "data.pack" not in graph["batches.collator"] | graph["cli.documents"] | graph["data.streaming"]


def test_ray_is_imported_only_when_packing_on_ray():
    # `pack_dataset_on_ray` is an optional extra: importing the package and its name must not need Ray.
    code = ("import sys, llm_packing; from llm_packing import pack_dataset_on_ray, read_packed_on_ray; "
            "import llm_packing.cli.train; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_hooks_rooms_import_as_their_docstrings_say():
    # hook/attention/ and hook/media/ sit below configure; the attention routes know nothing of media.
    graph = package_graph()
    assert {"hook.attention.varlen", "hook.media.image_text"} <= graph.keys()
    for module, targets in graph.items():
        if module.startswith(("hook.attention", "hook.media")):
            assert "hook.configure" not in targets, module
        if module.startswith("hook.attention"):
            assert not {target for target in targets if target.startswith("hook.media")}, module


@pytest.mark.parametrize(("old", "new"), [("masks", "hook.masks"), ("varlen", "hook.attention.varlen"),
                                          ("hook.varlen", "hook.attention.varlen"),
                                          ("hook.image_text", "hook.media.image_text")])
def test_a_moved_module_imports_from_its_old_path_with_a_warning(old, new):
    code = (f"import importlib, warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"new = importlib.import_module('llm_packing.{new}')\n"
            f"try:\n    importlib.import_module('llm_packing.{old}')\n"
            f"except DeprecationWarning as warning:\n    print(warning)\n"
            f"warnings.simplefilter('ignore', DeprecationWarning)\n"
            f"assert importlib.import_module('llm_packing.{old}') is new\n")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert process.stdout.strip() == (f"`llm_packing.{old}` moved to `llm_packing.{new}` in llm_packing 0.2; import "
                                      "it from there (the old path goes in 0.3).")
