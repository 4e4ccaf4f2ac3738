"""The image-text parity matrix: packed rows of image-text documents give, for every document, exactly the logits it
gives alone (max abs difference <= 1e-5, float32), for every proven type and backend.

Backends: eager, sdpa on its varlen route (`auto`) and its dense route, and flex_attention wherever transformers
offers it (elsewhere the test checks that transformers refuses it). The fixed layout (`DOCUMENTS`, `ROWS`): two rows
of three documents with 0, 1 and 2 images of different sizes (real photos, matplotlib's sample data), and trailing
padding in both rows. The reference runs each document alone through the model's normal path (its processor output,
a mask of ones; the model computes its own positions). Randomized layouts (seed printed) add rows of 1 to 5
documents, one-word documents, rows without padding. Image sensitivity: replacing one document's pixels by noise
moves that document's logits and no other's, so the matrix cannot pass with images that do not matter. The negative
controls are in tests/test_image_text_controls.py.

`CORE` (sdpa, both routes) runs in every CI pass; the rest is marked `slow`.
"""

import dataclasses
import random

import pytest
import torch
from call_counting import count_calls
from flex_modes import compiled_flex, traced_flex, untraced_flex
from tiny_image_text import SPECS, TinyImageText, model_inputs
from transformers import masking_utils

from llm_packing.batches.image_text import pack_image_text_documents
from llm_packing.hook.attention import varlen
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support.image_text import IMAGE_BLOCKS, PROVEN_IMAGE_TEXT_TYPES


TOLERANCE = 1e-5
SENSITIVITY = 1e-3  # a document's logits must move by more than this when its pixels become noise
# (words, image sizes (width, height)) per document; rows of document indices; padding after the longest row.
DOCUMENTS = (
    (7, ()),
    (6, ((56, 84),)),
    (9, ((112, 56), (56, 56))),
    (5, ((84, 84), (56, 112))),
    (3, ()),
    (6, ((168, 56),)),
)
ROWS = ((0, 1, 2), (3, 4, 5))
PADDING = 3
CORE = ("qwen2_5_vl", "qwen3_5", "gemma3", "llava", "idefics3", "mllama")
BACKENDS = (("eager", "auto"), ("sdpa", "auto"), ("sdpa", "dense"), ("flex_attention", "auto"))
MATRIX = [
    pytest.param(t, backend, route, marks=() if t in CORE and backend == "sdpa" else pytest.mark.slow)
    for t in SPECS for backend, route in BACKENDS
]


def _marked(types):
    return [pytest.param(t, marks=() if t in CORE else pytest.mark.slow) for t in types]


@dataclasses.dataclass
class Case:
    """A tiny model, processed documents, their packed batch and where each document sits in it."""

    tiny: TinyImageText
    documents: list[dict]
    batch: dict
    spans: list[tuple[int, int, int, int]]  # (row, start, length, document index)

    @property
    def model(self):
        return self.tiny.model

    def inputs(self, **changes) -> dict:
        """The packed batch as the model takes it (labels left out), with `changes` (None drops a key)."""
        inputs = {key: value for key, value in self.batch.items() if key != "labels"}
        inputs.update(changes)
        return {key: value for key, value in inputs.items() if value is not None}


def make_case(model_type, backend, documents=DOCUMENTS, rows=ROWS, padding=PADDING, seed=10, tiny=None) -> Case:
    tiny = tiny or TinyImageText(model_type, backend)
    processed = [model_inputs(tiny.document(n, sizes, seed=seed + i)) for i, (n, sizes) in enumerate(documents)]
    return pack(tiny, processed, rows, padding)


def pack(tiny, processed, rows=ROWS, padding=PADDING) -> Case:
    lengths = [document["input_ids"].shape[-1] for document in processed]
    row_length = max(sum(lengths[i] for i in row) for row in rows) + padding
    batch = pack_image_text_documents(processed, rows, row_length, model_type=tiny.model_type)
    spans = []
    for row, indices in enumerate(rows):
        start = 0
        for index in indices:
            spans.append((row, start, lengths[index], index))
            start += lengths[index]
    return Case(tiny, processed, batch, spans)


def alone_logits(model, documents) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**document, use_cache=False).logits[0] for document in documents]


