"""The video parity matrix: packed rows of documents with 0 to 2 videos and images each give, for every document,
exactly the logits it gives alone (max abs difference <= 1e-5, float32), for every type of
`hook.media.video.VIDEO_TYPES` on eager and sdpa, and the negative controls leak.

Videos are real clips (matplotlib's sample photos panned frame by frame, `tests/tiny_video.py`) run through the
model's own video processor class (frame sampling by fps or count, temporal patches, merge size); the reference runs
each document alone through the model's normal path (its processor output, a mask of ones; the model computes its own
positions, temporal ones included). Controls: one mask for the whole row (no document mask), text positions on every
mRoPE row (no 3-D positions), Qwen2.5-VL's temporal positions without `second_per_grid_ts`, and a video's features
moved into the next document.
"""

import random

import pytest
import torch
from test_image_text_controls import _hooked_positions, text_positions_difference
from test_image_text_parity import (
    TOLERANCE,
    alone_logits,
    assert_drawn_layout_exact,
    assert_training_step_exact,
    differences,
    pack,
    packed_logits,
)
from tiny_image_text import model_inputs
from tiny_video import TinyVideo

from llm_packing.errors import PackingValueError, UnsupportedSetupError
from llm_packing.hook.media import video
from llm_packing.hook.media.placeholders import placeholder_mask
from llm_packing.hook.support import matrix as support_matrix
from llm_packing.hook.support.image_text import FLASH_BACKENDS, IMAGE_TEXT_BACKENDS, supported_image_text_model_types
from llm_packing.hook.support.video import VIDEO_TYPES, takes_videos, video_refusal


# (frames, (width, height), fps): Qwen samples 2 frames a second of them: 4, 6 and 2 frames (2, 3, 1 temporal
# patches); LLaVA-OneVision 4 frames of each.
CLIPS = ((8, (64, 48), 4.0), (12, (48, 64), 4.0), (4, (56, 56), 4.0))
# (words, image sizes (width, height), clips) per document; rows of 3 and 4 documents; padding after the longest.
DOCUMENTS = (
    (7, (), ()),
    (6, (), (CLIPS[0],)),
    (9, ((56, 56),), (CLIPS[1], CLIPS[2])),
    (5, ((84, 84), (56, 112)), (CLIPS[0],)),
    (3, (), ()),
    (8, (), (CLIPS[2], CLIPS[0])),
    (4, ((56, 84),), ()),
)
ROWS = ((0, 1, 2), (3, 4, 5, 6))
PADDING = 3
CORE = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")
TYPES = [pytest.param(t, marks=() if t in CORE else pytest.mark.slow) for t in VIDEO_TYPES]
# (type, backend) pairs the matrix runs: the support table's video column may call exactly these exact.
RUNS = [pytest.param(t, backend, marks=() if t in CORE else pytest.mark.slow)
        for t in VIDEO_TYPES for backend in ("eager", "sdpa")]


def video_case(model_type, backend, documents=DOCUMENTS, rows=ROWS, padding=PADDING, seed=20, tiny=None):
    tiny = tiny or TinyVideo(model_type, backend)
    processed = [model_inputs(tiny.document(n, sizes, seed=seed + i, videos=clips))
                 for i, (n, sizes, clips) in enumerate(documents)]
    return pack(tiny, processed, rows, padding)


@pytest.mark.parametrize(("model_type", "backend"), RUNS)
def test_packed_rows_with_videos_equal_documents_alone(model_type, backend):
    assert video_refusal(model_type, backend) is None
    case = video_case(model_type, backend)
    assert "pixel_values_videos" in case.batch
    worst = max(differences(case, packed_logits(case), alone_logits(case.model, case.documents)))
    print(f"video parity {model_type} {backend}: {worst:.2e}")
    assert worst <= TOLERANCE, (model_type, backend, worst)


