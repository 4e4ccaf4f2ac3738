"""llm_packing: uncontaminated sequence packing for Hugging Face Trainer and TRL fine-tuning."""

__version__ = "0.1.0.dev0"

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
from .stats import PackingStats
from .verify import verify_packing


__all__ = [
    "STRATEGIES",
    "ContaminationError",
    "DataCollatorWithPacking",
    "IncompatibleTransformersError",
    "PackResult",
    "PackedDatasetEpochs",
    "PackingError",
    "PackingStats",
    "PackingTypeError",
    "PackingValueError",
    "SequenceTooLongError",
    "UnsupportedSetupError",
    "configure_packing",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "is_indexed_packed_mask",
    "is_packing_configured",
    "pack_dataset",
    "pack_sequences",
    "packing_configured",
    "seed_from_components",
    "supported_model_types",
    "unconfigure_packing",
    "verify_packing",
]
