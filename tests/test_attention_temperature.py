"""Llama 4's attention temperature per document (`llm_packing.hook.attention.temperature`).

On its layers without rope, Llama 4 scales each query by `1 + attn_scale * log1p(floor((position + 1) /
floor_scale))`, taking the position from the row. The tiny config (`tiny_models.ARCH_OVERRIDES`) has its second layer
without rope and `floor_scale` 4, so that the parity matrix's rows cross it many times (`random_layouts` treats it as
a window); this file adds the control, the compiled model and both sdpa routes on a fixed layout.
"""

import pytest
from test_compile import TOLERANCE as COMPILE_TOLERANCE, compiled_and_eager_differences
from test_parity import _max_differences
from tiny_models import packed_batch, tiny_model

from llm_packing.hook.attention import temperature
from llm_packing.hook.configure import packing_configured


TOLERANCE = 1e-5
LAYOUT = ((20, 8, 12, 1, 7), (17, 16, 15))


def differences(model):
    batch = packed_batch(document_lengths=LAYOUT, row_length=48)
    return _max_differences(model, batch, attention_mask=batch["attention_mask"])


@pytest.mark.parametrize(("backend", "route"), [("sdpa", "varlen"), ("sdpa", "dense"), ("eager", "auto")])
def test_documents_past_the_temperature_step_are_tempered_as_alone(backend, route):
    model = tiny_model("llama4_text", backend)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
    with packing_configured(model, attention_route=route):
        assert max(differences(model)) <= TOLERANCE


def test_without_the_patch_the_row_offset_sets_the_temperature(monkeypatch):
    """Negative control: transformers' attention under the rest of the hook tempers a document by its row offset."""
    monkeypatch.setattr(temperature, "patch_attention_temperature", lambda model_type: None)
    model = tiny_model("llama4_text", "sdpa")
    with packing_configured(model):
        assert differences(model)[0] > 1e-3


def test_compiled_llama4_equals_eager_on_every_new_layout():
    batch_differences, frames = compiled_and_eager_differences("llama4_text", "sdpa", "auto")
    assert all(max(difference) <= COMPILE_TOLERANCE for difference in batch_differences), batch_differences
    assert frames[2:] == [frames[1]] * (len(frames) - 2), frames
