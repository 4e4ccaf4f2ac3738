"""Multimodal checkpoints fine-tuned on text: the wrapper classes run packed text-only batches exactly (the parity
matrix covers their rows; here the inputs a multimodal trainer adds), and a packed batch carrying media is refused
unless its type's images are packed (`tests/test_image_text_parity.py`), whose media must then match the
placeholders."""

import pytest
import torch
from test_parity import TOLERANCE, _max_differences
from tiny_models import packed_batch, tiny_model
from transformers import MllamaTextConfig

from llm_packing.errors import PackingValueError, UnsupportedSetupError
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support.model_types import causal_lm_model_type


IMAGE_TOKEN_ID = 5  # inside the tiny vocabulary, so that a batch can hold it


def test_auto_class_builds_the_wrappers_and_the_text_models():
    """What the parity rows run: `AutoModelForCausalLM` gives the whole wrapper for gemma3/gemma4 and the language
    model, under its text config's own model type, for mllama."""
    assert type(tiny_model("gemma3", "eager")).__name__ == "Gemma3ForConditionalGeneration"
    assert type(tiny_model("gemma4", "eager")).__name__ == "Gemma4ForConditionalGeneration"
    assert type(tiny_model("gemma3n", "eager")).__name__ == "Gemma3nForConditionalGeneration"
    mllama = tiny_model("mllama", "eager")
    assert (type(mllama).__name__, mllama.config.model_type) == ("MllamaForCausalLM", "mllama_text_model")


def test_text_config_of_a_multimodal_model_maps_to_its_causal_lm_type():
    assert causal_lm_model_type(MllamaTextConfig()) == "mllama"
    with packing_configured(MllamaTextConfig()):
        pass


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_text_only_token_type_ids_stay_exact(model_type, backend):
    """Multimodal collators send `token_type_ids` (0 = text) in training; the wrapper then builds its masks through
    its image-block path, which must still isolate the documents."""
    model = tiny_model(model_type, backend).train()
    batch = packed_batch()
    inputs = {"attention_mask": batch["attention_mask"], "token_type_ids": torch.zeros_like(batch["input_ids"])}
    with packing_configured(model):
        differences = _max_differences(model, batch, **inputs)
    assert max(differences) <= TOLERANCE, (model_type, backend, differences)


def _packed_forward(model, batch, **inputs):
    keys = ("input_ids", "attention_mask", "position_ids")
    with torch.no_grad():
        return model(**{key: batch[key] for key in keys}, **inputs, use_cache=False)


def test_packed_batch_with_pixels_but_no_placeholders_is_refused():
    """gemma3's images are packed with their documents (`hook.media.image_text`); pixels whose placeholders the batch
    does not hold are refused before any layer runs."""
    model = tiny_model("gemma3", "eager")
    pixel_values = torch.zeros(1, 3, 8, 8)
    refused = pytest.raises(PackingValueError, match="256 features .* hold 0 image placeholder tokens")
    with packing_configured(model), refused:
        _packed_forward(model, packed_batch(), pixel_values=pixel_values)


@pytest.mark.parametrize("inputs", [
    {"pixel_values": torch.zeros(1, 3, 8, 8)}, {"input_features": torch.zeros(1, 8, 128)},
], ids=["pixel_values", "input_features"])
def test_gemma3n_packed_batch_with_image_or_audio_is_refused(inputs):
    """Gemma 3n takes images and audio: either in a packed batch is refused before its towers run (its vision
    tower here is the tests' stand-in, which fails if reached)."""
    model = tiny_model("gemma3n", "eager")
    refused = pytest.raises(UnsupportedSetupError, match=f"Gemma3nForConditionalGeneration.*{next(iter(inputs))}")
    with packing_configured(model), refused:
        _packed_forward(model, packed_batch(), **inputs)


@pytest.mark.parametrize("mask", ["none", "0/1"])
def test_gemma3n_padding_free_batch_with_an_image_is_refused(mask):
    """The same for a padding-free batch (no indexed mask, `position_ids` restarting within a row): its images are not
    kept to their documents either."""
    model = tiny_model("gemma3n", "eager")
    batch = packed_batch()
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
              "attention_mask": None if mask == "none" else (batch["attention_mask"] > 0).long()}
    refused = pytest.raises(UnsupportedSetupError, match=r"A padding-free batch \(`position_ids` restarting within a "
                            r"row\) reached Gemma3nForConditionalGeneration with media inputs: pixel_values")
    with packing_configured(model), refused, torch.no_grad():
        model(**inputs, pixel_values=torch.zeros(1, 3, 8, 8), use_cache=False)


@pytest.mark.parametrize(("model_type", "error", "match"), [
    ("gemma3n", UnsupportedSetupError, rf"placeholder tokens \[{IMAGE_TOKEN_ID}, "),
    ("gemma3", PackingValueError, "0 features .* hold 1 image placeholder tokens"),
])
def test_packed_batch_with_image_placeholder_tokens_is_refused(model_type, error, match):
    """A placeholder without its image: refused as media of a type whose images are not packed (gemma3n), as an
    image without pixels for one whose are (gemma3)."""
    model = tiny_model(model_type, "eager", image_token_id=IMAGE_TOKEN_ID)
    batch = packed_batch()
    batch["input_ids"][1, 3] = IMAGE_TOKEN_ID
    with packing_configured(model), pytest.raises(error, match=match):
        _packed_forward(model, batch)


def test_guard_leaves_unpacked_batches_and_goes_with_unconfigure():
    """Only packed batches are refused: the same tokens under a 0/1 mask reach the model, and `unconfigure_packing`
    removes the guard."""
    model = tiny_model("gemma3n", "eager", image_token_id=IMAGE_TOKEN_ID)
    batch = packed_batch()
    batch["input_ids"][1, 3] = IMAGE_TOKEN_ID
    with packing_configured(model):
        # the media guard, the documents' scope and the labels guard (`hook.guards`), and the activated-LoRA check
        # (`hook.peft_methods`)
        assert len(model._forward_pre_hooks) == 4
        unpacked = {**batch, "attention_mask": (batch["attention_mask"] > 0).long()}
        unpacked["position_ids"] = (unpacked["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # one sequence a row
        _packed_forward(model, unpacked)
    assert not model._forward_pre_hooks
