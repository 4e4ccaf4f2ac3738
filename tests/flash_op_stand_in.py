"""A CPU stand-in of torch's FlashAttention 2 varlen op (`aten._flash_attention_forward`, its schema's arguments),
which the varlen route calls on CUDA in half precision, and a context that routes CPU forwards through it.

The stand-in attends each segment of `cum_seq_q` on its own with SDPA, as the kernel does, and checks what the kernel
checks on the layout (int32 contiguous boundaries, heads dividing, the max at least the longest segment)."""

import contextlib
import itertools
from unittest import mock

import torch

from llm_packing.hook.attention import flash_op


def flash_op_stand_in(calls: list | None = None):
    """The stand-in; each call appends `(cum_seq_q, max_q, (window_size_left, window_size_right), kv_heads)` to
    `calls`."""

    def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
        if calls is not None:
            calls.append((cum_seq_q.tolist(), max_q, (window_size_left, window_size_right), key.shape[1]))
        assert cum_seq_q is cum_seq_k and cum_seq_q.dtype == torch.int32 and cum_seq_q.is_contiguous()
        assert max_q == max_k >= int(cum_seq_q.diff().max()) and is_causal and dropout_p == 0.0
        assert query.shape[1] % key.shape[1] == 0 and window_size_right == 0 and not return_debug_mask
        outputs = []
        for start, end in itertools.pairwise(cum_seq_q.tolist()):
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
            steps = torch.arange(end - start)
            band = steps[:, None] >= steps[None]
            if window_size_left >= 0:
                band &= steps[:, None] - steps[None] <= window_size_left
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale,
                                                                   enable_gqa=True)
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs), None, None, None, None

    return flash_attention_forward


@contextlib.contextmanager
def flash_op_on_cpu(calls: list | None = None):
    """Within it, the varlen route takes the op's path on CPU, float32 included, with every other condition of
    `flash_op.flash_varlen_dtype` (no dropout, equal head dims up to 256 in multiples of 8) as on CUDA."""
    stand_in = flash_op_stand_in(calls)
    with (mock.patch.object(flash_op, "flash_varlen_op", lambda: stand_in),
          mock.patch.object(flash_op, "_on_flash_capable_gpu", lambda query: True),
          mock.patch.object(flash_op, "FLASH_DTYPES", (*flash_op.FLASH_DTYPES, torch.float32))):
        yield
