"""llm_packing: uncontaminated sequence packing for Hugging Face Trainer and TRL fine-tuning.

The public API, each name imported from its sub-package on first use. The layers, bottom up: `core` (the packing
engine, numpy only), `data` (`pack_dataset`), `hook` (`configure_packing` and the support table), `parallel`
(sequence parallelism), `batches` (the collator, the packed forward of padded batches), `trainers` (TRL's trainers,
packed), `demo` and `cli`.

May import: any sub-package, lazily.
"""

import importlib
from typing import TYPE_CHECKING

from . import _moved


__version__ = "0.2.0"

# Public name -> module holding it. Imported on first use (PEP 562): `import llm_packing` stays light, so the command
# line can speak before torch loads, and `PackedSFTTrainer` needs TRL only when used.
_EXPORTS = {
    "supported_model_types": "hook.support.architectures",
    **dict.fromkeys(("STRATEGIES", "PackResult", "pack_sequences", "seed_from_components"), "core.binpack"),
    "DataCollatorWithPacking": "batches.collator",
    **dict.fromkeys(("PackedDatasetEpochs", "pack_dataset"), "data.pack"),
    **dict.fromkeys(("pack_dataset_on_ray", "read_packed_on_ray"), "data.on_ray"),
    **dict.fromkeys(
        ("ContaminationError", "IncompatibleTransformersError", "PackingError", "PackingTypeError",
         "PackingValueError", "SequenceTooLongError", "UnsupportedSetupError"),
        "errors",
    ),
    **dict.fromkeys(("get_seqlens_in_batch", "get_unpad_data"), "hook.documents"),
    "is_indexed_packed_mask": "hook.masks",
    **dict.fromkeys(
        ("configure_packing", "is_packing_configured", "packing_configured", "unconfigure_packing"), "hook.configure"
    ),
    "PackingStats": "core.stats",
    "PackedDPOTrainer": "trainers.dpo",
    "PackedGRPOTrainer": "trainers.grpo",
    "PackedRewardTrainer": "trainers.reward",
    "PackedSFTTrainer": "trainers.sft",
    "verify_packing": "hook.verify",
    **dict.fromkeys(("configure_sequence_parallel", "shard_packed_batch"), "parallel"),
    "PackingArguments": "cli.arguments",
}

__all__ = sorted(_EXPORTS)

_moved.install()


def __getattr__(name: str):
    if name in _moved.MOVED:  # `from llm_packing import masks`, from before the sub-packages
        module = globals()[name] = importlib.import_module(_moved.new_home(name))
        return module
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from .batches.collator import DataCollatorWithPacking as DataCollatorWithPacking
    from .cli.arguments import PackingArguments as PackingArguments
    from .core.binpack import (
        STRATEGIES as STRATEGIES,
        PackResult as PackResult,
        pack_sequences as pack_sequences,
        seed_from_components as seed_from_components,
    )
    from .core.stats import PackingStats as PackingStats
    from .data.on_ray import (
        pack_dataset_on_ray as pack_dataset_on_ray,
        read_packed_on_ray as read_packed_on_ray,
    )
    from .data.pack import (
        PackedDatasetEpochs as PackedDatasetEpochs,
        pack_dataset as pack_dataset,
    )
    from .errors import (
        ContaminationError as ContaminationError,
        IncompatibleTransformersError as IncompatibleTransformersError,
        PackingError as PackingError,
        PackingTypeError as PackingTypeError,
        PackingValueError as PackingValueError,
        SequenceTooLongError as SequenceTooLongError,
        UnsupportedSetupError as UnsupportedSetupError,
    )
    from .hook.configure import (
        configure_packing as configure_packing,
        is_packing_configured as is_packing_configured,
        packing_configured as packing_configured,
        unconfigure_packing as unconfigure_packing,
    )
    from .hook.documents import get_seqlens_in_batch as get_seqlens_in_batch, get_unpad_data as get_unpad_data
    from .hook.masks import is_indexed_packed_mask as is_indexed_packed_mask
    from .hook.support.architectures import supported_model_types as supported_model_types
    from .hook.verify import verify_packing as verify_packing
    from .parallel import (
        configure_sequence_parallel as configure_sequence_parallel,
        shard_packed_batch as shard_packed_batch,
    )
    from .trainers.dpo import PackedDPOTrainer as PackedDPOTrainer
    from .trainers.grpo import PackedGRPOTrainer as PackedGRPOTrainer
    from .trainers.reward import PackedRewardTrainer as PackedRewardTrainer
    from .trainers.sft import PackedSFTTrainer as PackedSFTTrainer
