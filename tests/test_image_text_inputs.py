"""The packed image-text batch (`llm_packing.batches.image_text`), and bad image-text input refused before any layer
runs: an image whose placeholders do not match its grid or feature count, media that do not match the placeholders
of the rows, media the hook does not pack (video of an unproven type, an unproven type or backend), inputs an mRoPE
or prefix-LM model needs to tell documents apart."""

import dataclasses

import pytest
import torch
from test_image_text_controls import _hooked_positions
from test_image_text_parity import DOCUMENTS, ROWS, TOLERANCE, alone_logits, differences, make_case, pack
from tiny_image_text import TinyImageText, model_inputs

from llm_packing.batches.image_text import pack_image_text_documents
from llm_packing.errors import ContaminationError, PackingTypeError, PackingValueError, UnsupportedSetupError
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support import image_text as image_text_support


# The packed batch ---------------------------------------------------------------------------------------------------


def test_media_are_concatenated_in_packed_order():
    """Row 0's documents' images, then row 1's: the order in which the model scatters image features."""
    case = make_case("qwen2_5_vl", "sdpa")
    order = [index for row in ROWS for index in row if "pixel_values" in case.documents[index]]
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(case.batch[key], torch.cat([case.documents[i][key] for i in order]))
    assert torch.equal(case.batch["mm_token_type_ids"][0, : case.documents[0]["input_ids"].shape[1]], torch.zeros(
        case.documents[0]["input_ids"].shape[1], dtype=torch.long))


def test_per_call_padding_is_to_the_largest_document():
    """A dimension a processor pads per call (LLaVA-NeXT's patches per image, Pixtral's image sides) is padded to the
    largest among the documents, with 0, or with the family's own value (Gemma 4's patch positions: -1)."""
    documents = [
        {"input_ids": torch.tensor([[5, 6]]), "pixel_values": torch.ones(1, 2, 3),
         "image_position_ids": torch.ones(1, 2, 2)},
        {"input_ids": torch.tensor([[7]]), "pixel_values": torch.ones(2, 4, 3),
         "image_position_ids": torch.ones(2, 4, 2)},
    ]
    batch = pack_image_text_documents(documents, [[0, 1]], 4, model_type="gemma4")
    assert batch["pixel_values"].shape == (3, 4, 3)
    assert batch["pixel_values"][0, 2:].eq(0).all() and batch["pixel_values"][1:].eq(1).all()
    assert batch["image_position_ids"][0, 2:].eq(-1).all() and batch["image_position_ids"][0, :2].eq(1).all()


def test_idefics_images_are_concatenated_along_their_image_axis():
    case = make_case("idefics3", "sdpa")
    with_images = [d for d in case.documents if "pixel_values" in d]
    assert case.batch["pixel_values"].shape[:2] == (1, sum(d["pixel_values"].shape[1] for d in with_images))


def test_labels_keep_each_documents_own_and_drop_first_tokens_and_padding():
    documents = [
        {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[-100, -100, 7, 8]])},
        {"input_ids": torch.tensor([[9, 10, 11]])},
    ]
    batch = pack_image_text_documents(documents, [[0, 1]], 9, model_type="llava")
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, -100, 10, 11, -100, -100]]


def test_mllama_documents_see_only_their_own_image_slots():
    """Per row, the images of its documents are slots one after another; a document's tokens see only its own."""
    case = make_case("mllama", "sdpa")
    sees = case.batch["cross_attention_mask"].amax(-1) > 0  # (batch, length, slots)
    ids = case.batch["attention_mask"]
    for row in range(sees.shape[0]):
        for slot in range(sees.shape[2]):
            owners = ids[row][sees[row, :, slot]].unique()
            assert len(owners) <= 1 and not (owners == 0).any()
    assert case.batch["pixel_values"].shape[:2] == (2, 3)  # row 0: 1 + 2 images, row 1: 2 + 1


