"""`attention_route`: which sdpa route a packed batch takes (`"auto"`, `"varlen"`, `"dense"`), set by
`configure_packing(..., attention_route=...)` and asked by the patched mask builders for every batch: the varlen
route's document layout ([`~llm_packing.hook.attention.varlen.PackedAttentionMask`]) or transformers' dense mask."""

import torch

from ...core.checks import check_choice
from ...errors import UnsupportedSetupError
from ..shapes import attention_head_dims
from .varlen import PackedAttentionMask, packed_attention_mask


ROUTES = ("auto", "varlen", "dense")
# `attention_route="auto"` on CUDA: the dense route for rows up to this length, for heads up to this width. Measured on
# an H200 (torch 2.11, bf16 autocast, 16k tokens a step; docs/performance.md): at 4,096 the dense route trained 2.6x
# the varlen route and 1.9x TRL's packing on sdpa on a 0.5B shape (head dim 64), and 2.0x the varlen route and 1.1x
# TRL's packing on a 1.5B shape (head dim 128); at 16,384 the varlen route, then calling torch's `varlen_attn`, trained
# 1.49x the dense route (0.5B, an earlier lease). The varlen figures at 4,096 are from its per-bucket fallback
# (autocast's float32 queries skipped the FlashAttention 2 op then, since fixed); the op's own speed is for the next
# GPU check to measure. Wider heads are unmeasured.
DENSE_ON_CUDA_UP_TO = 4096
DENSE_ON_CUDA_UP_TO_HEAD_DIM = 128

_route = "auto"  # set by `configure_packing(..., attention_route=...)`, process-wide like the rest of the hook


def check_route(attention_route, config) -> None:
    """Validate `attention_route` for this model (raises before anything is patched), then make it the route;
    `None` keeps the current one."""
    global _route
    from ..support.architectures import sdpa_route

    if attention_route is None:
        attention_route = _route

    check_choice("attention_route", attention_route, ROUTES, fix=(
        "'auto' takes the varlen route on sdpa where the architecture allows it (the dense route on CUDA for rows up "
        f"to {DENSE_ON_CUDA_UP_TO} tokens and heads up to {DENSE_ON_CUDA_UP_TO_HEAD_DIM} wide), 'dense' forces "
        "transformers' dense mask."
    ))
    backend = getattr(config, "_attn_implementation", None)
    if attention_route == "varlen":
        route, reason = sdpa_route(config)
        if backend != "sdpa" or route != "varlen":
            raise UnsupportedSetupError(
                f"`attention_route='varlen'` needs the sdpa backend and an architecture it can express; model_type "
                f"{config.model_type!r} on {backend!r}: "
                f"{reason or 'the varlen route runs on sdpa only (FlashAttention is varlen already)'}. Use "
                "`attention_route='auto'`, or `attn_implementation='sdpa'`."
            )
    _route = attention_route


def mask_for_builder(builder_name: str, arguments: dict, attention_mask: torch.Tensor) -> PackedAttentionMask | None:
    """What a patched sdpa mask builder returns for a validated indexed mask without mask functions (those take
    `hook.attention.mask_functions`): its [`PackedAttentionMask`], or `None` where the dense route must build the mask
    (route forced dense, an architecture that SDPA per document cannot express)."""
    from ..support.architectures import sdpa_route

    config = arguments["config"]
    if _route == "dense" or sdpa_route(config)[0] != "varlen" or not getattr(config, "is_causal", True):
        return None
    if _route == "auto" and auto_takes_dense(attention_mask.device.type, attention_mask.shape[-1],
                                             max(attention_head_dims(config), default=0)):
        return None
    if builder_name == "create_sliding_window_causal_mask":
        return packed_attention_mask(attention_mask, window=config.sliding_window)
    if builder_name == "create_chunked_causal_mask":
        return packed_attention_mask(attention_mask, chunk=config.attention_chunk_size)
    return packed_attention_mask(attention_mask)


def auto_takes_dense(device_type: str, length: int, head_dim: int) -> bool:
    """
    Whether `attention_route="auto"` takes the dense route for rows of `length` tokens and attention heads of
    `head_dim` on `device_type`: on CUDA up to `DENSE_ON_CUDA_UP_TO` tokens and `DENSE_ON_CUDA_UP_TO_HEAD_DIM` (faster
    there, measured), elsewhere never (on CPU the varlen route is faster and its memory linear).

    Example:
    ```python
    >>> from llm_packing.hook.attention.route import auto_takes_dense
    >>> auto_takes_dense("cuda", 4096, 128), auto_takes_dense("cuda", 4096, 256), auto_takes_dense("cuda", 16384, 64)
    (True, False, False)
    >>> auto_takes_dense("cpu", 2048, 64)
    False

    ```
    """
    return device_type == "cuda" and length <= DENSE_ON_CUDA_UP_TO and head_dim <= DENSE_ON_CUDA_UP_TO_HEAD_DIM


def reset_route() -> None:
    """Back to `"auto"`, as after import (`unconfigure_packing`)."""
    global _route
    _route = "auto"
