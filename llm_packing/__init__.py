"""llm_packing: uncontaminated sequence packing for Hugging Face Trainer and TRL fine-tuning."""

import importlib
from typing import TYPE_CHECKING


__version__ = "0.1.0.dev0"

# Public name -> module holding it. Imported on first use (PEP 562): `import llm_packing` stays light, so the command
# line can speak before torch loads, and `PackedSFTTrainer` needs TRL only when used.
_EXPORTS = {
    "supported_model_types": "architectures",
    **dict.fromkeys(("STRATEGIES", "PackResult", "pack_sequences", "seed_from_components"), "binpack"),
    "DataCollatorWithPacking": "collator",
    **dict.fromkeys(("PackedDatasetEpochs", "pack_dataset"), "dataset"),
    **dict.fromkeys(
        ("ContaminationError", "IncompatibleTransformersError", "PackingError", "PackingTypeError",
         "PackingValueError", "SequenceTooLongError", "UnsupportedSetupError"),
        "errors",
    ),
    **dict.fromkeys(("get_seqlens_in_batch", "get_unpad_data", "is_indexed_packed_mask"), "masks"),
    **dict.fromkeys(
        ("configure_packing", "is_packing_configured", "packing_configured", "unconfigure_packing"), "patch"
    ),
    "PackingStats": "stats",
    "PackedDPOTrainer": "preference",
    "PackedGRPOTrainer": "grpo",
    "PackedRewardTrainer": "reward",
    "PackedSFTTrainer": "trainer",
    "verify_packing": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from .architectures import supported_model_types
    from .binpack import STRATEGIES, PackResult, pack_sequences, seed_from_components
    from .collator import DataCollatorWithPacking
    from .dataset import PackedDatasetEpochs, pack_dataset
    from .errors import (
        ContaminationError,
        IncompatibleTransformersError,
        PackingError,
        PackingTypeError,
        PackingValueError,
        SequenceTooLongError,
        UnsupportedSetupError,
    )
    from .masks import get_seqlens_in_batch, get_unpad_data, is_indexed_packed_mask
    from .patch import configure_packing, is_packing_configured, packing_configured, unconfigure_packing
    from .grpo import PackedGRPOTrainer
    from .preference import PackedDPOTrainer
    from .reward import PackedRewardTrainer
    from .stats import PackingStats
    from .trainer import PackedSFTTrainer
    from .verify import verify_packing