@pytest.mark.parametrize(("documents", "rows", "row_length", "error", "match"), [
    ([{"input_ids": torch.ones(1, 5, dtype=torch.long)}], [[0]], 4, PackingValueError, "more than `row_length`=4"),
    ([{"input_ids": torch.ones(1, 2, dtype=torch.long)}], [[0, 1]], 4, PackingValueError, r"indices \[1\] outside"),
    ([{"input_ids": torch.ones(1, 2, dtype=torch.long), "attention_mask": torch.tensor([[1, 0]])}], [[0]], 4,
     PackingValueError, "not all ones"),
    ([{"input_ids": torch.ones(1, 2, dtype=torch.long), "image_sizes": [[56, 56]]}], [[0]], 4, PackingTypeError,
     "'image_sizes'.*list, not a torch.Tensor"),
    ([{"input_ids": torch.ones(2, 2, dtype=torch.long)}], [[0]], 4, PackingValueError, "one document per entry"),
    ([{"input_ids": torch.ones(1, 2, dtype=torch.long), "mm_token_type_ids": torch.zeros(1, 3)}], [[0]], 4,
     PackingValueError, "'mm_token_type_ids'.*not that of its `input_ids`"),
    ([{"input_ids": torch.ones(1, 2, dtype=torch.long)}], [[0]], 4, PackingValueError,
     r"`documents` \[0\] have no `token_type_ids`, which every paligemma document needs"),
], ids=["row too long", "index outside", "padded document", "not a tensor", "batch of documents", "column length",
        "paligemma without token types"])
def test_bad_documents_are_refused(documents, rows, row_length, error, match):
    model_type = "paligemma" if "token_type_ids" in match else "llava"
    with pytest.raises(error, match=match):
        pack_image_text_documents(documents, rows, row_length, model_type=model_type)


# Bad input refused before any layer runs ----------------------------------------------------------------------------


