"""Image-text packing on FlashAttention, through transformers' own FlashAttention code with the reference kernels of
tests/test_flash_path.py (its `flash_model` fixture: the flash_attn API in plain torch for FA2/FA3, FA4's
`flash_attn.cute` stand-in that transformers imports itself), as the text table's FlashAttention columns are proven.

The mRoPE families (Qwen2/2.5/3-VL, Qwen3.5, GLM-4V) and the image-token families (LLaVA, Idefics3, InternVL, ...)
need only per-document segments and per-document positions: the text layers' varlen calls get one segment per
document, and every document of the parity matrix's rows (0, 1 and 2 real photos, trailing padding) equals itself
alone on the same FlashAttention path within 1e-5 (float32). That path alone equals sdpa (the reference kernel leaves
nothing out of these models). The vision towers run on the same kernels. Where transformers offers no FlashAttention
for a type (Gemma 3, Gemma 4, PaliGemma and Mllama: their wrappers build 4-D masks), the test checks that it refuses,
and that the hook refuses their packed batches with images on a config naming FlashAttention, with the reason:
bidirectional image blocks and per-document cross-attention cannot be expressed in varlen segments.
Controls: without the hook the packed batch leaks; mRoPE images at text positions are mis-positioned.

FA2 runs every type; FA3 and FA4 take FA2's path with another kernel (tests/test_flash_path.py asserts it) and run a
sample: the support table marks their other cells as inferred.
"""

import re

import pytest
import test_flash_path
import torch
from test_flash_path import kernel_calls
from test_image_text_parity import TOLERANCE, alone_logits, differences, make_case, packed_logits
from tiny_image_text import SPECS, TinyImageText

from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook.support import architectures, matrix as support_matrix
from llm_packing.hook.support.image_text import (
    FLASH_BACKENDS,
    FLASH_REFUSED_FAMILIES,
    FLASH_RUN_WITH_IMAGES,
    MROPE,
    PROVEN_IMAGE_TEXT_TYPES,
)


flash_model = test_flash_path.flash_model
CORE = ("qwen2_5_vl", "qwen3_5", "llava", "idefics3", "gemma3", "mllama")
MATRIX = [
    pytest.param(t, backend, marks=() if t in CORE and backend == "flash_attention_2" else pytest.mark.slow)
    for t in SPECS for backend in FLASH_BACKENDS if backend == "flash_attention_2" or t in FLASH_RUN_WITH_IMAGES
]


@pytest.mark.parametrize(("model_type", "backend"), MATRIX)
def test_packed_rows_on_flash_attention_equal_documents_alone(flash_model, model_type, backend):
    support = PROVEN_IMAGE_TEXT_TYPES[model_type]
    if support.family in FLASH_REFUSED_FAMILIES:
        _assert_refused(model_type, backend, FLASH_REFUSED_FAMILIES[support.family])
        return
    assert backend in support.backends and support_matrix._image_text_cell(model_type, backend) == "exact"
    case = make_case(model_type, backend)
    references = alone_logits(case.model, case.documents)
    sdpa = alone_logits(TinyImageText(model_type, "sdpa").model, case.documents)
    faithful = max(float((a - b).abs().max()) for a, b in zip(references, sdpa, strict=True))
    assert faithful <= TOLERANCE, (model_type, "the reference kernel alone differs from sdpa", faithful)
    calls, _ = kernel_calls(case.model)
    calls.clear()
    logits = packed_logits(case)
    per_document = [0]
    for _, _, length, _ in case.spans:
        per_document.append(per_document[-1] + length)
    assert per_document in calls, (model_type, calls)
    worst = max(differences(case, logits, references))
    print(f"flash parity {model_type} {backend}: {worst:.2e}")
    assert worst <= TOLERANCE, (model_type, backend, worst)


def _assert_refused(model_type, backend, reason):
    """transformers offers no FlashAttention for the type (its wrapper builds 4-D masks), and a packed batch with
    images whose config names FlashAttention (as a transformers that offered it would) is refused with `reason`,
    before any layer runs."""
    with pytest.raises(ValueError, match="does not support Flash Attention"):
        TinyImageText(model_type, backend)
    case = make_case(model_type, "sdpa")
    case.model.config._attn_implementation = backend
    expected = rf"model_type '{model_type}'.*not on '{backend}': {re.escape(reason)}"
    with pytest.raises(UnsupportedSetupError, match=expected):
        packed_logits(case)
    assert backend not in PROVEN_IMAGE_TEXT_TYPES[model_type].backends
    assert support_matrix._image_text_cell(model_type, backend).startswith("refused: ")


def test_every_exact_flash_cell_is_a_run_of_the_matrix():
    runs = {tuple(param.values) for param in MATRIX}
    for model_type in PROVEN_IMAGE_TEXT_TYPES:
        for backend in FLASH_BACKENDS:
            if support_matrix._image_text_cell(model_type, backend) == "exact":
                assert (model_type, backend) in runs, (model_type, backend)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava"])
def test_flash_attention_without_the_hook_leaks(flash_model, model_type):
    """transformers alone casts the indexed mask to bool: one segment per row, documents attend to each other."""
    case = make_case(model_type, "flash_attention_2")
    references = alone_logits(case.model, case.documents)
    with torch.no_grad():
        logits = case.model(**case.inputs(), use_cache=False).logits
    measured = max(differences(case, logits, references))
    print(f"control flash without the hook {model_type}: {measured:.2e}")
    assert measured > 1e-3


def test_text_positions_on_image_tokens_mis_position_on_flash_attention(flash_model):
    """Per-document segments are not enough for mRoPE: 2-D text positions on every row mis-position the images."""
    case = make_case("qwen2_5_vl", "flash_attention_2")
    assert PROVEN_IMAGE_TEXT_TYPES["qwen2_5_vl"].family == MROPE
    flat = case.batch["position_ids"]
    logits = packed_logits(case, position_ids=flat.unsqueeze(0).repeat(4, 1, 1))
    measured = max(differences(case, logits, alone_logits(case.model, case.documents)))
    print(f"control flash text positions on image tokens: {measured:.2e}")
    assert measured > 1e-3


def test_one_list_of_flash_backends():
    assert FLASH_BACKENDS == architectures.FLASH_BACKENDS
