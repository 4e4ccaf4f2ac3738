"""The transformers internals the packing hook relies on, checked when the hook is applied (never at import).

Each fact says what we depend on, since when it holds, and when the check can go. A missing fact fails closed with
`IncompatibleTransformersError`: a patch that silently stops working is the bug this library exists to prevent.
"""

import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Callable

import transformers
from packaging.version import Version

from .errors import IncompatibleTransformersError


# The transformers functions that turn a 2-D mask into what a backend reads: the hook replaces them, and an
# architecture is a candidate only if its modeling module builds its mask through one of them.
MASK_BUILDER_NAMES = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")

# The releases the parity matrix runs on (`.ci/transformers-range`: the oldest and the newest by default, any list of
# releases on request). 5.17 fails it (the FlashAttention path of gpt_oss, granite_swa, granitemoe_swa,
# minimax_m3_vl_text and moshi; moshi on eager and flex_attention) and 5.10 fails at test collection: 5.18 is the
# floor. What differs between the admitted releases is in `FACTS` below; which model types each has is read from the
# installed transformers (`hook.support.architectures.supported_model_types`), and what a release is too old for is
# in `hook.support.releases`. Above the maximum we still run, after the internals check below, and warn once.
MIN_TRANSFORMERS_VERSION = "5.18.0"
MAX_TESTED_TRANSFORMERS_VERSION = "5.24.0"

TRANSFORMERS_VERSION = Version(transformers.__version__)

# Parameters of `create_causal_mask` and its siblings that the hook reads or rewrites, besides the cache.
# `cache_position` was removed in 5.9 (PR #44181), `input_embeds` renamed `inputs_embeds` in 5.9 (PR #45885).
MASK_BUILDER_PARAMETERS = ("config", "inputs_embeds", "attention_mask", "position_ids")

# What the cache argument is called, newest first: 5.24 renamed the mask builders' and models' `past_key_values`
# and the SSM mixers' `cache_params` to `cache` (the old names stay as deprecated aliases until 5.40).
CACHE_PARAMETER_NAMES = ("cache", "past_key_values", "cache_params")


def cache_parameter(function) -> str | None:
    """The name `function` gives its cache argument (see `CACHE_PARAMETER_NAMES`), or None if it takes none.

    Example:
    ```python
    >>> from llm_packing._compat import cache_parameter
    >>> cache_parameter(lambda hidden_states, cache_params=None: None)
    'cache_params'

    ```
    """
    parameters = inspect.signature(function).parameters
    return next((name for name in CACHE_PARAMETER_NAMES if name in parameters), None)


def rename_legacy_cache_argument(kwargs: dict, signature: inspect.Signature) -> dict:
    """`kwargs` with a deprecated cache name (`past_key_values=` to a 5.24 builder) moved to the one `signature` takes,
    so that binding them neither fails nor hides the cache from the hook.

    Example:
    ```python
    >>> import inspect
    >>> from llm_packing._compat import rename_legacy_cache_argument
    >>> rename_legacy_cache_argument({"past_key_values": None}, inspect.signature(lambda cache=None: None))
    {'cache': None}

    ```
    """
    current = next((name for name in CACHE_PARAMETER_NAMES if name in signature.parameters), None)
    legacy = [name for name in CACHE_PARAMETER_NAMES if name in kwargs and name not in signature.parameters]
    if current is None or not legacy or current in kwargs:
        return kwargs
    kwargs = dict(kwargs)
    kwargs[current] = kwargs.pop(legacy[0])
    return kwargs


@dataclasses.dataclass(frozen=True)
class Fact:
    """
    An internal of transformers that the hook relies on or works around, and the releases it holds on.

    Args:
        what (`str`):
            The internal, and what changed.
        since (`str` or `None`):
            First release it holds on; `None`: it already holds on `MIN_TRANSFORMERS_VERSION`.
        until (`str` or `None`):
            Last minor release it holds on (`"5.23"`: every 5.23.x); `None`: it still holds on the newest tested.
            A fact with an `until` can go once the minimum passes it.
        probe (`Callable[[], bool]`):
            Reads the installed transformers; `tests/test_compat.py` asserts, on every release CI runs, that the
            probe agrees with the range, so the table cannot drift from what is installed.

    Example:
    ```python
    >>> from packaging.version import Version
    >>> from llm_packing._compat import FACTS
    >>> fact = FACTS["packed_mask_remaps_positions"]
    >>> fact.holds(Version("5.22.2")), fact.holds(Version("5.23.0"))
    (False, True)

    ```
    """

    what: str
    since: str | None
    until: str | None
    probe: Callable[[], bool]

    def holds(self, version: Version | None = None) -> bool:
        """Whether the fact holds on `version` by its range (default: the installed transformers)."""
        version = TRANSFORMERS_VERSION if version is None else version
        return (self.since is None or version >= Version(self.since)) and (
            self.until is None or version < _next_minor(self.until)
        )