def packed_logits(case: Case, route="auto", **changes) -> torch.Tensor:
    with packing_configured(case.model, attention_route=route), torch.no_grad():
        return case.model(**case.inputs(**changes), use_cache=False).logits


def differences(case: Case, logits, references) -> list[float]:
    """Per document (order of `case.spans`), the max abs difference of its packed logits from `references`."""
    return [float((logits[row, start : start + length] - references[index]).abs().max())
            for row, start, length, index in case.spans]


@pytest.mark.parametrize(("model_type", "backend", "route"), MATRIX)
def test_packed_rows_equal_documents_alone(model_type, backend, route, monkeypatch):
    if backend not in PROVEN_IMAGE_TEXT_TYPES[model_type].backends:
        with pytest.raises(ValueError, match="does not support an attention implementation through torch's flex"):
            TinyImageText(model_type, backend)
        return
    case = make_case(model_type, backend)
    calls = {}
    mask_functions = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    count_calls(calls, monkeypatch, varlen, "packed_sdpa_attention", mask_functions)
    count_calls(calls, monkeypatch, masking_utils, "sdpa_mask", mask_functions)
    with traced_flex():  # the compiled path: test_compiled_flex_attention_with_image_blocks
        logits = packed_logits(case, route)
    with untraced_flex():
        worst = max(differences(case, logits, alone_logits(case.model, case.documents)))
    print(f"parity {model_type} {backend} {route}: {worst:.2e}")
    assert worst <= TOLERANCE, (model_type, backend, route, worst)
    if backend == "sdpa" and route == "dense":
        assert calls["packed_sdpa_attention"] == 0 and calls["sdpa_mask"] > 0, calls
    elif backend == "sdpa" and PROVEN_IMAGE_TEXT_TYPES[model_type].family == IMAGE_BLOCKS:
        # Layers whose masks carry image blocks take the dense mask; Gemma 4's full layers (no blocks) take varlen.
        assert calls["sdpa_mask"] > 0, calls
    elif backend == "sdpa":
        assert calls["packed_sdpa_attention"] > 0, calls


def test_compiled_flex_attention_with_image_blocks():
    """transformers' compiled flex_attention (what a GPU runs) on Gemma 3's mask: causal text, each image's tokens
    attending to each other, and the same-document rule on top. References run uncompiled (tests/flex_modes.py)."""
    case = make_case("gemma3", "flex_attention")
    with compiled_flex():
        logits = packed_logits(case)
    with untraced_flex():
        worst = max(differences(case, logits, alone_logits(case.model, case.documents)))
    assert worst <= TOLERANCE, worst


def test_every_proven_type_is_in_the_matrix():
    assert set(PROVEN_IMAGE_TEXT_TYPES) == set(SPECS)
    assert {"qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3", "llava", "idefics3"} <= set(PROVEN_IMAGE_TEXT_TYPES)
    assert len(PROVEN_IMAGE_TEXT_TYPES) >= 15


@pytest.mark.parametrize("model_type", _marked(("qwen2_5_vl", "gemma3")))
def test_model_loss_is_the_token_mean_of_the_documents_alone(model_type):
    """The packed batch's labels (-100 on each document's first token and on padding) make the model's own loss the
    mean over the documents' tokens alone: no document learns to predict the next one."""
    case = make_case(model_type, "sdpa")
    with packing_configured(case.model), torch.no_grad():
        packed = case.model(**case.inputs(labels=case.batch["labels"]), use_cache=False).loss
    losses = []
    for document, logits in zip(case.documents, alone_logits(case.model, case.documents), strict=True):
        targets = document["input_ids"][0, 1:]
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="none"))
    assert abs(packed.item() - torch.cat(losses).mean().item()) <= TOLERANCE