def random_layout(seed: int, model_type: str):
    """Two rows of 2 to 4 documents, each of 2 to 10 words with 0 to 2 videos and 0 to 2 images, and 0 to 4 tokens of
    padding."""
    rng = random.Random(seed)
    sizes = ((28, 28), (56, 56), (56, 84), (112, 56))
    clips = CLIPS + ((6, (40, 72), 3.0), (16, (72, 40), 4.0))
    documents, rows = [], []
    for _ in range(2):
        row = []
        for _ in range(rng.randint(2, 4)):
            n_images, n_videos = rng.randint(0, 2), rng.randint(0, 2)
            words = rng.randint(n_images + n_videos + 2, 10)
            documents.append((words, tuple(rng.choice(sizes) for _ in range(n_images)),
                              tuple(rng.choice(clips) for _ in range(n_videos))))
            row.append(len(documents) - 1)
        rows.append(tuple(row))
    return tuple(documents), tuple(rows), rng.randint(0, 4)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("model_type", [
    pytest.param(t, marks=() if t == "qwen2_5_vl" else pytest.mark.slow) for t in VIDEO_TYPES
])
def test_random_layouts_with_videos(model_type, seed):
    assert_drawn_layout_exact(video_case, model_type, seed, random_layout(seed, model_type))


@pytest.mark.parametrize("model_type", TYPES)
def test_a_documents_frames_move_its_logits_and_no_others(model_type):
    """Document 2's video frames replaced by noise: its packed logits move, every other document's stay those
    alone. The matrix could not pass with videos the model ignores."""
    case = video_case(model_type, "sdpa")
    noisy = [dict(document) for document in case.documents]
    generator = torch.Generator().manual_seed(0)
    noisy[2]["pixel_values_videos"] = torch.randn(noisy[2]["pixel_values_videos"].shape, generator=generator)
    noisy_case = pack(case.tiny, noisy, ROWS, PADDING)
    moved = differences(noisy_case, packed_logits(noisy_case), alone_logits(case.model, case.documents))
    for (_, _, _, index), difference in zip(noisy_case.spans, moved, strict=True):
        if index == 2:
            assert difference > 1e-3, (model_type, difference)
        else:
            assert difference <= TOLERANCE, (model_type, index, difference)


@pytest.mark.parametrize("model_type", TYPES)
def test_one_mask_for_the_whole_row_leaks(model_type):
    """No document mask: the hook's own per-document positions (3-D for mRoPE) with a mask of ones over each row's
    documents, run without the hook (with it, a 0/1 mask whose positions restart is refused): documents attend to
    each other's videos and text."""
    case = video_case(model_type, "sdpa")
    positions = _hooked_positions(case)
    whole_row = (case.batch["attention_mask"] > 0).long()
    with torch.no_grad():
        logits = case.model(**case.inputs(attention_mask=whole_row, position_ids=positions), use_cache=False).logits
    measured = max(differences(case, logits, alone_logits(case.model, case.documents)))
    print(f"control one mask for the row {model_type}: {measured:.2e}")
    assert measured > 0.01


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_text_positions_on_video_tokens_mis_position(model_type):
    """Per-document 2-D positions on every mRoPE row (given as `(4, batch, length)`, which the hook passes through):
    video tokens lose their temporal and spatial positions."""
    measured = text_positions_difference(video_case(model_type, "sdpa"))
    print(f"control text positions on video tokens {model_type}: {measured:.2e}")
    assert measured > 1e-3


def test_temporal_positions_without_seconds_per_patch_mis_position(monkeypatch):
    """Qwen2.5-VL steps a video's temporal position by `tokens_per_second` times the seconds a temporal patch spans
    (`second_per_grid_ts`: 2 frames of clips at 8 fps sampled at 2 fps, 1 s; the processor reports the source fps, so
    0.25 s): the hook without them (1 s per patch) mis-positions every video after its first temporal patch."""
    documents = tuple((n, sizes, tuple((frames, size, 8.0) for frames, size, _ in clips))
                      for n, sizes, clips in DOCUMENTS)
    case = video_case("qwen2_5_vl", "sdpa", documents)
    assert not bool((case.batch["second_per_grid_ts"] == 1).all())
    references = alone_logits(case.model, case.documents)
    assert max(differences(case, packed_logits(case), references)) <= TOLERANCE
    per_document = video.per_document
    monkeypatch.setattr(video, "per_document", lambda values, owners, n: (
        None if values is not None and values.dtype.is_floating_point else per_document(values, owners, n)))
    measured = max(differences(case, packed_logits(case), references))
    print(f"control temporal positions without second_per_grid_ts: {measured:.2e}")
    assert measured > 1e-3


