"""The FlashAttention path, driven through transformers' real code with a pure-torch reference kernel.

FlashAttention cannot run on these CPU machines, so the tests inject a small reference implementation of
`flash_attn_varlen_func` / `flash_attn_func` where transformers' `lazy_import_flash_attention` keeps the loaded
kernel. Everything else (the attention integration, `_flash_attention_forward`, `_upad_input`, `_get_unpad_data`,
re-padding) is transformers' own code, so the tests see exactly which `cu_seqlens` a real kernel would get.
"""

import pytest
import torch
from tiny_models import packed_batch, tiny_model
from transformers import modeling_flash_attention_utils as flash_utils

from llm_packing.patch import packing_configured


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """`flash_attn_varlen_func` in plain torch: q `[total, heads, dim]`, k/v `[total, kv_heads, dim]`, one segment
    per `cu_seqlens` entry, bottom-right aligned causal mask, inclusive `(left, right)` window, tanh softcap."""
    reference_varlen.calls.append(cu_seqlens_q.tolist())
    assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outputs = []
    for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        outputs.append(_attend(q[start:end], k[start:end], v[start:end], scale, causal, window_size, softcap))
    return torch.cat(outputs)


def reference_dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False):
    """`flash_attn_func` in plain torch: q/k/v `[batch, length, heads, dim]`."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return torch.stack([_attend(*row, scale, causal, window_size, softcap) for row in zip(q, k, v)])


reference_varlen.calls = []


def _attend(q, k, v, scale, causal, window_size, softcap):
    heads = q.shape[1]
    k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
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
    probabilities = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probabilities, v)


@pytest.fixture
def reference_flash_kernel(monkeypatch):
    """Install the reference kernel as the loaded `flash_attention_2` implementation, for this test only."""
    monkeypatch.setattr(flash_utils, "_loaded_implementation", "flash_attention_2")
    monkeypatch.setattr(flash_utils, "_flash_fn", reference_dense)
    monkeypatch.setattr(flash_utils, "_flash_varlen_fn", reference_varlen)
    monkeypatch.setattr(flash_utils, "_pad_fn", flash_utils._pad_input)
    monkeypatch.setattr(flash_utils, "_unpad_fn", flash_utils._unpad_input)
    monkeypatch.setattr(flash_utils, "_process_flash_kwargs_fn", flash_utils._lazy_define_process_function(reference_varlen))
    monkeypatch.setattr(reference_varlen, "calls", [])
    return reference_varlen


def _flash_model(model_type):
    model = tiny_model(model_type, "eager")
    # Building with "flash_attention_2" would check that the flash-attn package is installed; the kernel is ours.
    model.config._attn_implementation = "flash_attention_2"
    return model


def _separate_logits(model, batch):
    with torch.no_grad():
        return {
            (row, start): model(
                input_ids=batch["input_ids"][row : row + 1, start : start + length],
                position_ids=torch.arange(length)[None],
                use_cache=False,
            ).logits[0]
            for row, spans in enumerate(batch["documents"])
            for start, length in spans
        }


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
def test_flash_path_sees_per_document_cu_seqlens_and_matches_separate_documents(reference_flash_kernel, model_type):
    model = _flash_model(model_type)
    batch = packed_batch()
    expected = _separate_logits(model, batch)
    reference_flash_kernel.calls.clear()
    with packing_configured(model), torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
    # Documents (5, 1, 7, 3) + 2 pad tokens, then (9, 2, 1, 6): one segment per document, in flattened order.
    assert reference_flash_kernel.calls == [[0, 5, 6, 13, 16, 25, 27, 28, 34]] * model.config.num_hidden_layers
    for (row, start), reference in expected.items():
        packed = logits[row, start : start + reference.shape[0]]
        assert (packed - reference).abs().max().item() <= 1e-5, (model_type, row, start)


def test_flash_path_without_packing_merges_documents(reference_flash_kernel):
    """Negative control: unpatched, transformers booleanises the indexed mask and FlashAttention sees one segment
    per row, so later documents attend to earlier ones."""
    model = _flash_model("llama")
    batch = packed_batch()
    expected = _separate_logits(model, batch)
    reference_flash_kernel.calls.clear()
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
    assert reference_flash_kernel.calls == [[0, 16, 34]] * model.config.num_hidden_layers
    start, length = batch["documents"][1][3]
    assert (logits[1, start : start + length] - expected[(1, start)]).abs().max().item() > 1e-3
