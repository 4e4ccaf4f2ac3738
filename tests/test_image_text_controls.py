"""Negative controls of the image-text parity matrix: each mechanism the hook adds for images is needed. Without it
packed documents leak into each other, or are mis-positioned: transformers' own packed path, mRoPE positions over the
whole row or 2-D text positions on image tokens, Gemma 3's image blocks not split per document, mask functions fed
document coordinates (the hook before this fix), Mllama's cross-attention without its document bound.
"""

import pytest
import torch
from test_image_text_parity import TOLERANCE, Case, alone_logits, differences, make_case, pack, packed_logits
from tiny_image_text import TinyImageText, model_inputs

from llm_packing.hook.attention import mask_functions
from llm_packing.hook.media import cross_attention


@pytest.mark.parametrize(("model_type", "leak"), [
    ("qwen2_5_vl", 0.1), ("qwen3_vl", 0.1), ("glm4v", 0.1), ("gemma3", 0.1), ("gemma4", 0.1), ("mllama", 0.01),
])
def test_transformers_own_packed_path_leaks(model_type, leak):
    """transformers' own packed path (per-document 2-D `position_ids`, no mask, no hook) on mRoPE models, image
    blocks and cross-attention: documents see each other's images or positions."""
    case = make_case(model_type, "sdpa")
    with torch.no_grad():
        logits = case.model(**case.inputs(attention_mask=None), use_cache=False).logits
    measured = max(differences(case, logits, alone_logits(case.model, case.documents)))
    print(f"control transformers' packed path {model_type}: {measured:.2e}")
    assert measured > leak


def test_transformers_own_packed_path_on_image_tokens_leaks_with_a_cache():
    """llava (image tokens in a llama): transformers' packed path isolates its text without a cache, and leaks with
    one (`use_cache=True`, the checkpoints' default outside Trainer)."""
    case = make_case("llava", "sdpa")
    references = alone_logits(case.model, case.documents)
    with torch.no_grad():
        without = case.model(**case.inputs(attention_mask=None), use_cache=False).logits
        with_cache = case.model(**case.inputs(attention_mask=None), use_cache=True).logits
    measured = max(differences(case, without, references)), max(differences(case, with_cache, references))
    print(f"control transformers' packed path llava without / with a cache: {measured[0]:.2e} / {measured[1]:.2e}")
    assert measured[0] <= TOLERANCE and measured[1] > 0.1


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v"])
def test_text_positions_on_image_tokens_mis_position(model_type):
    """Per-document 2-D positions on every row of mRoPE (image tokens at text positions, the layout given as
    `(4, batch, length)` so the hook's pre-hook passes it through): the images' tokens are mis-positioned."""
    measured = text_positions_difference(make_case(model_type, "sdpa"))
    print(f"control text positions on image tokens {model_type}: {measured:.2e}")
    assert measured > 1e-3


def text_positions_difference(case: Case) -> float:
    """The largest difference from the documents alone when every mRoPE row of `case` gets the per-document 2-D
    positions, given as `(4, batch, length)` so that the hook passes them through."""
    flat = case.batch["position_ids"]
    logits = packed_logits(case, position_ids=flat.unsqueeze(0).repeat(4, 1, 1))
    return max(differences(case, logits, alone_logits(case.model, case.documents)))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_over_the_whole_row_mis_positions(model_type):
    """The model's own `get_rope_index` over the packed row numbers documents one after another: every document after
    the first of a row is shifted by the positions before it. RoPE's relative form hides a constant shift in exact
    arithmetic, so the logits here move only by rounding (the per-document positions are what each document has alone);
    in float32 the drift grows with the shift (qwen3_vl: 2.2e-05 at 16,000)."""
    case = make_case(model_type, "sdpa")
    rope = case.model.model
    mask = case.batch["attention_mask"]
    whole_row, _ = rope.get_rope_index(
        case.batch["input_ids"], mm_token_type_ids=case.batch["mm_token_type_ids"],
        image_grid_thw=case.batch["image_grid_thw"], attention_mask=(mask > 0).long(),
    )
    per_document = _hooked_positions(case)
    shifts = [int((whole_row[:, row, start : start + length] - per_document[1:, row, start : start + length]).min())
              for row, start, length, _ in case.spans]
    firsts = [start == 0 for _, start, _, _ in case.spans]
    assert all(shift == 0 for shift, first in zip(shifts, firsts, strict=True) if first)
    assert all(shift > 0 for shift, first in zip(shifts, firsts, strict=True) if not first), shifts
    drift = max(differences(case, packed_logits(case, position_ids=torch.cat([per_document[:1], whole_row])),
                            alone_logits(case.model, case.documents)))
    print(f"control mRoPE over the whole row {model_type}: shifts {shifts}, logits {drift:.2e}")
    assert drift < 1e-4, drift  # the mis-position is invisible here: a test of logits alone would not catch it


