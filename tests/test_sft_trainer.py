"""End to end with TRL: SFTTrainer on `pack_dataset` output gives the losses of the same documents unpacked, step
after step: with plain SGD each step's loss follows from the previous step's gradients, so equal losses at steps 2
and 3 cover the gradients too (Adam's first steps move each weight by about the learning rate whatever the gradient's
size)."""

import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

from llm_packing.batches.collator import DataCollatorWithPacking
from llm_packing.data.pack import pack_dataset
from llm_packing.errors import ContaminationError
from llm_packing.hook.configure import configure_packing, unconfigure_packing


pytestmark = pytest.mark.slow

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LENGTHS = [5, 9, 14, 3, 21, 7, 11, 2, 17, 6]  # 95 tokens; rows of 32 hold several documents each
MAX_LENGTH = 32
STEPS = 3
LEARNING_RATE = 0.5  # plain SGD: large enough that each step moves the loss far more than the tolerance


class LossRecordingSFTTrainer(SFTTrainer):
    """Keeps the loss of every training step (the logged one is rounded)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((loss[0] if return_outputs else loss).item())
        return loss


def documents() -> Dataset:
    rng = np.random.default_rng(0)
    input_ids = [rng.integers(3, 128, n).tolist() for n in LENGTHS]
    labels = [np.where(rng.random(n) < 0.2, -100, ids).tolist() for n, ids in zip(LENGTHS, input_ids, strict=True)]
    return Dataset.from_dict({"input_ids": input_ids, "labels": labels})


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                   pad_token="t0", eos_token="t2")


def train(tmp_path, attn_implementation, dataset, batch_size, data_collator=None, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation=attn_implementation)
    if isinstance(data_collator, DataCollatorWithPacking):
        configure_packing(model)
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=batch_size, max_steps=STEPS, optim="sgd",
        learning_rate=LEARNING_RATE,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, activation_checkpointing=False, seed=0,
        dataset_kwargs={"skip_prepare_dataset": True}, **config,
    )
    trainer = LossRecordingSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer(),
                                      data_collator=data_collator)
    trainer.losses = []
    try:
        trainer.train()
    finally:
        unconfigure_packing()
    assert len(trainer.losses) == STEPS and all(math.isfinite(loss) for loss in trainer.losses)
    return trainer.losses


def unpacked_losses(tmp_path, attn_implementation):
    # One document per row, padded, TRL's own collator: the reference every packed path must match.
    losses = train(tmp_path, attn_implementation, documents(), len(LENGTHS), packing=False, max_length=None)
    assert losses[0] - losses[-1] > 0.05, losses  # the steps move the weights: later losses depend on the gradients
    return losses


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_with_our_collator_matches_unpacked(tmp_path, attn_implementation):
    packed = pack_dataset(documents(), MAX_LENGTH)
    assert max(map(len, packed["seq_lengths"])) > 1  # several documents share a row
    losses = train(
        tmp_path, attn_implementation, packed, len(packed), DataCollatorWithPacking(pad_token_id=0),
        packing=False, padding_free=False, remove_unused_columns=False,
    )
    assert losses == pytest.approx(unpacked_losses(tmp_path, attn_implementation), abs=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_with_trl_padding_free_collator_matches_unpacked(tmp_path, attn_implementation):
    # TRL's padding-free collator reads our `seq_lengths`, flattens the batch and relies on transformers' own
    # position-id detection (SFTTrainer passes use_cache=False), without the hook.
    packed = pack_dataset(documents(), MAX_LENGTH)
    losses = train(tmp_path, attn_implementation, packed, len(packed), padding_free=True, max_length=None)
    assert losses == pytest.approx(unpacked_losses(tmp_path, attn_implementation), abs=1e-5)


def test_trl_default_collator_on_packed_rows_is_contaminated(tmp_path):
    # Negative control, and the reason to use one of the collators above: TRL's padding collator ignores
    # `seq_lengths` and gives every row an all-ones mask, so packed documents attend to each other. Without
    # `configure_packing` nothing can see it; a configured model refuses the batch (the test below).
    packed = pack_dataset(documents(), MAX_LENGTH)
    losses = train(tmp_path, "sdpa", packed, len(packed), packing=False, padding_free=False, max_length=None)
    assert abs(losses[0] - unpacked_losses(tmp_path, "sdpa")[0]) > 1e-3


def test_stock_sft_trainer_on_a_configured_model_stops_before_the_first_step(tmp_path):
    """The design card's literal line with stock TRL: `configure_packing(model)`, then
    `trl.SFTTrainer(model=model, train_dataset=pack_dataset(...))` with TRL's defaults. TRL's collator sends an
    all-ones mask and no `position_ids`, so the configured model refuses the first batch, naming the fix, and no
    weight moves."""
    packed = pack_dataset(documents(), MAX_LENGTH)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY))
    before = [parameter.detach().clone() for parameter in model.parameters()]
    configure_packing(model)
    try:
        args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_steps=2)
        trainer = SFTTrainer(model=model, args=args, train_dataset=packed, processing_class=tokenizer())
        with pytest.raises(ContaminationError, match="PackedSFTTrainer.*DataCollatorWithPacking"):
            trainer.train()
    finally:
        unconfigure_packing()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _weights(model) -> torch.Tensor:
    return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])


def _accumulated_step(tmp_path, packed: bool, hooked: bool = True) -> torch.Tensor:
    """The weights after one SGD step over all documents, in micro-batches: unpacked, 5 x 2 padded documents;
    packed, one packed row per micro-batch."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa")
    if packed:
        dataset = pack_dataset(documents(), MAX_LENGTH)
        collator = DataCollatorWithPacking(pad_token_id=0, check_model_configured=hooked)
        if hooked:
            configure_packing(model)
        batch, accumulation = 1, len(dataset)
        config = {"packing": False, "padding_free": False, "remove_unused_columns": False}
    else:
        dataset, collator, batch, accumulation = documents(), None, 2, len(LENGTHS) // 2
        config = {"packing": False, "max_length": None}
    args = SFTConfig(
        output_dir=str(tmp_path / f"packed-{packed}-{hooked}"), per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=LEARNING_RATE,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
        dataset_kwargs={"skip_prepare_dataset": True}, **config,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer(),
                         data_collator=collator)
    try:
        trainer.train()
    finally:
        unconfigure_packing()
    return _weights(model)


