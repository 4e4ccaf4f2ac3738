"""llm_packing: uncontaminated sequence packing for Hugging Face Trainer and TRL fine-tuning."""

__version__ = "0.1.0.dev0"

from .errors import (
    ContaminationError,
    IncompatibleTransformersError,
    PackingError,
    PackingTypeError,
    PackingValueError,
    SequenceTooLongError,
    UnsupportedSetupError,
)


__all__ = [
    "ContaminationError",
    "IncompatibleTransformersError",
    "PackingError",
    "PackingTypeError",
    "PackingValueError",
    "SequenceTooLongError",
    "UnsupportedSetupError",
]
