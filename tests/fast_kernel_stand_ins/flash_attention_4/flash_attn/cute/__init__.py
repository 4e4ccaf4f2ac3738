"""Stand-in for flash-attn-4 4.0.0b36's `flash_attn.cute`: `flash_attn_varlen_func` and `flash_attn_func` with the
real signatures and return value, computed in plain torch (tests/flash_reference.py) on CPU.

transformers reads the varlen signature to decide which options to pass (`_lazy_define_process_function`), so with
this one it passes what it passes the real kernel: attention sinks as `learnable_sink`, no `dropout_p` (FA4 has no
dropout), `window_size`, `softcap`, `deterministic` and the optional `max_seqlen_q/k`. Like the real kernel, the
stand-in returns a tuple `(out, lse)`, resolves `causal` and `window_size` as `_resolve_causal_local_window` does
(`causal` pins the right edge at 0; `None`, or a pair of negatives, is unbounded) and asserts what the real kernel
asserts on the layout: int32 contiguous `cu_seqlens` of one entry more than segments, `(total, heads, dim)` tensors,
KV heads dividing query heads, a `(heads,)` sink, `max_seqlen` at least the longest segment. It leaves out what only
the hardware needs (CUDA tensors, half precision, head dims of 8-256 divisible by 8): the tests run tiny float32
models on CPU. Options it does not compute (`qv`, paged or gathered KV, `seqused_*`, `score_mod`/`mask_mod`, block
sparsity, `return_lse`) raise instead of being ignored.

Each call is recorded for the tests: `flash_attn_varlen_func.calls` (each call's `cu_seqlens_q`, as a list),
`flash_attn_varlen_func.options` (each call's options) and `flash_attn_func.calls` (a count).
"""

import itertools

import torch
from flash_reference import attend


def flash_attn_func(
    q,
    k,
    v,
    qv=None,
    gather_kv_indices=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse=False,
    gather_bwd_recompute_p=False,
    gather_bwd_token_chunk=None,
):
    """q `[batch, length, heads, dim]`, k/v `[batch, length, kv_heads, dim]`; returns `(out, None)`."""
    _refuse(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, mask_mod=mask_mod,
            aux_tensors=aux_tensors, block_sparse_tensors=block_sparse_tensors, return_lse=return_lse or None)
    assert q.dim() == 4 and k.shape == v.shape and q.shape[2] % k.shape[2] == 0, (q.shape, k.shape, v.shape)
    flash_attn_func.calls += 1
    options = _options(q, softmax_scale, causal, window_size, softcap, learnable_sink)
    return torch.stack([attend(*row, *options) for row in zip(q, k, v, strict=True)]), None


def flash_attn_varlen_func(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    min_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    gather_kv_indices=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse=False,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
    disable_scheduler_metadata=False,
    gather_bwd_recompute_p=False,
    gather_bwd_token_chunk=None,
):
    """q `[total_q, heads, dim]`, k/v `[total_k, kv_heads, dim]`, one segment per `cu_seqlens` interval; returns
    `(out, None)`, out `[total_q, heads, dim]`."""
    _refuse(qv=qv, seqused_q=seqused_q, seqused_k=seqused_k, gather_kv_indices=gather_kv_indices,
            page_table=page_table, score_mod=score_mod, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors,
            aux_tensors=aux_tensors, return_lse=return_lse or None)
    assert cu_seqlens_q is not None and cu_seqlens_k is not None, "the stand-in computes the cu_seqlens segments"
    segments = (cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)
    for cu_seqlens, total, bound in segments:
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.stride(0) == 1, "cu_seqlens must be int32, contiguous"
        assert cu_seqlens.shape == cu_seqlens_q.shape and int(cu_seqlens[-1]) == total, (cu_seqlens, total)
        # The kernel sizes its work by max_seqlen, an upper bound: below the longest segment it would drop tokens.
        assert bound is None or int(bound) >= int(cu_seqlens.diff().max()), (bound, cu_seqlens)
    assert q.dim() == 3 and k.shape == v.shape and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape, v.shape)
    flash_attn_varlen_func.calls.append(cu_seqlens_q.tolist())
    flash_attn_varlen_func.options.append({
        "causal": causal, "window_size": window_size, "softcap": softcap, "learnable_sink": learnable_sink is not None,
        "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "deterministic": deterministic,
    })
    options = _options(q, softmax_scale, causal, window_size, softcap, learnable_sink)
    queries, keys = itertools.pairwise(cu_seqlens_q.tolist()), itertools.pairwise(cu_seqlens_k.tolist())
    out = [attend(q[a:b], k[c:d], v[c:d], *options) for (a, b), (c, d) in zip(queries, keys, strict=True)]
    return torch.cat(out), None


flash_attn_func.calls = 0
flash_attn_varlen_func.calls = []
flash_attn_varlen_func.options = []


def _options(q, softmax_scale, causal, window_size, softcap, learnable_sink):
    """The arguments of `attend` after the real kernel's `_resolve_causal_local_window`."""
    if learnable_sink is not None:
        assert learnable_sink.shape == (q.shape[-2],), "learnable_sink holds one logit per query head"
        assert learnable_sink.dtype in (torch.float16, torch.bfloat16, torch.float32), learnable_sink.dtype
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    window = (-1 if left is None else left, -1 if right is None else right)
    return softmax_scale, causal, window, softcap, 0.0, learnable_sink


def _refuse(**options):
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise NotImplementedError(f"the FlashAttention 4 stand-in does not compute {', '.join(given)}")