def test_gradient_accumulation_packed_equals_unpacked(tmp_path):
    """One optimizer step accumulated over micro-batches: Trainer normalises the summed loss by the trained tokens of
    the whole step (`num_items_in_batch`), so packed rows and padded documents give the same weights. Without the
    hook the same packed rows give other weights (the negative control)."""
    unpacked = _accumulated_step(tmp_path, packed=False)
    packed = _accumulated_step(tmp_path, packed=True)
    torch.manual_seed(0)
    initial = _weights(AutoModelForCausalLM.from_config(LlamaConfig(**TINY)))
    assert (unpacked - initial).abs().max() > 1e-2  # the step moved the weights
    assert (packed - unpacked).abs().max() <= 1e-6
    assert (_accumulated_step(tmp_path, packed=True, hooked=False) - unpacked).abs().max() > 1e-4


def test_resuming_from_a_checkpoint_across_an_epoch_boundary_gives_the_uninterrupted_weights(tmp_path):
    """PackedSFTTrainer, 6 steps over epochs of 3 packed rows (one row a step): stopped after 4 (in epoch 2) and
    resumed from its checkpoint, the weights end equal to a run of 6 steps without a stop."""
    from llm_packing import PackedSFTTrainer

    packed = pack_dataset(documents(), MAX_LENGTH)
    assert len(packed) == 3

    def trainer(output_dir, callbacks=()):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa")
        args = SFTConfig(output_dir=str(output_dir), per_device_train_batch_size=1, max_steps=6,
                         optim="adamw_torch", learning_rate=1e-2, save_strategy="steps", save_steps=4,
                         report_to="none", use_cpu=True, bf16=False, seed=0, data_seed=0)
        return PackedSFTTrainer(model=model, args=args, train_dataset=packed, processing_class=tokenizer(),
                                callbacks=list(callbacks))

    try:
        whole = trainer(tmp_path / "whole")
        whole.train()
        interrupted = trainer(tmp_path / "interrupted", [_StopAfter(4)])  # as if killed after its checkpoint
        interrupted.train()
        resumed = trainer(tmp_path / "interrupted")
        resumed.train(resume_from_checkpoint=str(tmp_path / "interrupted" / "checkpoint-4"))
    finally:
        unconfigure_packing()
    assert resumed.state.global_step == whole.state.global_step == 6
    assert resumed.state.epoch == whole.state.epoch == 2
    assert (_weights(resumed.model) - _weights(whole.model)).abs().max() <= 1e-6
    assert (_weights(interrupted.model) - _weights(whole.model)).abs().max() > 1e-4  # 4 steps are not 6


class _StopAfter(TrainerCallback):
    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.steps