def refused_before_any_layer(case, error, match, **changes):
    """The packed forward with `changes` raises `error` before the vision tower or any text layer runs."""
    reached = []
    towers = [module for name, module in case.model.named_modules() if name.endswith(("visual", "vision_tower",
              "vision_model", "language_model"))]
    handles = [tower.register_forward_pre_hook(lambda *args: reached.append(True)) for tower in towers]
    try:
        with packing_configured(case.model), pytest.raises(error, match=match), torch.no_grad():
            case.model(**case.inputs(**changes), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert towers and not reached


def test_an_image_whose_placeholders_do_not_match_its_grid_is_refused():
    """Documents 1 and 2 trade one image grid each (the total stays right): document 1's image would take tokens of
    document 2, whose first image would start in document 1."""
    case = make_case("qwen2_5_vl", "sdpa")
    grids = case.batch["image_grid_thw"].clone()
    assert not torch.equal(grids[0], grids[1])
    grids[[0, 1]] = grids[[1, 0]]
    refused_before_any_layer(case, PackingValueError, r"Image 0 \(packed order\) has \d+ features.*into the next "
                             "document", image_grid_thw=grids)


def test_media_without_what_the_models_processor_returns_are_refused_naming_the_processor():
    """Pixels without `image_grid_thw` for Qwen2.5-VL: another model's processor (LLaVA's) made the batch, or a part
    of the output was dropped; the error says so, and which processor to collate with."""
    case = make_case("qwen2_5_vl", "sdpa")
    refused_before_any_layer(case, PackingValueError, r"without `image_grid_thw`, which its processor returns with "
                             r"them: the batch was made by another model's processor.*AutoProcessor\.from_pretrained",
                             image_grid_thw=None)


@pytest.mark.parametrize("model_type", ["gemma3", "llava", "idefics3", "mistral3", "paligemma"])
def test_media_that_do_not_match_the_placeholders_are_refused(model_type):
    """A document whose `input_ids` lost image placeholders (truncated after the processor expanded them)."""
    tiny = TinyImageText(model_type, "sdpa")
    documents = [model_inputs(tiny.document(words, sizes, seed=10 + i)) for i, (words, sizes) in enumerate(DOCUMENTS)]
    image_token = tiny.model.config.image_token_id
    placeholders = (documents[2]["input_ids"][0] == image_token).nonzero().flatten()
    keep = torch.ones(documents[2]["input_ids"].shape[1], dtype=torch.bool)
    keep[placeholders[-2:]] = False
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        if key in documents[2]:
            documents[2][key] = documents[2][key][:, keep]
    refused_before_any_layer(pack(tiny, documents), PackingValueError, "features .* but its `input_ids` hold")


def test_placeholders_without_media_are_refused_for_a_type_counted_by_transformers():
    """llava_next's image token counts depend on its processor's arithmetic: the hook checks that media and
    placeholders come together (transformers checks the total after the vision tower)."""
    case = make_case("llava_next", "sdpa")
    refused_before_any_layer(case, PackingValueError, "holds .* image placeholder tokens but no media",
                             pixel_values=None, image_sizes=None)


def test_videos_of_a_type_the_video_matrix_did_not_prove_are_refused():
    case = make_case("glm4v", "sdpa")
    refused_before_any_layer(case, UnsupportedSetupError, "pixel_values_videos.*not in the video parity matrix",
                             pixel_values_videos=torch.zeros(4, 1176), video_grid_thw=torch.tensor([[1, 2, 2]]))


def test_videos_without_their_placeholders_are_refused():
    """Video media in a batch whose `input_ids` hold no video placeholders (tests/test_video_parity.py packs them)."""
    case = make_case("qwen2_5_vl", "sdpa")
    refused_before_any_layer(case, PackingValueError, "videos have 1 features .* hold 0 video placeholder tokens",
                             pixel_values_videos=torch.zeros(4, 1176), video_grid_thw=torch.tensor([[1, 2, 2]]))


def test_images_on_a_backend_the_matrix_did_not_prove_are_refused(monkeypatch):
    entry = image_text_support.PROVEN_IMAGE_TEXT_TYPES["gemma3"]
    monkeypatch.setitem(image_text_support.PROVEN_IMAGE_TEXT_TYPES, "gemma3", dataclasses.replace(entry, backends=(
        "eager",)))
    case = make_case("gemma3", "sdpa")
    refused_before_any_layer(case, UnsupportedSetupError, "'gemma3'.*proved it on eager, not on 'sdpa'")


def test_mrope_images_without_token_types_are_refused():
    case = make_case("qwen3_vl", "sdpa")
    refused_before_any_layer(case, PackingValueError, "needs `mm_token_type_ids`", mm_token_type_ids=None)


def test_mrope_positions_of_three_rows_are_refused():
    """3-D positions without the text row: the hook cannot tell whether they restart per document."""
    case = make_case("qwen2_5_vl", "sdpa")
    positions = case.batch["position_ids"].unsqueeze(0).repeat(3, 1, 1)
    refused_before_any_layer(case, PackingValueError, r"`position_ids` of shape \(3, 2, \d+\)", position_ids=positions)


def test_mrope_positions_that_do_not_restart_per_document_are_refused():
    """The 2-D positions an mRoPE model's pre-hook replaces are checked first, as the mask builder checks them."""
    case = make_case("qwen2_5_vl", "sdpa")
    row_positions = torch.arange(case.batch["input_ids"].shape[1]).expand_as(case.batch["input_ids"])
    refused_before_any_layer(case, ContaminationError, "must restart at 0 for every document",
                             position_ids=row_positions)


def test_paligemma_without_token_type_ids_is_refused():
    case = make_case("paligemma", "sdpa")
    refused_before_any_layer(case, PackingValueError, "without `token_type_ids`", token_type_ids=None)


def test_mllama_cross_attention_over_the_row_is_refused():
    """The processor's own function over the whole packed row lets a document's tokens see the next document's
    image (it marks tokens from an image token on, up to the next one)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    case = make_case("mllama", "sdpa")
    image_token = case.model.config.image_token_id
    sparse = [get_cross_attention_token_mask(row.tolist(), image_token) for row in case.batch["input_ids"]]
    tiles = [[int(t) for t in mask.sum(-1).tolist() if t] for mask in case.batch["aspect_ratio_mask"]]
    over_row = convert_sparse_cross_attention_mask_to_dense(
        sparse, tiles, case.batch["aspect_ratio_mask"].shape[-1], case.batch["input_ids"].shape[1]
    )
    refused_before_any_layer(case, PackingValueError, "several documents .* see the same image slot",
                             cross_attention_mask=torch.from_numpy(over_row))


@pytest.mark.parametrize("mask", ["none", "0/1"])
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_padding_free_mrope_positions_without_their_text_row_are_refused(model_type, mask):
    """Each document's own 3-D positions `(3, batch, length)`, restarting at (0, 0, 0), and no indexed mask: the mask
    builders get no positions from them, so the documents attended to each other (qwen2_5_vl 0.42, qwen3_vl 0.40 off
    alone, with no mask and with a 0/1 one)."""
    case = make_case(model_type, "sdpa")
    positions = _hooked_positions(case)[1:]
    ones = torch.ones_like(case.batch["attention_mask"]) if mask == "0/1" else None
    refused_before_any_layer(case, ContaminationError, r"3-D mRoPE `position_ids` restart at \(0, 0, 0\)",
                             attention_mask=ones, position_ids=positions)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "gemma3", "gemma4", "mllama"])
def test_padding_free_images_transformers_does_not_keep_to_their_documents_are_refused(model_type):
    """A padding-free batch with images (no mask, 2-D positions restarting per document): transformers isolates the
    text attention from the positions, not the images. qwen3_vl puts image tokens at text positions (0.32 off alone),
    Gemma 3 and 4 read their image blocks in document coordinates (0.37, 0.71), Mllama's text before a document's
    first image cross-attends to every image of the row (0.013)."""
    case = make_case(model_type, "sdpa")
    refused_before_any_layer(case, ContaminationError, r"`position_ids` restart .* without an indexed "
                             "`attention_mask`.*transformers does not keep its images", attention_mask=None)


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_padding_free_images_transformers_isolates_are_not_refused(model_type):
    """Image tokens on a llama (no mask, restarting 2-D positions), and mRoPE's `(4, batch, length)` layout (text row
    first, no mask): transformers' own packed path keeps each document to itself."""
    case = make_case(model_type, "sdpa")
    changes = {"attention_mask": None}
    if model_type == "qwen2_5_vl":
        changes["position_ids"] = _hooked_positions(case)
    with packing_configured(case.model), torch.no_grad():
        logits = case.model(**case.inputs(**changes), use_cache=False).logits
    assert max(differences(case, logits, alone_logits(case.model, case.documents))) <= TOLERANCE


