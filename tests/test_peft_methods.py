"""PEFT methods that read a packed row as one sequence are refused (`llm_packing.hook.peft_methods`): prompt learning
and activated LoRA at `configure_packing` or at the packed forward, per-row adapters in a hybrid's mixers. LoRA itself
packs exactly (tests/test_mixers.py, tests/test_dpo.py, tests/test_sft_trainer.py)."""

import pytest
import torch
from peft import LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model
from test_parity import TOLERANCE, _max_differences
from tiny_models import packed_batch, tiny_model

from llm_packing import PackingTypeError, is_packing_configured
from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook.configure import configure_packing, packing_configured, unconfigure_packing


PROMPT_LEARNING = {
    "prompt tuning": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    "p-tuning": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16),
    "prefix tuning": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
}
INVOCATION = [7, 8]


def _activated_lora(model):
    config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"],
                        alora_invocation_tokens=INVOCATION, init_lora_weights=False)
    return get_peft_model(model, config)


def _invoked_batch():
    """A packed batch whose every document holds the invocation sequence."""
    batch = packed_batch()
    for row, start in zip(*torch.nonzero(torch.diff(batch["attention_mask"], prepend=torch.zeros(2, 1)) > 0,
                                          as_tuple=True), strict=True):
        batch["input_ids"][row, start:start + 2] = torch.tensor(INVOCATION)
    return batch


@pytest.fixture(autouse=True)
def _unconfigured():
    yield
    unconfigure_packing()


@pytest.mark.parametrize("method", PROMPT_LEARNING, ids=list(PROMPT_LEARNING))
def test_prompt_learning_is_refused_at_configure_with_nothing_patched(method):
    model = get_peft_model(tiny_model("llama"), PROMPT_LEARNING[method])
    with pytest.raises(UnsupportedSetupError, match="prompt learning.*only the row's first document"):
        configure_packing(model)
    assert not is_packing_configured()


def test_prompt_tuning_added_after_configuring_is_refused_at_the_forward():
    """PEFT adds its virtual tokens to the mask as float ones, which cannot carry document ids: the builders' refusal
    names prompt learning."""
    model = tiny_model("llama")
    configure_packing(model)
    wrapped = get_peft_model(model, PROMPT_LEARNING["prompt tuning"])
    batch = packed_batch()
    with pytest.raises(PackingTypeError, match="prompt tuning, p-tuning and prefix tuning"):
        wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_activated_lora_is_refused_at_configure():
    with pytest.raises(UnsupportedSetupError, match=r"activated LoRA \(`alora_invocation_tokens`=\[7, 8\]\)"):
        configure_packing(_activated_lora(tiny_model("llama")))
    assert not is_packing_configured()


def test_activated_lora_added_after_configuring_is_refused_at_a_packed_forward():
    """The silent case: PEFT switched the adapter on from the last invocation of the row, so a packed document was
    0.67 off alone and `verify_packing` passed. Unpacked batches still run; without the hook the packed one runs too
    (the control)."""
    model = tiny_model("llama")
    configure_packing(model)
    wrapped = _activated_lora(model)
    batch = _invoked_batch()
    arguments = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    with torch.no_grad():
        with pytest.raises(UnsupportedSetupError, match="activated LoRA"):
            wrapped(**arguments, attention_mask=batch["attention_mask"])
        wrapped(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False)
        unconfigure_packing()
        wrapped(**arguments, attention_mask=batch["attention_mask"])


def _two_adapters(model_type):
    model = get_peft_model(tiny_model(model_type, "sdpa"), LoraConfig(r=4, target_modules=["in_proj", "out_proj"],
                                                                        init_lora_weights=False))
    model.add_adapter("second", LoraConfig(r=4, target_modules=["in_proj", "out_proj"], init_lora_weights=False))
    return model.eval()


def test_per_row_adapters_are_refused_where_mixers_run_per_document():
    """`adapter_names` gives each row its adapter; lfm2's short convolutions run on batches of documents instead, so
    their LoRA layers took other rows' adapters (0.94 off, silently). A call with one adapter set packs exactly."""
    model = _two_adapters("lfm2")
    batch = packed_batch()
    with packing_configured(model), torch.no_grad():
        with pytest.raises(UnsupportedSetupError, match="per-row adapters"):
            model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}, use_cache=False,
                  adapter_names=["default", "second"])
    model = _two_adapters("lfm2")  # PEFT leaves its per-row hooks registered when the forward raises
    model.set_adapter("second")
    with packing_configured(model), torch.no_grad():
        assert _max_differences(model, batch, attention_mask=batch["attention_mask"])[0] <= TOLERANCE


