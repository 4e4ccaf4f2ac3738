"""The packed forward of padded batches: TRL's fused per-token outputs equal the padded forward's, layout by layout."""

import pytest
import torch
from tiny_models import tiny_model
from trl.trainer.utils import add_fused_lm_head

from llm_packing.batches.padded_forward import pack_fused_lm_head, pack_padded_batch
from llm_packing.errors import (
    ContaminationError,
    PackingTypeError,
    PackingValueError,
    SequenceTooLongError,
    UnsupportedSetupError,
)
from llm_packing.hook.configure import configure_packing, unconfigure_packing


FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1", "label_mask")
# Left (GRPO's prompts), right (DPO's pairs), both sides, none, and a short row.
MASK = torch.tensor([
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
])


@pytest.fixture
def models():
    """The same weights twice, both with TRL's fused head; the first packs its padded batches."""
    torch.manual_seed(0)
    padded = tiny_model("llama")
    packed = tiny_model("llama")
    packed.load_state_dict(padded.state_dict())
    for model in (padded, packed):
        add_fused_lm_head(model, outputs=FIELDS[:-1])
    configure_packing(packed)
    yield packed, padded
    unconfigure_packing()


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, MASK.shape, generator=generator)
    labels = input_ids.masked_fill(MASK == 0, -100)
    labels[:, :4] = -100  # the prompt: scored from position 4 on, never from padding
    return input_ids, labels


@pytest.mark.parametrize("max_length", [None, 12, 20])
def test_fused_outputs_and_gradients_equal_the_padded_forward(models, max_length):
    packed, padded = models
    pack_fused_lm_head(packed, max_length=max_length)
    input_ids, labels = batch()
    outputs = [model(input_ids=input_ids, attention_mask=MASK, labels=labels, fused_lm_head=True, use_cache=False)
               for model in (packed, padded)]
    for field in FIELDS:
        mine, theirs = (getattr(output, field) for output in outputs)
        assert mine.shape == theirs.shape == (4, 11)
        torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-5, rtol=0)
    for output in outputs:
        output.loss.backward()
    for (name, mine), theirs in zip(packed.named_parameters(), padded.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=0, msg=name)


def test_rows_beyond_max_length_are_packed_by_best_fit():
    layout = pack_padded_batch(torch.arange(48).view(4, 12), MASK, max_length=12)
    assert layout.input_ids.shape == (4, 12)  # 8, 12, 9 and 7 tokens: no two share a row of 12
    layout = pack_padded_batch(torch.arange(48).view(4, 12), MASK, max_length=16)
    assert sorted(layout.attention_mask.max(dim=1).values.tolist()) == [1, 1, 2]  # 12, 9 + 7, 8
    torch.testing.assert_close(layout.unpack(layout.input_ids), torch.arange(48).view(4, 12) * MASK)


def test_generation_and_plain_calls_are_untouched(models):
    packed, padded = models
    pack_fused_lm_head(packed)
    input_ids, _ = batch()
    torch.testing.assert_close(packed(input_ids=input_ids).logits, padded(input_ids=input_ids).logits)


def test_negative_control_the_packed_batch_without_the_hook_mixes_rows(models):
    packed, padded = models
    pack_fused_lm_head(packed)
    input_ids, labels = batch()
    expected = padded(input_ids=input_ids, attention_mask=MASK, labels=labels, fused_lm_head=True).log_probs
    unconfigure_packing()
    layout = pack_padded_batch(input_ids, MASK)
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    naive = padded(input_ids=layout.input_ids, attention_mask=layout.attention_mask, position_ids=layout.position_ids,
                   shift_labels=layout.pack(shifted, -100), fused_lm_head=True).log_probs
    assert (layout.unpack(naive)[:, :-1] - expected).abs().max() > 1e-2
    pack_fused_lm_head(packed)  # unconfiguring took it off: packed again, with nothing configured
    with pytest.raises(ContaminationError, match="configure_packing"):
        packed(input_ids=input_ids, attention_mask=MASK, labels=labels, fused_lm_head=True)


def test_bad_batches_are_refused(models):
    packed, _ = models
    pack_fused_lm_head(packed, max_length=12)
    input_ids, labels = batch()
    call = {"input_ids": input_ids, "attention_mask": MASK, "labels": labels, "fused_lm_head": True}
    with pytest.raises(SequenceTooLongError, match="`max_length`=10"):
        pack_padded_batch(input_ids, MASK, max_length=10)
    with pytest.raises(PackingValueError, match="padding between real tokens"):
        packed(**{**call, "attention_mask": torch.tensor([[1, 0, 1] * 4] * 4)})
    with pytest.raises(PackingValueError, match="must be 0/1"):
        packed(**{**call, "attention_mask": MASK * 2})
    with pytest.raises(PackingTypeError, match="of one shape"):
        packed(**{**call, "labels": labels[:, 1:]})
    with pytest.raises(PackingValueError, match="from padding position"):
        packed(**{**call, "labels": input_ids})
    with pytest.raises(UnsupportedSetupError, match="output_router_logits"):
        packed(**call, output_router_logits=True)
    with pytest.raises(UnsupportedSetupError, match="add_fused_lm_head"):
        pack_fused_lm_head(tiny_model("llama"))


def test_generation_with_a_padded_batch_is_unchanged_while_packing_is_configured(models):
    packed, padded = models
    pack_fused_lm_head(packed)
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    # With a KV cache, the decoding steps pass `position_ids` for the new token only (GRPO's rollouts do this).
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "use_cache": True}
    mine = packed.generate(input_ids, **kwargs)
    unconfigure_packing()
    assert torch.equal(mine, padded.generate(input_ids, **kwargs))


def test_unconfiguring_gives_the_models_their_own_forwards_back(models):
    """The packed forwards `pack_fused_lm_head` and `pack_sequence_scores` put on a model are part of the
    configuration: a model trained by PackedDPOTrainer or PackedRewardTrainer, unconfigured, ran every fused or scoring
    call into "ran without `configure_packing`", so it could be used for nothing but packed training again."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from llm_packing.trainers.reward import pack_sequence_scores

    packed, padded = models
    fused_head = packed.forward
    pack_fused_lm_head(packed)
    torch.manual_seed(0)
    scorer = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=0)).eval()
    pack_sequence_scores(scorer)
    unconfigure_packing()
    assert packed.forward is fused_head and "forward" not in vars(scorer)
    input_ids, labels = batch()
    call = {"input_ids": input_ids, "attention_mask": MASK, "labels": labels, "fused_lm_head": True,
            "use_cache": False}
    torch.testing.assert_close(packed(**call).log_probs, padded(**call).log_probs, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert scorer(input_ids=input_ids, attention_mask=MASK).logits.shape == (4, 1)
