"""PackedGRPOTrainer against TRL's GRPOTrainer on the same rollouts: equal per-token log-probs, losses and weights."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from llm_packing.trainers.grpo import PackedGRPOTrainer


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("unconfigure_after")]

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
STEPS = 3
GENERATIONS = 4
EOS = 2


def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY["vocab_size"])}, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t2")


def prompts(count=STEPS * 2, seed=0) -> Dataset:
    """Prompts of 1 to 9 tokens: left padding from 0 to 8 tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(1, 10, (1,), generator=generator))
        rows.append(" ".join(f"t{t}" for t in torch.randint(3, TINY["vocab_size"], (length,), generator=generator)))
    return Dataset.from_dict({"prompt": rows})


def completion_length_reward(completions, **kwargs) -> list[float]:
    """Runs offline: longer completions score higher, so the advantages differ within each group."""
    return [float(len(completion.split())) for completion in completions]


class FixedRollouts:
    """Generation replaced by a fixed function of the prompt and the sample's place: both runs see the same rollouts
    (1 to 12 tokens, some ending in EOS, some cut at `max_completion_length`), whatever the weights."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions = []
        for index, prompt in enumerate(prompt_ids):
            generator = torch.Generator().manual_seed(sum(prompt) * 31 + index)
            length = int(torch.randint(1, 13, (1,), generator=generator))
            tokens = torch.randint(3, TINY["vocab_size"], (length,), generator=generator).tolist()
            completions.append(tokens[:-1] + [EOS] if length % 3 else tokens)
        return completions, None

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self.log_probs.append(logps.detach().clone())
        return logps, entropies, aux_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss.item())
        self.completion_masks.append(inputs["completion_mask"])
        self.prompt_masks.append(inputs["prompt_mask"])
        return loss


class FixedGRPOTrainer(FixedRollouts, GRPOTrainer):
    pass


class FixedPackedGRPOTrainer(FixedRollouts, PackedGRPOTrainer):
    pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny model: GRPOTrainer builds its reference model from the policy's path."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(path)
    return str(path)


def train(tmp_path, checkpoint, packed: bool, peft=False, **config):
    settings = {
        "per_device_train_batch_size": 2 * GENERATIONS, "num_generations": GENERATIONS, "max_completion_length": 10,
        "max_steps": STEPS, "learning_rate": 0.5, "optim": "sgd", "lr_scheduler_type": "constant",
        "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True, "bf16": False, "seed": 0,
        "beta": 0.1, "num_iterations": 2, "model_init_kwargs": {"dtype": torch.float32, "attn_implementation": "sdpa"},
        **config,
    }
    args = GRPOConfig(output_dir=str(tmp_path / ("packed" if packed else "padded")), **settings)
    trainer_class = FixedPackedGRPOTrainer if packed else FixedGRPOTrainer
    extra = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])} if peft else {}
    trainer = trainer_class(model=checkpoint, reward_funcs=completion_length_reward, args=args,
                            train_dataset=prompts(), processing_class=tokenizer(), **extra)
    trainer.losses, trainer.completion_masks, trainer.prompt_masks, trainer.log_probs = [], [], [], []
    base = trainer.model.get_base_model() if peft else trainer.model
    assert getattr(base.forward, "_packs_padded_batches", False) == packed
    trainer.train()
    return trainer


def assert_same_run(packed, padded):
    assert len(packed.losses) == len(padded.losses) == STEPS
    torch.testing.assert_close(torch.tensor(packed.losses), torch.tensor(padded.losses), atol=1e-5, rtol=0)
    assert len(packed.log_probs) == len(padded.log_probs) > STEPS  # policy, old policy and reference forwards
    for mine, theirs in zip(packed.log_probs, padded.log_probs, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    for mine, theirs in zip(packed.completion_masks, padded.completion_masks, strict=True):
        assert torch.equal(mine, theirs)  # the same rollouts
    for (name, mine), theirs in zip(packed.model.named_parameters(), padded.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=name)


def test_grpo_with_a_reference_model_equals_trl(tmp_path, checkpoint):
    packed, padded = train(tmp_path, checkpoint, True), train(tmp_path, checkpoint, False)
    assert packed.ref_model is not None
    assert_same_run(packed, padded)
    for masks in (padded.prompt_masks, padded.completion_masks):  # padding on both sides, in some batch
        assert any(mask.sum(dim=1).min() < mask.sum(dim=1).max() for mask in masks)
    initial = AutoModelForCausalLM.from_pretrained(checkpoint)
    moved = max((a - b).abs().max() for a, b in zip(padded.model.parameters(), initial.parameters(), strict=True))
    assert moved > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_grpo_loss_types_equal_trl(tmp_path, checkpoint, loss_type):
    assert_same_run(train(tmp_path, checkpoint, True, loss_type=loss_type),
                    train(tmp_path, checkpoint, False, loss_type=loss_type))


def test_grpo_peft_with_the_disabled_adapter_reference_equals_trl(tmp_path, checkpoint):
    packed, padded = train(tmp_path, checkpoint, True, peft=True), train(tmp_path, checkpoint, False, peft=True)
    assert packed.ref_model is None
    assert_same_run(packed, padded)
