"""`verify_packing(model, processor=...)` with images: a document with two images of different shapes, made by the
model's own processor, packed between two text documents, passes on every proven type, and catches each image
mechanism of the hook when it is broken."""

import pytest
import torch
from tiny_image_text import SPECS, TinyImageText

from llm_packing.errors import ContaminationError, PackingTypeError
from llm_packing.hook.attention import mask_functions
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.masks import document_position_ids
from llm_packing.hook.media import cross_attention, image_text
from llm_packing.hook.verify import verify_packing


CORE = ("qwen2_5_vl", "gemma3", "llava", "mllama")


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=() if t in CORE else pytest.mark.slow) for t in SPECS])
def test_verify_packing_with_images_passes(model_type):
    tiny = TinyImageText(model_type, "sdpa")
    with packing_configured(tiny.model):
        assert verify_packing(tiny.model, processor=tiny.processor) <= 1e-5


def _text_positions_on_images(rope, input_ids, attention_mask, documents, mm_token_type_ids=None, **grids):
    return document_position_ids(attention_mask).unsqueeze(0).repeat(4, 1, 1)


@pytest.mark.parametrize(("model_type", "broken"), [
    ("qwen2_5_vl", (image_text, "packed_mrope_position_ids", _text_positions_on_images)),
    ("gemma3", (mask_functions, "carries_mask_functions", lambda arguments: False)),
    ("mllama", (cross_attention, "install", lambda base_model: None)),
], ids=["mrope positions", "image blocks", "cross-attention"])
def test_verify_packing_with_images_catches_a_broken_mechanism(model_type, broken, monkeypatch):
    """Text-only documents cannot show these: the text check passes, the row with images fails."""
    tiny = TinyImageText(model_type, "sdpa")
    monkeypatch.setattr(*broken)
    with packing_configured(tiny.model):
        verify_packing(tiny.model)
        with pytest.raises(ContaminationError, match=model_type):
            verify_packing(tiny.model, processor=tiny.processor)


def test_verify_packing_needs_the_models_own_processor():
    tiny = TinyImageText("llava", "sdpa")
    with packing_configured(tiny.model), pytest.raises(PackingTypeError, match="no `image_token`"):
        verify_packing(tiny.model, processor=tiny.tokenizer.backend_tokenizer)


def test_text_documents_of_verify_hold_no_placeholder():
    """The random text documents skip every token id the config names: a placeholder there would be an image
    without pixels, refused by the hook."""
    from llm_packing.hook.verify import _random_documents

    config = TinyImageText("llava", "sdpa").model.config
    documents = torch.cat(_random_documents(config, (500,), 0, "cpu"))
    assert not (documents == config.image_token_id).any()


def test_configure_and_verify_checks_images_with_the_processor(caplog, unconfigure_after):
    """The trainers' one configure-verify-log step takes the processor through to `verify_packing`."""
    import logging

    from llm_packing.hook.verify import configure_and_verify

    tiny = TinyImageText("gemma3", "sdpa")
    with caplog.at_level(logging.INFO, logger="llm_packing.hook.verify"):
        assert configure_and_verify(tiny.model, processor=tiny.processor) <= 1e-5
    assert "isolation verified (documents with images included)" in caplog.text