def _next_minor(version: str) -> Version:
    major, minor = Version(version).release[:2]
    return Version(f"{major}.{minor + 1}.0")


def _masking_has(*names: str) -> Callable[[], bool]:
    return lambda: all(hasattr(importlib.import_module("transformers.masking_utils"), name) for name in names)


def _builder_cache_name() -> str | None:
    from transformers import masking_utils

    return cache_parameter(masking_utils.create_causal_mask)


def _mixer_cache_name() -> str | None:
    from transformers.models.mamba.modeling_mamba import MambaMixer

    return cache_parameter(MambaMixer.forward)


def _builders_take_parameters() -> bool:
    from transformers import masking_utils

    return all(p in inspect.signature(masking_utils.create_causal_mask).parameters for p in MASK_BUILDER_PARAMETERS)


def _upad_looks_up_get_unpad_data() -> bool:
    from transformers import modeling_flash_attention_utils as flash

    return hasattr(flash, "_get_unpad_data") and "_get_unpad_data" in flash._upad_input.__code__.co_names


def packed_mask_remaps_positions() -> bool:
    """Whether transformers' packed-sequence masks (built from `position_ids` when `attention_mask` is None) hand the
    mask functions each token's position within its document (`remap_positions_for_packed_sequence`, 5.23+). Before,
    they AND a document mask onto functions of the row position: exact for causal and sliding windows, but chunked
    attention cuts chunks along the row, so `hook.attention.chunked` builds per-document chunks itself there."""
    return _masking_has("remap_positions_for_packed_sequence")()


