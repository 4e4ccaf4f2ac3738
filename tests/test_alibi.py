"""ALiBi models that build their biases from the 2-D mask (bloom; falcon with `alibi=True`, as Falcon-RW): under the
hook every key gets the bias of its position within its own document (`llm_packing/hook/attention/alibi.py`).

The parity matrix covers bloom (its only configuration); falcon's tiny config uses rotary embeddings, so its ALiBi
variant is proven here on each backend it runs on (FlashAttention refuses ALiBi in transformers itself).
"""

import importlib

import pytest
import torch
from test_parity import TOLERANCE, _max_differences
from tiny_models import packed_batch, tiny_model
from transformers.models.falcon import modeling_falcon

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
