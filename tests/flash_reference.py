"""One sequence's attention as the FlashAttention kernels compute it, in plain torch: what the reference kernels of
the tests run per segment (the flash_attn / flash_attn_interface API in tests/test_flash_path.py, FlashAttention 4's
`flash_attn.cute` in tests/fast_kernel_stand_ins/flash_attention_4)."""

import torch


def attend(q, k, v, scale, causal, window_size, softcap, dropout_p, s_aux):
    """One sequence, q `[length_q, heads, dim]`, k/v `[length_k, kv_heads, dim]`: bottom-right aligned causal mask,
    inclusive `(left, right)` window (-1: unbounded), GQA by head groups, tanh softcap, and a per-head sink logit that
    takes probability mass without a value."""
    assert dropout_p == 0.0, "the models run in eval mode"
    heads = q.shape[1]
    k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    query_index = torch.arange(q.shape[0])[:, None] + (k.shape[0] - q.shape[0])
    key_index = torch.arange(k.shape[0])[None, :]
    allowed = torch.ones_like(scores[0], dtype=torch.bool)
    if causal:
        allowed &= key_index <= query_index
    left, right = window_size
    if left >= 0:
        allowed &= key_index >= query_index - left
    if right >= 0:
        allowed &= key_index <= query_index + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    if s_aux is None:
        probabilities = scores.softmax(-1)
    else:
        sinks = s_aux.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        probabilities = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probabilities, v)
