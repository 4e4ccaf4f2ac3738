"""The transformers internals the packing hook relies on, checked when the hook is applied (never at import).

Each fact says what we depend on, since when it holds, and when the check can go. A missing fact fails closed with
`IncompatibleTransformersError`: a patch that silently stops working is the bug this library exists to prevent.
"""

import inspect
import warnings

import transformers
from packaging.version import Version

from .errors import IncompatibleTransformersError


# The transformers functions that turn a 2-D mask into what a backend reads: the hook replaces them, and an
# architecture is a candidate only if its modeling module builds its mask through one of them.
MASK_BUILDER_NAMES = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")

# The versions the parity matrix has run against. Below the minimum the builders had other signatures
# (`cache_position` until 5.9), no packed-sequence support for sdpa/eager/flex (before 5.23), and other model types
# (5.24 added seven causal LMs; the architecture table is that of 5.24); above the maximum we still run, after the
# internals check below, and warn once.
MIN_TRANSFORMERS_VERSION = "5.24.0"
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
