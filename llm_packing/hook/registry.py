"""The one record of what the hook replaced, so that `unconfigure_packing()` puts every object back.

Every rebinding the hook makes goes through here: functions bound by name in modules (the mask builders, wherever a
modeling module imported them), entries of transformers' registries (`ALL_ATTENTION_FUNCTIONS`, the layer-pattern
mask mapping), class attributes (mixer `forward`s, model `__call__`s), module-level helpers (ALiBi builders) and
forward pre-hooks (the model's guards). [`restore_all`] undoes them newest first, and only where our replacement is
still in place: an object someone replaced after us is theirs to restore.
"""

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch


_MISSING = object()  # the attribute was inherited, not set on the object itself
_MARK = "__llm_packing_replacement__"


def ours(function, *, eager: bool = True):
    """`function`, as one the hook binds in transformers' place: marked, and unless `eager=False` (for one that reads
    nothing on the host, which dynamo may trace) run outside `torch.compile`'s graphs ([`outside_graphs`])."""
    if eager:
        function = outside_graphs(function)
    setattr(function, _MARK, True)
    return function


def outside_graphs(function):
    """
    `function`, run eagerly on every call even inside a compiled model (`torch.compiler.disable`): dynamo breaks the
    graph at the call instead of tracing it.

    Every replacement of the hook reads the batch's document layout on the host (the one device-to-host copy of a
    forward, numpy, per-forward state) and decides from it how many kernel calls to make. Traced, those values became
    constants of the graph: the next batch of the same shape ran with the first batch's documents (refused by the
    position check from the second batch on, issue 37), and a batch of a new shape failed to trace. Run eagerly, each
    forward derives its own layout, and what the layout decides (document counts, bucket sizes) never becomes a guard
    that recompiles; the layers around the calls compile.
    """
    eager = torch.compiler.disable(function, recursive=True)
    if hasattr(function, "__wrapped__"):  # what our replacement wraps stays one step away: transformers' original
        eager.__wrapped__ = function.__wrapped__
    return eager


def is_ours(function) -> bool:
    """Whether `function` is one of the hook's replacements: configuring twice replaces nothing twice."""
    return getattr(function, _MARK, False)


@dataclass
class _Replacement:
    owner: Any  # a module, a class or a mapping
    name: Any  # attribute name, or mapping key
    original: Any  # `_MISSING` if the owner had no own value
    replacement: Any
    is_item: bool = False
    configures: bool = True  # False: kept for a `DataCollatorWithPacking` while nothing is configured ([`is_active`])


_replacements: list[_Replacement] = []
_swept: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, replacement), replaced in every module
_hooks: dict[tuple[int, str, str], Any] = {}  # (id(module), kind, "pre" or "post") -> its forward (pre-)hook's handle
_on_import: dict[str, Callable[[], None]] = {}  # module name -> the patch to run once that module has run
_configuring_imports: set[str] = set()  # those of `_on_import` that configure packing ([`is_active`])
_configured_model_types: set[str] = set()  # every config `configure_packing` was given, nested configs included
_kept_configured = False  # configured by `configure_packing` (not only by `packing_configured` blocks)

# `configure_packing` and `unconfigure_packing` change process-wide state: one call at a time. Threads configuring at
# once wrapped the same original twice, and the restore then missed the wrapper the modules held.
lock = threading.RLock()


def replace_attribute(owner, name: str, replacement, *, configures: bool = True) -> None:
    """Set `owner.name = replacement`, remembering what was there (idempotent for the same replacement). With
    `configures=False` the replacement alone does not make packing configured ([`is_active`]); it is undone with the
    rest."""
    # A class's or a model's own attribute: what it inherits (a model's `forward`) is not put back on it.
    own = isinstance(owner, (type, torch.nn.Module))
    current = owner.__dict__.get(name, _MISSING) if own else getattr(owner, name, _MISSING)
    if current is replacement:
        return
    _replacements.append(_Replacement(owner, name, current, replacement, configures=configures))
    setattr(owner, name, replacement)


def replace_item(mapping: MutableMapping, key, replacement) -> None:
    """Set `mapping[key] = replacement`, remembering what was there."""
    current = mapping.get(key, _MISSING)
    if current is replacement:
        return
    _replacements.append(_Replacement(mapping, key, current, replacement, is_item=True))
    mapping[key] = replacement


def replace_everywhere(replacements: dict[Callable, Callable]) -> None:
    """Bind each replacement wherever a module holds its original by name, now and, at [`restore_all`], in modules
    imported since (they import the patched source module's attribute: our replacement). One sweep of every loaded
    module for all of them: a sweep costs about 0.1 s with every modeling module of transformers loaded."""
    if not replacements:
        return
    for original, replacement in replacements.items():
        _swept[id(original)] = (original, replacement)
    _sweep({id(original): replacement for original, replacement in replacements.items()})