@pytest.mark.parametrize("model_type", TYPES)
def test_a_video_moved_into_the_next_document_is_refused(model_type):
    """Document 1 (one video) shortened by its last token: its video's placeholders no longer match its features,
    which would shift every later video into another document. The hook refuses the batch before any layer runs."""
    case = video_case(model_type, "sdpa")
    broken = [dict(document) for document in case.documents]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in broken[1]:
            placeholders = placeholder_mask(case.model.config, broken[1]["input_ids"],
                                            broken[1].get("mm_token_type_ids"), "video")
            last = int(placeholders[0].nonzero().max())
            broken[1][key] = torch.cat([broken[1][key][:, :last], broken[1][key][:, last + 1:]], dim=1)
    broken_case = pack(case.tiny, broken, ROWS, PADDING)
    with pytest.raises(PackingValueError, match="Video|video"):
        packed_logits(broken_case)


def test_every_exact_video_cell_is_a_run_of_the_matrix():
    runs = {tuple(param.values) for param in RUNS}
    for model_type in supported_image_text_model_types():
        exact = [b for b in IMAGE_TEXT_BACKENDS + FLASH_BACKENDS if video_refusal(model_type, b) is None]
        assert {(model_type, backend) for backend in exact} <= runs, model_type
        cell = support_matrix._video_cell(model_type)
        assert cell.startswith(f"exact on {', '.join(exact)} (") if exact else cell.startswith(("n/a: ", "refused: "))
    assert {model_type for model_type, _ in runs} == set(VIDEO_TYPES)


def test_no_video_input_is_read_from_the_model_class():
    """Every video type's class takes `pixel_values_videos`; LLaVA's does not, and InternVL's processor passes a
    video's frames as images."""
    assert all(takes_videos(model_type) for model_type in VIDEO_TYPES)
    assert takes_videos("glm4v") and not takes_videos("llava") and not takes_videos("internvl")
    assert support_matrix._video_cell("llava").startswith("n/a: no video input")
    assert "frames as images" in support_matrix._video_cell("internvl")
    assert support_matrix._video_cell("glm4v").startswith("refused: not in the video parity matrix")


def test_videos_of_an_unproven_type_are_refused():
    with pytest.raises(UnsupportedSetupError, match="not in the video parity matrix"):
        video.refuse_media_not_packed("glm4v", "sdpa", {"pixel_values_videos": torch.zeros(1)})
    with pytest.raises(UnsupportedSetupError, match="no video input"):
        video.refuse_media_not_packed("llava", "sdpa", {"pixel_values_videos": torch.zeros(1)})
    with pytest.raises(UnsupportedSetupError, match="attn_implementation='flex_attention'"):
        video.refuse_media_not_packed("llava_onevision", "flex_attention", {"pixel_values_videos": torch.zeros(1)})
    with pytest.raises(UnsupportedSetupError, match="not audio"):
        video.refuse_media_not_packed("qwen2_5_vl", "sdpa", {"input_features": torch.zeros(1)})


def test_onevision_videos_of_different_frame_counts_are_refused_when_packed():
    tiny = TinyVideo("llava_onevision")
    documents = [model_inputs(tiny.document(6, (), seed=1, videos=(CLIPS[0],))),
                 model_inputs(tiny.document(6, (), seed=2, videos=(CLIPS[1],)))]
    documents[1]["pixel_values_videos"] = documents[1]["pixel_values_videos"][:, :2]
    with pytest.raises(PackingValueError, match="Sample the same number of frames"):
        pack(tiny, documents, ((0, 1),), 0)


def test_a_packed_training_step_with_videos():
    assert_training_step_exact(video_case("qwen2_5_vl", "sdpa"))
