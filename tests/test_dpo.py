"""PackedDPOTrainer against TRL's DPOTrainer on the same pairs: equal losses, log-probs, metrics and weights."""

import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tiny_models import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

from llm_packing.batches.padded_forward import pack_padded_batch
from llm_packing.errors import PackingValueError, SequenceTooLongError
from llm_packing.trainers.dpo import PackedDPOTrainer, _check_pairs


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("unconfigure_after")]

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
STEPS = 3
BATCH = 4
# Every loss_type TRL 1.16 offers (the error message of `DPOTrainer._compute_loss` lists them), with the settings
# its constructor requires.
LOSS_TYPES = {
    "sigmoid": {}, "hinge": {}, "ipo": {}, "exo_pair": {"label_smoothing": 0.1}, "nca_pair": {},
    "robust": {"label_smoothing": 0.1}, "bco_pair": {}, "sppo_hard": {}, "aot": {}, "aot_unpaired": {},
    "apo_zero": {}, "apo_down": {}, "discopop": {}, "sft": {}, "sigmoid_norm": {},
}
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t2")


def pairs(count=BATCH * STEPS, seed=0, longest=12) -> Dataset:
    """Prompts of 1-8 tokens, completions of 1-`longest` (EOS included): rows of very different lengths."""
    generator = torch.Generator().manual_seed(seed)

    def text(low, high):
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        tokens = torch.randint(3, TINY["vocab_size"], (length,), generator=generator).tolist()
        return " ".join(f"t{token}" for token in tokens)

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(count):
        rows["prompt"].append(text(1, 8))
        rows["chosen"].append(f" {text(0, longest - 1)} t2".replace("  ", " "))
        rows["rejected"].append(f" {text(0, longest - 1)} t2".replace("  ", " "))
    return Dataset.from_dict(rows)


