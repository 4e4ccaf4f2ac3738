"""`measure_packing`, the comparison under `verify_packing` and `llm-packing verify`: the same numbers as
`verify_packing` on its own layout, gradients of a per-document loss, and its argument errors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llm_packing import packing_configured, verify_packing
from llm_packing.errors import PackingValueError
from llm_packing.hook.verify import measure_packing


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=64))


def test_default_layout_is_verify_packings(model):
    with packing_configured(model):
        measured = measure_packing(model)
        assert measured.gradients is None
        assert measured.logits.difference == verify_packing(model) <= 1e-5
    assert measured.logits.floor is not None and "noise floor" in measured.logits.explained


def test_gradients_of_documents_alone(model):
    """Packed gradients equal the sum of each document's own; the hook left off, they do not (nor the logits)."""
    rows = [[20, 1, 7, 1], [32], [1, 2, 3, 5, 8, 1]]
    with packing_configured(model):
        exact = measure_packing(model, rows, 32, gradients=True)
    leaked = measure_packing(model, rows, 32, gradients=True)
    assert exact.exact and exact.gradients.difference <= 1e-5
    assert not leaked.exact and leaked.gradients.difference > 100 * leaked.gradients.limit
    assert all(parameter.grad is None for parameter in model.parameters())  # .grad untouched: autograd.grad


@pytest.mark.parametrize("rows, columns, match", [
    ([[10, 7]], 16, r"summing to at most `columns` \(16\), got row \[10, 7\]"),
    ([[3, 0]], 16, r"positive document lengths"),
    ([[]], 16, r"got row \[\]"),
    ([[3]], 0, r"`columns`"),
])
def test_bad_layouts(model, rows, columns, match):
    with pytest.raises(PackingValueError, match=match):
        measure_packing(model, rows, columns)


def test_gradients_of_a_frozen_model(model):
    model.requires_grad_(False)
    try:
        with pytest.raises(PackingValueError, match="every parameter of LlamaForCausalLM is frozen"):
            measure_packing(model, gradients=True)
    finally:
        model.requires_grad_(True)