@pytest.mark.parametrize("model_type", _marked(SPECS))
def test_a_documents_pixels_move_its_logits_and_no_others(model_type):
    """Document 2 (two images) with its pixels replaced by noise: its packed logits move by more than SENSITIVITY,
    every other document's stay those alone. The matrix above could not pass with images the model ignores."""
    case = make_case(model_type, "sdpa")
    noisy = [dict(document) for document in case.documents]
    generator = torch.Generator().manual_seed(0)
    noisy[2]["pixel_values"] = torch.randn(noisy[2]["pixel_values"].shape, generator=generator)
    noisy_case = pack(case.tiny, noisy)
    moved = differences(noisy_case, packed_logits(noisy_case), alone_logits(case.model, case.documents))
    print(f"sensitivity {model_type}: {dict(zip([span[3] for span in noisy_case.spans], moved, strict=True))}")
    for (_, _, _, index), difference in zip(noisy_case.spans, moved, strict=True):
        if index == 2:
            assert difference > SENSITIVITY, (model_type, difference)
        else:
            assert difference <= TOLERANCE, (model_type, index, difference)


def random_layout(seed: int, model_type: str):
    """Two rows of 1 to 5 documents, each of 1 to 12 words with 0 to 3 images (PaliGemma: 0 or 1) of random sizes,
    and 0 to 4 tokens of padding (0: the longest row is full)."""
    rng = random.Random(seed)
    sizes = ((28, 28), (56, 56), (56, 84), (84, 56), (112, 56), (56, 168), (140, 84))
    if model_type == "mistral3":
        # transformers' Mistral3 fails on a document whose only image gives one token (28 px: `squeeze(0)` drops
        # the token axis in `get_image_features`), alone as well as packed.
        sizes = sizes[1:]
    max_images = 1 if model_type == "paligemma" else 3
    documents, rows = [], []
    for _ in range(2):
        row = []
        for _ in range(rng.randint(1, 5)):
            n_images = rng.randint(0, max_images)
            words = rng.randint(n_images + 1, 12)
            documents.append((words, tuple(rng.choice(sizes) for _ in range(n_images))))
            row.append(len(documents) - 1)
        rows.append(tuple(row))
    return tuple(documents), tuple(rows), rng.randint(0, 4)


RANDOM_SEEDS = range(4)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
@pytest.mark.parametrize("model_type", [
    pytest.param(t, marks=() if t in ("qwen2_5_vl", "gemma3") else pytest.mark.slow) for t in SPECS
])
def test_random_layouts(model_type, seed):
    assert_drawn_layout_exact(make_case, model_type, seed, random_layout(seed, model_type))


def assert_drawn_layout_exact(make, model_type: str, seed: int, layout) -> None:
    """A drawn `layout` (documents, rows, padding) built by `make` (`make_case` or the video tests' `video_case`) on
    eager and sdpa: every document's logits within `TOLERANCE` of it alone; the layout and differences printed."""
    documents, rows, padding = layout
    print(f"{model_type}: seed {seed}, documents {documents}, rows {rows}, padding {padding}")
    for backend in ("eager", "sdpa"):
        case = make(model_type, backend, documents, rows, padding, seed=100 * seed)
        worst = max(differences(case, packed_logits(case), alone_logits(case.model, case.documents)))
        print(f"random {model_type} {backend} seed {seed}: {worst:.2e}")
        assert worst <= TOLERANCE, (model_type, backend, f"seed {seed}", worst)


@pytest.mark.parametrize("model_type", _marked(("qwen2_5_vl", "gemma3", "paligemma", "mllama", "llava", "idefics3")))
def test_a_training_step_with_images(model_type):
    """With gradients on and the model in training mode, as a trainer runs it: the packed forward gives the logits of
    the documents alone and a finite gradient (PaliGemma hands the mask its builder made to its text model, whose
    builder call must take it as the hook's own, not refuse it as a user's prepared 4-D mask)."""
    assert_training_step_exact(make_case(model_type, "sdpa"))


def assert_training_step_exact(case: Case) -> None:
    """A packed training forward and backward of `case` (`make_case` or the video tests' `video_case`): the logits of
    the documents alone within `TOLERANCE`, and a finite gradient."""
    references = alone_logits(case.model, case.documents)
    case.model.train()
    with packing_configured(case.model):
        output = case.model(**case.inputs(labels=case.batch["labels"]), use_cache=False)
        output.loss.backward()
    assert max(differences(case, output.logits.detach(), references)) <= TOLERANCE
    gradients = [p.grad for p in case.model.parameters() if p.grad is not None]
    assert gradients and all(bool(g.isfinite().all()) for g in gradients)
