"""The sparse key indexers run per document (`llm_packing/hook/attention/indexers.py`). Exactness on every supported
type is the parity matrix's (tests/test_parity.py, random layouts); these tests keep the mechanism honest: where the
documents come from, that both sources agree, that a checkpointed layer's recompute on another thread selects the same
keys, and that padded batches of one document a row rank each row alone."""

import threading

import numpy as np
import pytest
import torch
from random_layouts import ISSUE_25_LAYOUT, Layout, draw_layout, packed_layout_batch
from test_parity import TOLERANCE, References, layout_differences
from tiny_models import tiny_model
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook import documents
from llm_packing.hook.attention import indexers
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support import architectures


PACKED_INPUTS = ("input_ids", "attention_mask", "position_ids")
# Issue 25's row, two drawn layouts, and a row without any document between two packed ones.
LAYOUTS = (ISSUE_25_LAYOUT, draw_layout(0), draw_layout(1), Layout(12, ((5, 1, 3), (), (12,))))


def _indexer_masks(model, batch) -> list[torch.Tensor]:
    """The masks the model's indexers receive in a forward of `batch`, with the documents the hook found for each."""
    seen = []

    def record(module, args, kwargs):
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else args[3]
        seen.append((mask, documents.documents_that_prepared(mask)))

    indexer = indexers.indexer_class(model.config.model_type)
    handles = [module.register_forward_pre_hook(record, with_kwargs=True)
               for module in model.modules() if isinstance(module, indexer)]
    try:
        with torch.no_grad():
            model(**{key: batch[key] for key in PACKED_INPUTS}, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _groups(found) -> list:
    return [(rows.tolist(), columns.tolist()) for rows, columns in indexers.SameLengthGroups(found, "cpu").groups]


@pytest.mark.parametrize(("model_type", "backend"), [("deepseek_v32", "eager"), ("deepseek_v32", "sdpa"),
                                                     ("dots3_note_text", "sdpa"), ("hy_v4", "eager")])
def test_indexers_find_the_documents_of_their_forward_and_the_mask_agrees(model_type, backend, monkeypatch):
    """Each indexer of a packed forward finds the forward's own documents (the mask builders recorded the mask it
    gets), so the forward still copies its mask to the host once; the groups read from the mask itself, as a
    recompute on another thread does, are the same."""
    model = tiny_model(model_type, backend)
    copies = []
    copy_to_host = documents._to_host
    monkeypatch.setattr(documents, "_to_host", lambda tensor: copies.append(tensor.shape) or copy_to_host(tensor))
    with packing_configured(model):
        for layout in LAYOUTS:
            batch = packed_layout_batch(layout)
            copies.clear()
            seen = _indexer_masks(model, batch)
            assert len(copies) == 1, (str(layout), copies)
            assert seen and all(found is not None for _, found in seen), str(layout)
            for mask, found in seen:
                assert _groups(found) == _groups(indexers.read_documents(mask)), str(layout)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_checkpointed_recompute_on_another_thread_selects_the_same_keys(backend, monkeypatch):
    """With gradient checkpointing, backward recomputes each layer, indexer included; autograd may do it on a thread
    of its own (one per GPU), where the forward's state is not. The recompute reads the documents from the mask it is
    given, and the gradients equal those of the same forward without checkpointing."""
    model = tiny_model("deepseek_v32", backend).train()
    batch = packed_layout_batch(draw_layout(1))  # its packed row keeps other tied keys than the documents alone
    inputs = {key: batch[key] for key in (*PACKED_INPUTS, "labels")}
    reads = []
    read_documents = indexers.read_documents
    monkeypatch.setattr(indexers, "read_documents", lambda mask: reads.append(mask.shape) or read_documents(mask))
    with packing_configured(model):
        model(**inputs, use_cache=False).loss.backward()
        expected = [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]
        assert not reads
        model.zero_grad()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(**inputs, use_cache=False).loss
        backward = threading.Thread(target=loss.backward)
        backward.start()
        backward.join()
    gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    assert reads, "the recompute found the forward's state: it did not run on a thread of its own"
    assert len(gradients) == len(expected)
    assert max(float((got - want).abs().max()) for got, want in zip(gradients, expected, strict=True)) <= 1e-6


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_padded_unpacked_batches_rank_each_row_alone(backend):
    """A 0/1 mask with right or left padding (one document a row, no id above 1: transformers' own padded path, also
    what the collator gives a batch of rows holding one document each). `topk` over the padded row keeps other tied
    keys than over the document alone (issue 35: glm_moe_dsa off by 0.2 on rows of 22 and 24 tokens), so the hook
    ranks each row's tokens alone: every row's tokens give the logits of those tokens run alone, where transformers'
    padded batch differs."""
    model = tiny_model("deepseek_v32", backend)
    batch = packed_layout_batch(draw_layout(5))  # rows of one document each: 37, 23, 42 and 48 of 48 tokens
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    right = batch["input_ids"], batch["attention_mask"]
    left = tuple(torch.stack([row.roll(len(row) - length) for row, length in zip(tensor, lengths, strict=True)])
                 for tensor in right)
    with torch.no_grad():
        alone = [model(input_ids=right[0][row : row + 1, :length], use_cache=False).logits[0]
                 for row, length in enumerate(lengths)]

    def difference(logits, padding_mask):
        return max(float((logits[row][padding_mask[row].bool()] - expected).abs().max())
                   for row, expected in enumerate(alone))

    for input_ids, padding_mask in (right, left):
        with torch.no_grad():
            unhooked = model(input_ids=input_ids, attention_mask=padding_mask, use_cache=False).logits
        with packing_configured(model):
            padded_batch = {"input_ids": input_ids, "attention_mask": padding_mask, "position_ids": None}
            seen = _indexer_masks(model, padded_batch)
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=padding_mask, use_cache=False).logits
        assert seen and all(found is None for _, found in seen)
        assert all(indexers.read_documents(mask).ids.tolist() == padding_mask.tolist() for mask, _ in seen)
        assert difference(logits, padding_mask) <= TOLERANCE
        assert difference(unhooked, padding_mask) > 100 * TOLERANCE