def test_packed_sft_trainer_refuses_a_prompt_learning_peft_config(tmp_path):
    """`PackedSFTTrainer(peft_config=...)` configures the model PEFT wrapped: refused when built, with the fix."""
    from test_sft_trainer import MAX_LENGTH, documents, tokenizer
    from trl import SFTConfig

    from llm_packing import PackedSFTTrainer, pack_dataset

    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(UnsupportedSetupError, match="use LoRA"):
        PackedSFTTrainer(model=tiny_model("llama"), args=args, train_dataset=pack_dataset(documents(), MAX_LENGTH),
                         processing_class=tokenizer(), peft_config=PROMPT_LEARNING["prompt tuning"])


def _lora_variants():
    from peft import AdaptionPromptConfig, BOFTConfig, IA3Config, LoHaConfig, LoKrConfig, OFTConfig, VeraConfig

    projections = ["q_proj", "v_proj", "gate_proj"]
    return {
        "lora": LoraConfig(r=4, target_modules=projections, init_lora_weights=False),
        "dora": LoraConfig(r=4, target_modules=projections, use_dora=True, init_lora_weights=False),
        "rslora on embeddings and head": LoraConfig(r=4, target_modules=["embed_tokens", "lm_head", "q_proj"],
                                                    use_rslora=True, init_lora_weights=False),
        "modules_to_save": LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "ia3": IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"],
                         init_ia3_weights=False),
        "loha": LoHaConfig(r=4, target_modules=projections, init_weights=False),
        "lokr": LoKrConfig(r=4, target_modules=projections, init_weights=False),
        "vera": VeraConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False),
        "oft": OFTConfig(r=4, oft_block_size=0, target_modules=["q_proj"], init_weights=False),
        "boft": BOFTConfig(boft_block_size=4, target_modules=["q_proj"], init_weights=False),
        "adaption prompt": AdaptionPromptConfig(adapter_len=3, adapter_layers=2, task_type="CAUSAL_LM"),
    }


@pytest.mark.parametrize("variant", list(_lora_variants()))
def test_token_wise_peft_methods_pack_exactly(variant):
    """LoRA and the methods that act on each token alone: packed logits and per-token losses, and the gradients of
    every trainable parameter, equal each document alone (gradients within 1e-5 of their largest entry)."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama", "sdpa"), _lora_variants()[variant])
    batch = packed_batch()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    with packing_configured(model):
        logit_difference, loss_difference = _max_differences(model, batch, attention_mask=batch["attention_mask"])
        packed = _gradients(model, trainable, batch)
        alone = _gradients(model, trainable, batch, alone=True)
    assert logit_difference <= TOLERANCE and loss_difference <= TOLERANCE, (logit_difference, loss_difference)
    scale = max(float(gradient.abs().max()) for gradient in alone)
    assert scale > 0
    assert max(float((a - b).abs().max()) for a, b in zip(packed, alone, strict=True)) <= TOLERANCE * max(scale, 1)


def _gradients(model, trainable, batch, alone=False) -> list[torch.Tensor]:
    """Gradients of the summed token losses of the batch, packed or with each document run alone."""
    model.zero_grad(set_to_none=True)
    model.train()
    if not alone:
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        _summed_loss(logits, batch["labels"]).backward()
    else:  # one document a row, numbered from 0, as the collator sends it
        for row, spans in enumerate(batch["documents"]):
            for start, length in spans:
                logits = model(input_ids=batch["input_ids"][row:row + 1, start:start + length],
                               position_ids=torch.arange(length)[None]).logits
                _summed_loss(logits, batch["labels"][row:row + 1, start:start + length]).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in trainable]


def _summed_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")


def test_modules_to_save_on_a_hybrids_mixer_packs_exactly():
    """`modules_to_save=["conv"]` on lfm2 wraps its short-convolution mixer and, beside it, the mixer's inner Conv1d
    (which nothing calls): the coverage check took that second wrapper for an unhandled mixer and refused the model."""
    model = get_peft_model(tiny_model("lfm2", "sdpa"), LoraConfig(r=4, target_modules=["q_proj"],
                                                                   modules_to_save=["conv"]))
    batch = packed_batch()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    with packing_configured(model):
        assert max(_max_differences(model, batch, attention_mask=batch["attention_mask"])) <= TOLERANCE
        packed, alone = _gradients(model, trainable, batch), _gradients(model, trainable, batch, alone=True)
    assert max(float((a - b).abs().max()) for a, b in zip(packed, alone, strict=True)) <= TOLERANCE


def test_a_lora_forward_keeps_one_host_copy(monkeypatch):
    """The activated-LoRA check runs on every forward of a PEFT model; it reads the mask only for an activated LoRA,
    so a LoRA model's packed forward still makes one device-to-host copy of the mask and positions."""
    from llm_packing.hook import documents

    copies = []
    monkeypatch.setattr(documents, "_to_host", lambda tensor, _f=documents._to_host: copies.append(1) or _f(tensor))
    model = get_peft_model(tiny_model("llama", "sdpa"), LoraConfig(r=4, target_modules=["q_proj"]))
    batch = packed_batch()
    with packing_configured(model), torch.no_grad():
        model(**{key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")})
    assert len(copies) == 1