# Mask builder calls --------------------------------------------------------------------------------------------------


def test_a_chunked_builder_call_with_mask_functions_is_refused():
    """Chunks count from the document start: row-level mask functions cannot be combined with them."""
    import inspect

    from transformers import AutoConfig, masking_utils

    from llm_packing.hook.attention.mask_functions import build_with_mask_functions

    builder = masking_utils.create_chunked_causal_mask
    config = AutoConfig.for_model("llama4_text")
    mask = torch.tensor([[1, 1, 2, 2]])
    bound = inspect.signature(builder).bind(config, torch.zeros(1, 4, 8), mask, None,
                                            or_mask_function=lambda *indices: True)
    with pytest.raises(UnsupportedSetupError, match="chunked-attention mask builder received mask functions"):
        build_with_mask_functions(builder, bound, mask)


def test_a_mask_the_hook_prepared_passes_through_a_second_builder_call():
    """A wrapper model (PaliGemma) hands the mask the hook built to its text model, whose builder call returns it
    unchanged, on the varlen route too."""
    from transformers import AutoConfig, masking_utils

    from llm_packing.hook.attention.varlen import PackedAttentionMask

    config = AutoConfig.for_model("llama")
    config._attn_implementation = "sdpa"
    prepared = PackedAttentionMask.from_indexed_mask(torch.tensor([[1, 1, 2, 0]]))
    with packing_configured(config):
        assert masking_utils.create_causal_mask(config, torch.zeros(1, 4, 8), prepared, None) is prepared
