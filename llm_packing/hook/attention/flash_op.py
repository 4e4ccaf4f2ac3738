"""torch's own FlashAttention 2 varlen op (`aten._flash_attention_forward`), as the varlen route calls it on CUDA: when
it runs ([`flash_varlen_dtype`]), and one call over a whole packed batch in place ([`flash_varlen_attention`]), its
documents and padding runs as segments (no gather, no scatter), grouped-query heads as they are."""

import functools

import torch

from ..autocast import computed_dtype


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what the op takes (tests/flash_op_stand_in.py adds float32 on CPU)


def flash_varlen_dtype(query, key, value, dropout: float) -> torch.dtype | None:
    """The half-precision dtype in which torch's FlashAttention 2 varlen op runs this call, or None where it does not
    run. It runs on CUDA (not ROCm) on an Ampere or newer GPU, without dropout, for equal head dims up to 256 in
    multiples of 8, with a torch whose op takes a sliding window, in the dtype sdpa itself would run: the inputs' own,
    or autocast's. Under `Trainer`'s `bf16=True` with float32 weights the rotary embedding leaves query and key in
    float32 and value in bfloat16; sdpa would run all three in bfloat16, and so does the op."""
    dtype = computed_dtype(query)
    runs = (
        dtype in FLASH_DTYPES and dropout == 0.0
        and query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256 and query.shape[-1] % 8 == 0
        and flash_varlen_op() is not None and _on_flash_capable_gpu(query)
    )
    return dtype if runs else None


def _on_flash_capable_gpu(query) -> bool:
    return query.is_cuda and _flash_capable(query.device.index)


@functools.cache
def _flash_capable(device_index: int | None) -> bool:
    """Whether torch's FlashAttention kernels run on this CUDA device: sm80 or newer, not ROCm (other kernels)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 0)


def flash_varlen_attention(tokens: list[torch.Tensor], segments: torch.Tensor, max_segment: int, window: int | None,
                           scaling: float | None) -> torch.Tensor:
    """One causal call of torch's FlashAttention 2 varlen op over the flattened batch `tokens` (query, key, value, each
    `(batch_size * length, heads, dim)`) cut at `segments` (int32 boundaries, the longest `max_segment` tokens), with
    a sliding `window` or none; grouped-query key and value heads go in as they are.

    The op itself, not `torch.nn.attention.varlen.varlen_attn`: on an H200 with torch 2.11 that wrapper chose cuDNN,
    which takes no grouped-query heads (so they were repeated) and whose steps left the GPU idle 57% of the time
    (benchmarks/results/gpu-2026-11-27-h200/gpu_profile_h200.md)."""
    query, key, value = tokens
    window_left = -1 if window is None else window - 1
    output = flash_varlen_op()(
        query, key, value, segments, segments, max_segment, max_segment, 0.0, True, False,
        scale=scaling, window_size_left=window_left, window_size_right=0,
    )
    return output[0]


def flash_varlen_op():
    """`torch.ops.aten._flash_attention_forward` (differentiable: its backward is `_flash_attention_backward`) where
    this torch's takes `window_size_left`/`window_size_right`; None elsewhere."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not {"window_size_left", "window_size_right"} <= _argument_names(op):
        return None
    return op


@functools.cache
def _argument_names(op) -> frozenset[str]:
    """The argument names of an ATen op's schema, read once: this runs in every attention layer's call."""
    return frozenset(argument.name for argument in op.default._schema.arguments)
