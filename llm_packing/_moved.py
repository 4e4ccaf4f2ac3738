"""Module paths from before the sub-packages (llm_packing 0.1 kept its modules in one folder, and the hook's attention
routes and media modules sat in `hook/` itself until 0.2): `import llm_packing.masks` or `import
llm_packing.hook.varlen` keeps working, as the module's new home (`llm_packing.hook.masks`,
`llm_packing.hook.attention.varlen`), with a DeprecationWarning naming it. The public API (`from llm_packing import
...`) never moved. These paths go in 0.3.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


MOVED = {
    "binpack": "core.binpack", "stats": "core.stats", "overflow": "core.overflow", "layout": "core.rows",
    "locality": "core.locality", "checks": "core.checks",
    "dataset": "data.pack", "streaming": "data.streaming", "packed_metadata": "data.metadata",
    "token_columns": "data._io.token_columns", "gather": "data._io.gather",
    "gather_processes": "data._io.gather_processes", "packed_cache": "data._io.packed_cache",
    "direct_writes": "data._io.direct_writes", "resident_pages": "data._io.resident_pages",
    "patch": "hook.configure", "masks": "hook.masks", "varlen": "hook.attention.varlen", "mixers": "hook.mixers",
    "alibi": "hook.attention.alibi", "multimodal": "hook.media.multimodal", "verify": "hook.verify",
    "architectures": "hook.support.architectures", "architecture_table": "hook.support.table",
    "model_types": "hook.support.model_types", "support_matrix": "hook.support.matrix",
    "collator": "batches.collator", "padded_forward": "batches.padded_forward",
    "trainer": "trainers.sft", "preference": "trainers.dpo", "grpo": "trainers.grpo", "reward": "trainers.reward",
    "demo_data": "demo.chitchat", "pretrained": "demo.pretrained",
    "train_setup": "cli.startup", "train_preference": "cli.train_preference", "config": "cli.arguments",
    "stats_command": "cli.stats", "documents": "cli.documents", "sample_reply": "cli.sample_reply",
    **{f"hook.{name}": f"hook.attention.{name}"
       for name in ("varlen", "alibi", "chunked", "indexers", "mask_functions")},
    **{f"hook.{name}": f"hook.media.{name}"
       for name in ("image_text", "mrope", "multimodal", "placeholders", "video", "verify_images", "cross_attention")},
}


def new_home(old: str) -> str:
    """The module that `llm_packing.<old>` became (`old` relative to the package, dotted for a sub-package's module),
    warning once per import that the old path is deprecated."""
    new = f"{__package__}.{MOVED[old]}"
    warnings.warn(
        f"`{__package__}.{old}` moved to `{new}` in llm_packing 0.2; import it from there (the old path goes in 0.3).",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `llm_packing.<old>` and loads it as the module it moved to (the same object, not a copy)."""

    def find_spec(self, fullname, path=None, target=None):
        if _relative(fullname) in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # The import system returns what `sys.modules` holds for the name once this returns: the moved module.
        sys.modules[module.__name__] = importlib.import_module(new_home(_relative(module.__name__)))


def _relative(fullname: str) -> str | None:
    """`llm_packing.hook.varlen` -> `hook.varlen`; None outside this package."""
    prefix = f"{__package__}."
    return fullname[len(prefix):] if fullname.startswith(prefix) else None


def install() -> None:
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
