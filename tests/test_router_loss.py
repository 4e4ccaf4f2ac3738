"""MoE load-balancing losses on packed rows: each token counted once, as in the same documents padded. The indexed
mask's document numbers were read as weights (a row's third document counted three times)."""

import pytest
import torch
from tiny_models import tiny_model
from transformers.models.mixtral import modeling_mixtral

from llm_packing import DataCollatorWithPacking
from llm_packing.hook import registry, router_loss
from llm_packing.hook.configure import packing_configured


DOCUMENT_LENGTHS = (7, 12, 5)


def padded_and_packed(model):
    """The aux loss, loss and gradients of three documents padded one a row (0/1 mask), and of the same documents
    packed in one row with the hook configured."""
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(3, 128, (length,), generator=generator).tolist() for length in DOCUMENT_LENGTHS]
    width = max(DOCUMENT_LENGTHS)
    input_ids = torch.tensor([document + [0] * (width - len(document)) for document in documents])
    mask = (torch.arange(width)[None] < torch.tensor(DOCUMENT_LENGTHS)[:, None]).long()
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100  # as the packed row: a document's first token is no target
    results = []
    for run in ("padded", "packed"):
        model.zero_grad()
        if run == "padded":
            output = model(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False)
        else:
            with packing_configured(model):
                batch = DataCollatorWithPacking()([{"input_ids": sum(documents, []), "seq_lengths": DOCUMENT_LENGTHS}])
                output = model(**batch, use_cache=False)
        output.loss.backward()
        results.append((output.aux_loss.item(), output.loss.item(),
                        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    return results


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_packed_documents_give_the_padded_load_balancing_loss_and_gradients(model_type):
    torch.manual_seed(0)
    model = tiny_model(model_type, output_router_logits=True, router_aux_loss_coef=1.0).train()
    (aux, loss, gradients), (packed_aux, packed_loss, packed_gradients) = padded_and_packed(model)
    assert abs(packed_aux - aux) <= 1e-6 and abs(packed_loss - loss) <= 1e-5
    assert (packed_gradients - gradients).abs().max() <= 1e-5


def test_without_the_patch_the_document_numbers_weigh_the_tokens(monkeypatch):
    """Negative control: transformers' own function under the rest of the hook."""
    monkeypatch.setattr(router_loss, "patch_load_balancing_losses", lambda config: None)
    torch.manual_seed(0)
    model = tiny_model("qwen2_moe", output_router_logits=True, router_aux_loss_coef=1.0).train()
    (aux, _, _), (packed_aux, _, _) = padded_and_packed(model)
    assert abs(packed_aux - aux) > 1e-3


def test_trls_fused_head_finds_the_replacement_and_unconfigure_restores_it():
    """TRL's fused LM head imports Mixtral's function at every call, whatever the model."""
    original = modeling_mixtral.load_balancing_loss_func
    with packing_configured(tiny_model("qwen2_moe")):
        assert registry.is_ours(modeling_mixtral.load_balancing_loss_func)
    assert modeling_mixtral.load_balancing_loss_func is original