def test_read_documents_number_padding_tokens_as_documents():
    """The read of a packed mask: documents in order, each padding token a document of its own (what the hook's
    builders make of padding), and an additive float mask read as its bool twin."""
    ids = torch.tensor([[1, 1, 2, 2, 2, 0, 0], [1, 2, 3, 3, 3, 3, 3]])
    segments = torch.where(ids > 0, ids, 10 + torch.arange(7))  # each padding token its own segment
    visible = (segments[:, :, None] == segments[:, None, :]) & torch.ones(7, 7, dtype=torch.bool).tril()
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    for mask in (visible, additive):
        found = indexers.read_documents(mask)
        np.testing.assert_array_equal(found.ids, [[1, 1, 2, 2, 2, 3, 4], [1, 2, 3, 3, 3, 3, 3]])


def test_indexer_missing_from_the_table_is_refused(monkeypatch):
    model = tiny_model("deepseek_v32", "eager")
    monkeypatch.setitem(indexers.INDEXERS, "deepseek_v32", ("glm_moe_dsa", "GlmMoeDsaIndexer"))
    match = "DeepseekV32Indexer.*llm_packing.hook.attention.indexers.INDEXERS"
    with pytest.raises(UnsupportedSetupError, match=match):
        with packing_configured(model):
            pass


def test_unconfigure_restores_every_indexer_forward():
    # dots3_note is new in transformers 5.23.
    installed = [model_type for model_type in indexers.INDEXERS if model_type in CONFIG_MAPPING_NAMES]
    originals = {model_type: indexers.indexer_class(model_type).forward for model_type in installed}
    for model_type in installed:
        with packing_configured(tiny_model(model_type, "eager")):
            assert indexers.indexer_class(model_type).forward is not originals[model_type]
        assert indexers.indexer_class(model_type).forward is originals[model_type]


def test_minimax_m3_sparse_layers_are_refused_for_the_leak_they_have(monkeypatch):
    """minimax_m3_vl_text is supported as the parity matrix's tiny config has it, without sparse layers; MiniMax-M3's
    checkpoints have some. Its block indexer reads no mask (it compares key slots with per-document positions): a
    config with a sparse layer is refused with that reason, and with the refusal bypassed its documents leak."""
    sparse = {"layer_types": ["minimax_m3_sparse", "full_attention"], "index_block_size": 4, "index_topk_blocks": 2}
    model = tiny_model("minimax_m3_vl_text", "eager", **sparse)
    with pytest.raises(UnsupportedSetupError, match="'minimax_m3_sparse' layers: MiniMax-M3's block-sparse attention"):
        architectures.require_supported(model.config)
    monkeypatch.setattr(architectures, "require_supported", lambda config: None)
    references = References(model, [ISSUE_25_LAYOUT])
    with packing_configured(model):
        logit_difference, _, _ = layout_differences(model, references, ISSUE_25_LAYOUT)
    assert logit_difference > 100 * TOLERANCE