def layers_checkpoint_in_call() -> bool:
    """Whether `GradientCheckpointingLayer` checkpoints in `__call__` (transformers < 5.23) rather than by wrapping
    each subclass's `forward` (5.23+, which `hook.mixers` relies on to checkpoint each document group)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" in GradientCheckpointingLayer.__dict__


# Read from the wheels' sources of 5.9.0 to 5.24.0 and probed on each admitted minor (newest patch).
FACTS: dict[str, Fact] = {
    "builders_take_position_ids": Fact(
        "the mask builders take config, inputs_embeds, attention_mask, position_ids (`cache_position` went in 5.9)",
        None, None, _builders_take_parameters,
    ),
    "builders_cache_is_past_key_values": Fact(
        "the mask builders' cache argument is `past_key_values`", None, "5.23",
        lambda: _builder_cache_name() == "past_key_values",
    ),
    "builders_cache_is_cache": Fact(
        "the mask builders' cache argument is `cache` (`past_key_values` a deprecated alias until 5.40)", "5.24.0",
        None, lambda: _builder_cache_name() == "cache",
    ),
    "mixers_cache_is_cache": Fact(
        "SSM/delta-net mixers take `cache` (before: `cache_params`, short convolutions `past_key_values`)", "5.24.0",
        None, lambda: _mixer_cache_name() == "cache",
    ),
    "packed_position_ids_masked": Fact(
        "with `attention_mask=None` and no cache, eager/sdpa/flex masks isolate the sequences that `position_ids` "
        "restarts mark (`find_packed_sequence_indices`, `packed_sequence_mask_function`)",
        None, None, _masking_has("find_packed_sequence_indices", "packed_sequence_mask_function"),
    ),
    "packed_mask_remaps_positions": Fact(
        "packed masks hand mask functions each token's position in its document "
        "(`remap_positions_for_packed_sequence`): chunked attention chunks per document; before, along the row, "
        "and `hook.attention.chunked` does it", "5.23.0", None, packed_mask_remaps_positions,
    ),
    "upad_input_looks_up_get_unpad_data": Fact(
        "FlashAttention's `_upad_input` calls the module-global `_get_unpad_data(attention_mask)`", None, None,
        _upad_looks_up_get_unpad_data,
    ),
    "mask_registries": Fact(
        "`ALL_MASK_ATTENTION_FUNCTIONS`, `flash_attention_mask` and `LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING` in "
        "masking_utils", None, None,
        _masking_has("ALL_MASK_ATTENTION_FUNCTIONS", "flash_attention_mask", "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING"),
    ),
    "recurrent_attention_mask": Fact(
        "hybrid models hand their mixers the 2-D mask through `create_recurrent_attention_mask` (5.13+)", None, None,
        _masking_has("create_recurrent_attention_mask"),
    ),
    "layers_checkpoint_in_forward": Fact(
        "`GradientCheckpointingLayer` checkpoints by wrapping each subclass's `forward`; before, in `__call__`, "
        "which `hook.mixers` bypasses for re-batched blocks (RWKV, xLSTM)", "5.23.0", None,
        lambda: not layers_checkpoint_in_call(),
    ),
}


_warned_untested = False


def check_transformers_internals() -> None:
    """Raise `IncompatibleTransformersError` unless every internal the hook patches or calls is present and shaped as
    expected; warn once above the highest tested version."""
    global _warned_untested
    if TRANSFORMERS_VERSION < Version(MIN_TRANSFORMERS_VERSION):
        raise _incompatible(
            f"transformers {TRANSFORMERS_VERSION} is older than the minimum {MIN_TRANSFORMERS_VERSION}"
        )
    _check_mask_builders()
    _check_flash_unpad()
    if TRANSFORMERS_VERSION > Version(MAX_TESTED_TRANSFORMERS_VERSION) and not _warned_untested:
        _warned_untested = True
        warnings.warn(
            f"llm_packing is tested with transformers {MIN_TRANSFORMERS_VERSION} to "
            f"{MAX_TESTED_TRANSFORMERS_VERSION}; "
            f"you have {TRANSFORMERS_VERSION}. Its internals check passed; run `verify_packing(model)` to confirm "
            "documents stay isolated.",
            UserWarning,
            stacklevel=3,
        )


def _check_mask_builders() -> None:
    from transformers import masking_utils

    for name in MASK_BUILDER_NAMES:
        builder = getattr(masking_utils, name, None)
        if builder is None:
            raise _incompatible(f"`transformers.masking_utils.{name}` is missing")
        missing = [p for p in MASK_BUILDER_PARAMETERS if p not in inspect.signature(builder).parameters]
        if cache_parameter(builder) is None:
            missing.append(" or ".join(CACHE_PARAMETER_NAMES[:2]))
        if missing:
            raise _incompatible(f"`transformers.masking_utils.{name}` has no parameter(s) {missing}")
    for name in ("ALL_MASK_ATTENTION_FUNCTIONS", "flash_attention_mask", "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING"):
        if not hasattr(masking_utils, name):
            raise _incompatible(f"`transformers.masking_utils.{name}` is missing")


def _check_flash_unpad() -> None:
    """FlashAttention unpads through a module-global lookup of `_get_unpad_data` inside `_upad_input`; if that lookup
    moves, patching the attribute would be inert (the trap that broke axolotl and LLaMA-Factory)."""
    from transformers import modeling_flash_attention_utils

    upad_input = getattr(modeling_flash_attention_utils, "_upad_input", None)
    if not hasattr(modeling_flash_attention_utils, "_get_unpad_data") or upad_input is None:
        raise _incompatible("`transformers.modeling_flash_attention_utils._get_unpad_data`/`_upad_input` is missing")
    if "_get_unpad_data" not in upad_input.__code__.co_names:
        raise _incompatible("`_upad_input` no longer looks up `_get_unpad_data` as a module global")


def _incompatible(what: str) -> IncompatibleTransformersError:
    return IncompatibleTransformersError(
        f"Cannot apply the packing hook: {what} (installed transformers {TRANSFORMERS_VERSION}; llm_packing is tested "
        f"with {MIN_TRANSFORMERS_VERSION} to {MAX_TESTED_TRANSFORMERS_VERSION}). Install a tested version, e.g. "
        f"`pip install transformers=={MAX_TESTED_TRANSFORMERS_VERSION}`."
    )