def _hooked_positions(case: Case) -> torch.Tensor:
    """The `(4, batch, length)` positions the hook's pre-hook hands the model for the packed batch."""
    seen = {}
    base = case.model.model
    handle = base.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(positions=kwargs["position_ids"]), with_kwargs=True
    )
    try:
        packed_logits(case)
    finally:
        handle.remove()
    return seen["positions"]


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4"])
def test_mask_functions_in_document_coordinates_leak(model_type, monkeypatch):
    """The hook's packed route for builder calls with mask functions before this fix (per-document positions, from
    which transformers remaps the row-level image blocks to document coordinates)."""
    case = make_case(model_type, "sdpa")
    monkeypatch.setattr(mask_functions, "carries_mask_functions", lambda arguments: False)
    logits = packed_logits(case, route="dense")
    measured = max(differences(case, logits, alone_logits(case.model, case.documents)))
    print(f"control mask functions in document coordinates {model_type}: {measured:.2e}")
    assert measured > 0.1


def touching_images(tiny: TinyImageText) -> Case:
    """Gemma 3 documents whose images touch across the boundary: the first ends with its image's soft tokens, the
    second starts with its image's; a third text document and padding follow."""
    soft = tiny.model.config.image_token_id
    first = model_inputs(tiny.document(6, ((56, 84),), seed=3))
    second = model_inputs(tiny.document(6, ((84, 56),), seed=4))
    last_soft = int((first["input_ids"][0] == soft).nonzero().max())
    first_soft = int((second["input_ids"][0] == soft).nonzero().min())
    columns = ("input_ids", "attention_mask", "token_type_ids")
    first.update({key: first[key][:, : last_soft + 1] for key in columns})
    second.update({key: second[key][:, first_soft:] for key in columns})
    return pack(tiny, [first, second, model_inputs(tiny.document(5, (), seed=5))], rows=((0, 1, 2),))


def _masks_seen(case: Case, **changes) -> tuple[torch.Tensor, dict]:
    """The packed logits (dense route) and the masks Gemma 3's text model received, by layer type."""
    seen = {}
    handle = case.model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs["attention_mask"]), with_kwargs=True
    )
    try:
        logits = packed_logits(case, route="dense", **changes)
    finally:
        handle.remove()
    return logits, seen


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Which query-key pairs a `(batch, 1, q, kv)` mask lets attend: sdpa's is bool, eager's additive (0 attends)."""
    return mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0


def _cross_document_pairs(mask: torch.Tensor, ids: torch.Tensor) -> int:
    """Query-key pairs of different documents (padding aside) that the mask lets attend."""
    real = ids > 0
    other = (ids[:, :, None] != ids[:, None, :]) & real[:, :, None] & real[:, None, :]
    return int((_visible(mask) & other).sum())


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_image_blocks_touching_across_documents_stay_apart(backend, monkeypatch):
    """transformers numbers runs of image tokens along the row, so two images touching across a document boundary are
    one block: with block ids not made unique per document, the second document's image tokens see the first's (32
    query-key pairs, 0.27). With them, no pair crosses and each image still attends both ways."""
    case = touching_images(TinyImageText("gemma3", backend))
    references = alone_logits(case.model, case.documents)
    ids = case.batch["attention_mask"]
    logits, masks = _masks_seen(case)
    assert max(differences(case, logits, references)) <= TOLERANCE
    assert {kind: _cross_document_pairs(mask, ids) for kind, mask in masks.items()} == dict.fromkeys(masks, 0)
    image = (case.batch["token_type_ids"][0] == 1) & (ids[0] == 1)
    first, last = int(image.nonzero().min()), int(image.nonzero().max())
    assert bool(_visible(masks["full_attention"])[0, first, last])  # bidirectional within the image

    monkeypatch.setattr(mask_functions, "document_block_ids", lambda block_ids, document_ids: block_ids)
    logits, masks = _masks_seen(case)
    measured = max(differences(case, logits, references)), _cross_document_pairs(masks["full_attention"], ids)
    print(f"control block ids not split {backend}: {measured[0]:.2e}, {measured[1]} cross-document pairs")
    assert measured[0] > 0.1 and measured[1] > 0


def test_cross_attention_without_its_document_bound_leaks(monkeypatch):
    """Mllama with only the packed batch's document-bounded `cross_attention_mask` (the hook's cross-attention bound
    left out): text before a document's first image, and documents without images, read other documents' images."""
    case = make_case("mllama", "sdpa")
    monkeypatch.setattr(cross_attention, "install", lambda base_model: None)
    measured = max(differences(case, packed_logits(case), alone_logits(case.model, case.documents)))
    print(f"control mllama without its cross-attention bound: {measured:.2e}")
    assert measured > 1e-2
