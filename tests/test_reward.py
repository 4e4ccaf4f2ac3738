"""PackedRewardTrainer against TRL's RewardTrainer on the same pairs: equal losses, rewards, metrics and weights."""

import pytest
import torch
from peft import LoraConfig
from test_dpo import BATCH, STEPS, TINY, pairs, tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification
from trl import RewardConfig, RewardTrainer

from llm_packing.batches.padded_forward import pack_padded_batch
from llm_packing.errors import ContaminationError, PackingValueError
from llm_packing.hook.configure import packing_configured
from llm_packing.trainers.reward import PackedRewardTrainer, pack_sequence_scores


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("unconfigure_after")]

METRICS = ("loss", "min_reward", "mean_reward", "max_reward", "accuracy", "margin")


class Recording:
    """Keeps each step's rewards (the model's logits on the padded batch)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        self.rewards.append(outputs.logits.detach().clone())
        return (loss, outputs) if return_outputs else loss


class RecordingRewardTrainer(Recording, RewardTrainer):
    pass


class RecordingPackedRewardTrainer(Recording, PackedRewardTrainer):
    pass


def reward_model():
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, num_labels=1, pad_token_id=0)
    return LlamaForSequenceClassification(config).to(torch.float32)


def reward_pairs(margin=False):
    """The DPO tests' pairs as full chosen and rejected sequences (prompt + completion): lengths 2 to 20 tokens; with
    `margin`, TRL's optional margin column (the loss asks chosen to beat rejected by it)."""
    dataset = pairs().map(lambda pair: {"chosen": pair["prompt"] + pair["chosen"],
                                        "rejected": pair["prompt"] + pair["rejected"]}, remove_columns=["prompt"])
    return dataset.add_column("margin", [0.25 * (i % 3) for i in range(len(dataset))]) if margin else dataset


def train(tmp_path, packed: bool, peft=False, margin=False):
    args = RewardConfig(
        output_dir=str(tmp_path / ("packed" if packed else "padded")), per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, max_length=32,
    )
    extra = {"peft_config": LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
    trainer_class = RecordingPackedRewardTrainer if packed else RecordingRewardTrainer
    trainer = trainer_class(model=reward_model(), args=args, train_dataset=reward_pairs(margin),
                            processing_class=tokenizer(), **(extra if peft else {}))
    trainer.rewards = []
    trainer.train()
    return trainer


@pytest.mark.parametrize(("peft", "margin"), [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "margin"])
def test_every_step_equals_trl(tmp_path, peft, margin):
    packed, padded = train(tmp_path, True, peft, margin), train(tmp_path, False, peft, margin)
    assert len(packed.rewards) == len(padded.rewards) == STEPS
    for mine, theirs in zip(packed.rewards, padded.rewards, strict=True):
        assert mine.shape == (2 * BATCH, 1)
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    logged = [[entry for entry in run.state.log_history if "margin" in entry] for run in (packed, padded)]
    assert len(logged[0]) == len(logged[1]) == STEPS
    for mine, theirs in zip(*logged, strict=True):
        for metric in METRICS:
            assert mine[metric] == pytest.approx(theirs[metric], abs=1e-5), metric
    for (name, mine), theirs in zip(packed.model.named_parameters(), padded.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=name)
    # Plain SGD moved the weights (LoRA: its B matrices start at zero), so steps 2 and 3 score with trained weights.
    if peft:
        moved = max(value.abs().max() for name, value in padded.model.named_parameters() if "lora_B" in name)
    else:
        pairs_ = zip(padded.model.parameters(), reward_model().parameters(), strict=True)
        moved = max((a - b).abs().max() for a, b in pairs_)
    assert moved > 1e-2


def padded_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(BATCH)])


def test_negative_control_packed_rows_without_the_hook_mix_the_sequences(tmp_path):
    trainer = train(tmp_path, packed=False)
    batch = padded_batch(trainer)
    model = trainer.model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        layout = pack_padded_batch(batch["input_ids"], batch["attention_mask"])
        hidden = model.model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                             position_ids=layout.position_ids).last_hidden_state
        lengths = batch["attention_mask"].sum(dim=1)
        naive = model.score(hidden[0, lengths.cumsum(0) - 1])
    assert (naive - expected).abs().max() > 1e-3
    with pytest.raises(ContaminationError, match="configure_packing"):
        pack_sequence_scores(model)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_a_row_scored_at_padding_is_refused(tmp_path):
    trainer = train(tmp_path, packed=True)
    batch = padded_batch(trainer)
    trainer.model.config.pad_token_id = 99  # no token is the pad token: transformers would score the last column
    with pytest.raises(PackingValueError, match="scored at column .* a padding position"):
        trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_the_documented_example_runs_under_the_hook():
    model = reward_model().eval()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    with torch.no_grad():
        padded = model(**batch).logits
        with packing_configured(model):
            packed = pack_sequence_scores(model)(**batch).logits
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