class Recording:
    """Keeps each step's loss and the per-token log-probs of every fused forward (policy and reference)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss.item())
        self.completion_masks.append(inputs["completion_mask"])
        return loss


class RecordingDPOTrainer(Recording, DPOTrainer):
    pass


class RecordingPackedDPOTrainer(Recording, PackedDPOTrainer):
    pass


def record_log_probs(trainer, calls):
    """Wrap the fused forward of the policy and the reference; `trainer.packs` says which of them pack."""
    models_ = [trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model]
    if trainer.ref_model is not None:
        models_.append(trainer.ref_model)
    trainer.packs = []
    for model in (getattr(model, "_orig_mod", model) for model in models_):  # what `torch.compile` wraps
        forward = model.forward
        trainer.packs.append(getattr(getattr(forward, "__func__", None), "_packs_padded_batches", False))

        def recorded(*args, _forward=forward, **kwargs):
            outputs = _forward(*args, **kwargs)
            if kwargs.get("fused_lm_head"):
                calls.append(outputs.log_probs.detach().clone())
            return outputs

        model.forward = recorded


def train(tmp_path, packed: bool, loss_type="sigmoid", peft=False, dataset=None, model_type=None, **config):
    torch.manual_seed(0)
    if model_type is None:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa")
    else:  # the parity matrix's tiny model of that type (vocabulary 128, as TINY); gemma2 offers no sdpa
        model = tiny_model(model_type, "eager" if model_type == "gemma2" else "sdpa")
    settings = {
        "per_device_train_batch_size": BATCH, "max_steps": STEPS, "learning_rate": 0.5, "optim": "sgd",
        "lr_scheduler_type": "constant", "logging_steps": 1, "report_to": "none", "save_strategy": "no",
        "use_cpu": True, "bf16": False, "seed": 0, "max_length": 32, "loss_type": [loss_type], "beta": 0.5,
        **LOSS_TYPES[loss_type], **config,
    }
    args = DPOConfig(output_dir=str(tmp_path / ("packed" if packed else "padded")), **settings)
    trainer_class = RecordingPackedDPOTrainer if packed else RecordingDPOTrainer
    extra = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])} if peft else {}
    ref_model = None if peft else copy.deepcopy(model)
    trainer = trainer_class(model=model, ref_model=ref_model, args=args, train_dataset=dataset or pairs(),
                            processing_class=tokenizer(), **extra)
    trainer.losses, trainer.completion_masks, trainer.log_probs = [], [], []
    record_log_probs(trainer, trainer.log_probs)
    trainer.train()
    return trainer


# Sums over a sequence (log-probs near -60) and some losses (sppo_hard's squares reach ~100) are float32 numbers
# whose spacing is 4e-6 to 8e-6 there: they get 1e-6 relative on top of the 1e-5 absolute.
SUM_RTOL = 1e-6


def assert_same_run(packed, padded):
    assert all(packed.packs) and not any(padded.packs)
    assert len(packed.losses) == len(padded.losses) == STEPS
    torch.testing.assert_close(torch.tensor(packed.losses), torch.tensor(padded.losses), atol=1e-5, rtol=SUM_RTOL)
    assert len(packed.log_probs) == len(padded.log_probs) == 2 * STEPS  # policy and reference, every step
    for mine, theirs in zip(packed.log_probs, padded.log_probs, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
        # The chosen and rejected log-probs of every pair
        torch.testing.assert_close(mine.sum(dim=1), theirs.sum(dim=1), atol=1e-5, rtol=SUM_RTOL)
    logged = [[entry for entry in run.state.log_history if "rewards/chosen" in entry] for run in (packed, padded)]
    assert len(logged[0]) == len(logged[1]) == STEPS
    for mine, theirs in zip(*logged, strict=True):
        for metric in METRICS:
            assert mine[metric] == pytest.approx(theirs[metric], abs=1e-5, rel=SUM_RTOL), metric
    for (name, mine), theirs in zip(packed.model.named_parameters(), padded.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=name)


def test_every_step_equals_trl_with_a_reference_model(tmp_path):
    packed, padded = train(tmp_path, packed=True), train(tmp_path, packed=False)
    assert_same_run(packed, padded)
    torch.manual_seed(0)
    initial = AutoModelForCausalLM.from_config(LlamaConfig(**TINY))
    moved = max((a - b).abs().max() for a, b in zip(padded.model.parameters(), initial.parameters(), strict=True))
    assert moved > 1e-2  # plain SGD moved the weights: later steps check a policy that differs from the reference


def test_torch_compile_equals_trl(tmp_path):
    """`torch_compile=True` (dynamo on `aot_eager` here): the trainer packs the compiled module's own model, not the
    compile wrapper (it was refused: "has no fused LM head"), and every step equals TRL's compiled run."""
    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    assert_same_run(train(tmp_path, packed=True, **compiled), train(tmp_path, packed=False, **compiled))


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_gradient_accumulation_with_adamw_equals_trl(tmp_path, model_type):
    """Two micro-batches per optimizer step and AdamW, on qwen3 and on gemma2 (attention logit softcapping, a 4-token
    sliding window shorter than most sequences): every micro-batch's loss and log-probs, and the weights after every
    step, equal TRL's unpacked run. AdamW moves each weight by about the learning rate whatever the gradient's size,
    so the weights are compared after 3 steps with a small rate, and the losses check the gradients' effect."""
    settings = {"model_type": model_type, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2,
                "optim": "adamw_torch", "learning_rate": 1e-2}
    packed, padded = train(tmp_path, True, **settings), train(tmp_path, False, **settings)
    assert all(packed.packs) and not any(padded.packs)
    assert len(packed.losses) == len(padded.losses) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(packed.losses), torch.tensor(padded.losses), atol=1e-5, rtol=SUM_RTOL)
    for mine, theirs in zip(packed.log_probs, padded.log_probs, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    for (name, mine), theirs in zip(packed.model.named_parameters(), padded.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=name)
    assert padded.losses[0] != padded.losses[-1]  # the steps moved the policy


@pytest.mark.parametrize("loss_type", [name for name in LOSS_TYPES if name != "sigmoid"])
def test_every_loss_type_equals_trl(tmp_path, loss_type):
    assert_same_run(train(tmp_path, True, loss_type), train(tmp_path, False, loss_type))


def test_peft_lora_with_the_disabled_adapter_reference_equals_trl(tmp_path):
    packed, padded = train(tmp_path, True, peft=True), train(tmp_path, False, peft=True)
    assert packed.ref_model is None and padded.ref_model is None
    assert_same_run(packed, padded)


def test_negative_control_packed_rows_without_the_hook_mix_the_sequences(tmp_path):
    trainer = train(tmp_path, packed=False)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(BATCH)])
    model = trainer.model
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                     fused_lm_head=True).log_probs
    layout = pack_padded_batch(batch["input_ids"], batch["attention_mask"])
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    naive = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask, position_ids=layout.position_ids,
                  shift_labels=layout.pack(shifted, -100), fused_lm_head=True).log_probs
    assert (layout.unpack(naive)[:, :-1].sum(dim=1) - expected.sum(dim=1)).abs().max() > 1e-2


def test_a_pair_longer_than_max_length_is_refused_not_cut(tmp_path):
    with pytest.raises(SequenceTooLongError, match="`max_length`=8"):
        train(tmp_path, True, max_length=8)


def test_an_empty_completion_is_refused_before_training():
    # TRL appends EOS to text completions, so an empty one comes from tokenized or conversational data.
    tokenized = Dataset.from_dict({"prompt_ids": [[5, 6], [7]], "chosen_ids": [[8, 2], [9, 2]],
                                   "rejected_ids": [[10, 2], []]})
    with pytest.raises(PackingValueError, match="train_dataset row 1 has an empty `rejected_ids`"):
        _check_pairs("train_dataset", tokenized, max_length=32)


def test_a_batch_with_mismatched_prompt_and_completion_is_refused(tmp_path):
    trainer = train(tmp_path, packed=True)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(BATCH)])
    with pytest.raises(PackingValueError, match="as many chosen as rejected"):
        trainer.compute_loss(trainer.model, {**batch, "completion_mask": batch["completion_mask"][:, 1:]})
    trainer.args.max_length = 4
    with pytest.raises(SequenceTooLongError, match="`max_length`=4"):
        trainer.compute_loss(trainer.model, batch)
    trainer.args.max_length = 32
    with pytest.raises(PackingValueError, match="empty completion"):
        trainer.compute_loss(trainer.model, {**batch, "completion_mask": torch.zeros_like(batch["completion_mask"])})