def replacement_for(original: Callable):
    """What [`replace_everywhere`] bound in place of `original`, or None."""
    entry = _swept.get(id(original))
    return entry[1] if entry is not None and entry[0] is original else None


def add_forward_pre_hook(module, kind: str, hook, *, prepend: bool = False) -> None:
    """`module.register_forward_pre_hook(hook, with_kwargs=True, prepend=prepend)`, once per module and `kind`,
    removed at [`restore_all`]."""
    key = (id(module), kind, "pre")
    if key not in _hooks:
        _hooks[key] = module.register_forward_pre_hook(outside_graphs(hook), with_kwargs=True, prepend=prepend)


def add_forward_hook(module, kind: str, hook, *, always_call: bool = False) -> None:
    """`module.register_forward_hook(hook, with_kwargs=True, always_call=always_call)`, once per module and `kind`,
    removed at [`restore_all`]."""
    key = (id(module), kind, "post")
    if key not in _hooks:
        _hooks[key] = module.register_forward_hook(outside_graphs(hook), with_kwargs=True, always_call=always_call)


def replaced_objects() -> list[tuple[Any, Any]]:
    """`(owner, name)` of every attribute and mapping entry replaced now (modules swept included)."""
    swept = {id(replacement) for _, replacement in _swept.values()}
    found = [(entry.owner, entry.name) for entry in _replacements]
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None) or {}
        found += [(module, name) for name, value in list(namespace.items()) if id(value) in swept]
    return found


def patch_on_import(module_name: str, patch: Callable[[], None], *, configures: bool = True) -> None:
    """Run `patch` now if `module_name` is imported, else as soon as it is (an import finder in `sys.meta_path`,
    removed at [`restore_all`]), so that the order of a notebook's imports does not matter. `patch` must be
    idempotent: it also runs again if the module is imported again. `configures` as for [`replace_attribute`]."""
    if module_name in sys.modules:
        patch()
        return
    _on_import[module_name] = patch
    if configures:
        _configuring_imports.add(module_name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of `_on_import` as the path finder does, with a loader that runs their patch once the module
    has run; finds nothing else."""

    def find_spec(self, name, path, target=None):
        if name not in _on_import:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        patch = _on_import.get(module.__name__)
        if patch is not None:
            patch()

    def __getattr__(self, name):  # get_source, get_filename, ...: the path finder's loader
        return getattr(self._loader, name)


_FINDER = _PatchOnImport()


def add_configured_model_types(model_types) -> None:
    """Record the model types `configure_packing` proved and patched (cleared at [`restore_all`])."""
    _configured_model_types.update(model_types)


def is_configured_model_type(model_type: str) -> bool:
    return model_type in _configured_model_types


def configured_model_types() -> list[str]:
    return sorted(_configured_model_types)


def keep_configured() -> None:
    """Packing was configured outside `packing_configured` blocks: their last exit leaves it (until
    [`restore_all`])."""
    global _kept_configured
    _kept_configured = True


def kept_configured() -> bool:
    return _kept_configured


def is_active() -> bool:
    """Whether anything the hook configures is in place (`is_packing_configured`): not the `Trainer` column patch of a
    `DataCollatorWithPacking` built while nothing is configured."""
    return bool(_swept or _hooks or _configuring_imports or any(entry.configures for entry in _replacements))


def restore_all() -> None:
    """Undo every replacement, newest first; safe to call twice."""
    global _kept_configured
    _kept_configured = False
    _configured_model_types.clear()
    _on_import.clear()
    _configuring_imports.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    while _hooks:
        _hooks.popitem()[1].remove()
    while _replacements:
        entry = _replacements.pop()
        if entry.is_item:
            if entry.owner.get(entry.name, _MISSING) is entry.replacement:
                _restore_item(entry)
        elif getattr(entry.owner, entry.name, _MISSING) is entry.replacement:
            if entry.original is _MISSING:
                delattr(entry.owner, entry.name)
            else:
                setattr(entry.owner, entry.name, entry.original)
    if _swept:
        by_replacement = {id(replacement): original for original, replacement in _swept.values()}
        _sweep(by_replacement)
        _swept.clear()


def _restore_item(entry: _Replacement) -> None:
    if entry.original is _MISSING:
        del entry.owner[entry.name]
    else:
        entry.owner[entry.name] = entry.original


def _sweep(swaps: dict[int, Any]) -> None:
    """In every module namespace, replace each value whose id is a key of `swaps` by that key's value. The objects
    behind the keys are alive (held by `_swept`), so an id names one object."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for attribute, value in list(namespace.items()):
            swapped = swaps.get(id(value))
            if swapped is not None:
                namespace[attribute] = swapped
