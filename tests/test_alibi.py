"""ALiBi models that build their biases from the 2-D mask (bloom; falcon with `alibi=True`, as Falcon-RW): under the
hook every key gets the bias of its position within its own document (`llm_packing/hook/attention/alibi.py`). MPT's
one bias for the whole row, exact in theory but rounded at the row's magnitude in float32, is replaced by each
document's own on long rows.

The parity matrix covers bloom (its only configuration); falcon's tiny config uses rotary embeddings, so its ALiBi
variant is proven here on each backend it runs on (FlashAttention refuses ALiBi in transformers itself).
"""

import importlib

import pytest
import torch
from test_parity import TOLERANCE, _max_differences
from tiny_models import packed_batch, tiny_model
from transformers.models.falcon import modeling_falcon
from transformers.models.mpt import modeling_mpt

from llm_packing.hook.configure import packing_configured


ALIBI_MODELS = [("bloom", "eager", {}), ("falcon", "eager", {"alibi": True}), ("falcon", "sdpa", {"alibi": True})]


@pytest.mark.parametrize(("model_type", "backend", "overrides"), ALIBI_MODELS)
def test_alibi_biases_restart_per_document(model_type, backend, overrides):
    model = tiny_model(model_type, backend, **overrides)
    batch = packed_batch()
    with packing_configured(model):
        logit_difference, loss_difference = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference <= TOLERANCE and loss_difference <= TOLERANCE, (logit_difference, loss_difference)


@pytest.mark.parametrize(("model_type", "backend", "overrides"), ALIBI_MODELS)
def test_attention_isolated_but_row_biases_are_not_exact(model_type, backend, overrides):
    """Negative control: the mask builders patched, the ALiBi builder left as transformers has it. Documents no longer
    attend to each other, but the indexed mask skews their biases (document 2's positions doubled)."""
    model = tiny_model(model_type, backend, **overrides)
    batch = packed_batch()
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with packing_configured(model):
        module.build_alibi_tensor = module.build_alibi_tensor.__wrapped__  # unconfiguring finds the original in place
        logit_difference, _ = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference > 10 * TOLERANCE


def test_plain_mask_keeps_the_original_biases():
    original = modeling_falcon.build_alibi_tensor
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    with packing_configured(tiny_model("falcon", "eager", alibi=True)):
        assert modeling_falcon.build_alibi_tensor is not original
        patched = modeling_falcon.build_alibi_tensor(mask, 4, torch.float32)
        assert torch.equal(patched, original(mask, 4, torch.float32))
    assert modeling_falcon.build_alibi_tensor is original


# MPT's largest slopes come with many heads (32: 0.84 down to 1/256); weights of a trained model's scale
# (initializer_range 0.1), and one layer to keep the 2,040-token rows cheap.
MPT_LONG_ROWS = {"one row": [[1000, 1040]], "two rows": [[1000, 1040], [640, 1400]]}


@pytest.mark.parametrize("rows", MPT_LONG_ROWS.values(), ids=MPT_LONG_ROWS.keys())
def test_mpt_documents_on_long_rows_get_the_biases_they_get_alone(rows):
    """With MPT's own bias, counted from the end of the 2,040-token row, a row's first document came out 4.7e-5 off
    alone (one row; 6.4e-5 with two); with the biases of its own positions, 3.6e-6 (4.2e-6): the sums over the row's
    2,040 keys, masked ones included, round differently from the document's own."""
    model = tiny_model("mpt", "eager", n_heads=32, n_layers=1, max_seq_len=2048, d_model=64, initializer_range=0.1)
    generator = torch.Generator().manual_seed(0)
    length = sum(rows[0])
    input_ids = torch.randint(3, model.config.vocab_size, (len(rows), length), generator=generator)
    mask = torch.tensor([[document for document, size in enumerate(row, 1) for _ in range(size)] for row in rows])
    with packing_configured(model), torch.no_grad():
        packed = model(input_ids=input_ids, attention_mask=mask).logits
    worst = 0.0
    with torch.no_grad():
        for row, sizes in enumerate(rows):
            for start, size in zip(torch.tensor([0, *sizes]).cumsum(0).tolist(), sizes, strict=False):
                alone = model(input_ids=input_ids[row : row + 1, start : start + size]).logits[0]
                worst = max(worst, (packed[row, start : start + size] - alone).abs().max().item())
    assert worst <= TOLERANCE, worst


def test_mpt_attention_is_restored_and_runs_its_own_bias_outside_packed_batches():
    original = modeling_mpt.MptAttention.forward
    model = tiny_model("mpt", "eager")
    input_ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])).logits
        with packing_configured(model):
            assert modeling_mpt.MptAttention.forward is not original
            plain = model(input_ids=input_ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])).logits
    assert modeling_mpt.MptAttention.forward is original
    assert torch.equal(plain, expected)
