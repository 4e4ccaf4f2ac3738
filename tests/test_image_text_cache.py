"""`use_cache` in packed image-text forwards, with the configs as checkpoints ship them: no top-level `use_cache` (or
Idefics3's True) and `text_config.use_cache=True`, which the text model reads when the forward gives it none.

A plain `transformers.Trainer` sets only `model.config.use_cache = False`: its packed training step runs (the hook
passes that on to the text model) and every document's logits equal the document alone. Where a cache would still be
built, the forward is refused with the fix for that model, and the fix it names makes the forward run, exact.
"""

import tempfile

import pytest
import torch
import transformers
from test_image_text_parity import TOLERANCE, alone_logits, differences, make_case

from llm_packing.errors import ContaminationError
from llm_packing.hook.configure import packing_configured


def as_checkpoint(case):
    """`case.model` with the `use_cache` settings of its config class's defaults, as checkpoints have them (the tiny
    configs turn every one off)."""
    config, defaults = case.model.config, type(case.model.config)()
    if hasattr(defaults, "use_cache"):
        config.use_cache = defaults.use_cache
    elif "use_cache" in config.__dict__:
        del config.use_cache
    config.get_text_config().use_cache = defaults.get_text_config().use_cache
    assert config.get_text_config().use_cache is True
    return case


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_a_plain_trainer_step_runs_exact(model_type):
    """One `transformers.Trainer` training step on a packed batch with images: the logits of the step's forward equal
    each document's alone, and the step updates the model."""
    case = as_checkpoint(make_case(model_type, "sdpa"))
    references = alone_logits(case.model, case.documents)
    arguments = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, max_steps=1, per_device_train_batch_size=1, report_to="none",
        remove_unused_columns=False, save_strategy="no", learning_rate=1e-3,
    )
    seen = []
    handle = case.model.register_forward_hook(lambda module, args, output: seen.append(output.logits.detach()))
    before = [p.detach().clone() for p in case.model.parameters()]
    try:
        with packing_configured(case.model):
            trainer = transformers.Trainer(model=case.model, args=arguments, train_dataset=[case.batch],
                                           data_collator=lambda features: features[0])
            assert getattr(case.model.config, "use_cache", None) is False  # what Trainer sets
            trainer.train()
    finally:
        handle.remove()
    assert trainer.state.global_step == 1 and len(seen) == 1
    worst = max(differences(case, seen[0], references))
    assert worst <= TOLERANCE, (model_type, worst)
    assert any(not torch.equal(a, b) for a, b in zip(before, case.model.parameters(), strict=True))


def _fix_text_config(model):
    model.config.text_config.use_cache = False


def _fix_top_level(model):
    model.config.use_cache = False


@pytest.mark.parametrize(("model_type", "use_cache", "names", "fix"), [
    # LLaVA and Qwen2.5-VL give their text model no `use_cache`: it reads its own config.
    ("llava", None, r"gives its text model no `use_cache`, so the text model reads its own "
                    r"`model.config.text_config.use_cache`=True \(model_type 'llama'\): set `model.config.use_cache = "
                    r"False` .*`model.config.text_config.use_cache = False`", _fix_text_config),
    ("qwen2_5_vl", None, r"model.config.text_config.use_cache`=True \(model_type 'qwen2_5_vl_text'\)", _fix_top_level),
    # Idefics3's config has `use_cache=True` at the top, and the model passes it to its text model.
    ("idefics3", None, r"`model.config.use_cache` is True \(model_type 'idefics3'\): set `model.config.use_cache = "
                       r"False`", _fix_top_level),
    ("llava", True, r"The forward was given `use_cache=True`: pass `use_cache=False`", None),
], ids=["llava", "qwen2_5_vl", "idefics3", "llava-given"])
def test_a_refused_cache_names_the_fix_that_works(model_type, use_cache, names, fix):
    case = as_checkpoint(make_case(model_type, "sdpa"))
    inputs = case.inputs() if use_cache is None else case.inputs(use_cache=use_cache)
    with packing_configured(case.model), torch.no_grad():
        with pytest.raises(ContaminationError, match=r"KV cache \(`use_cache=True`.*the cache would mix the documents"
                                                     r"\. .*" + names):
            case.model(**inputs)
        if fix is None:
            inputs["use_cache"] = False
        else:
            fix(case.model)
        logits = case.model(**inputs).logits
    assert max(differences(case, logits, alone_logits(case.model, case.documents))) <= TOLERANCE
