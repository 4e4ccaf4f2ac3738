"""Conversations with videos end to end: `messages` with `{"type": "video"}` parts and a `videos` column (MP4 paths
and bytes written here with PyAV, beside `images`), planned by `pack_dataset(..., processor=...)` from the videos'
container headers, collated by `DataCollatorWithPacking(processor=...)` (videos decoded with PyAV, each document
through the processor alone), and run packed through the hook.

References are independent of the collator's decoding: each conversation alone, its videos decoded whole with PyAV
and handed to the processor with their metadata, which samples the frames itself (as it does with a path when it can
decode). Every planned token count must equal the reference's, every packed document's tokens and media its
reference's, and every packed document's logits its logits alone (max abs difference <= 1e-5, float32).
"""

import io

import av
import datasets
import numpy as np
import pytest
import torch
from test_image_text_parity import TOLERANCE
from test_video_plan import decoded
from tiny_processors import chat_template, photo_bytes
from tiny_video import TinyVideo, clip, video_prompt, write_clip

from llm_packing import DataCollatorWithPacking, pack_dataset
from llm_packing.core.image_text import open_image, structured_messages
from llm_packing.data.pack_image_text import plan_conversations
from llm_packing.errors import PackingValueError
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support.video import VIDEO_END_TO_END_TYPES


# (frames, (width, height), fps): Qwen samples 2 frames a second (4, 6, 2 frames), LLaVA-OneVision 4 of each.
CLIPS = ((8, (64, 48), 4.0), (12, (48, 64), 4.0), (4, (56, 56), 4.0))
# (words, image sizes, clip indices) per conversation: 0 to 2 videos and images, text only among them.
CONVERSATIONS = ((4, (), (0,)), (3, ((56, 84),), (1, 2)), (6, (), ()), (2, ((84, 56),), (2,)), (5, (), (1,)),
                 (3, ((56, 56), (28, 56)), ()))
MAX_LENGTH = 512
TYPES = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")


def video_chat_template(model_type: str, image_prompt: str) -> str:
    """tests/tiny_processors.py's template, with video parts as the family's video placeholder."""
    return chat_template(image_prompt).replace(
        "{% else %} {{ part['text'] }}",
        "{% elif part['type'] == 'video' %}" + video_prompt(model_type) + "{% else %} {{ part['text'] }}")


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("video_clips")
    paths = []
    for index, (frames, size, fps) in enumerate(CLIPS):
        paths.append(folder / f"clip{index}.mp4")
        write_clip(paths[-1], clip(index, frames, size), fps)
    return paths


def conversations(clip_files) -> list[dict]:
    """TRL-style rows: string contents (the videos placed before the first user text) and a video placed in a
    structured part; videos as paths and as bytes."""
    rows = []
    for number, (words, sizes, clips) in enumerate(CONVERSATIONS):
        videos = [{"bytes": clip_files[c].read_bytes(), "path": None} if (number + k) % 2 else
                  {"bytes": None, "path": str(clip_files[c])} for k, c in enumerate(clips)]
        question = f"conversation {number}: " + "look " * words
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": "It shows a photo in motion."}],
                     "images": [{"bytes": photo_bytes(number + k, size), "path": None}
                                for k, size in enumerate(sizes)],
                     "videos": videos})
    return rows


def dataset(rows) -> datasets.Dataset:
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
        "videos": datasets.List(datasets.Video(decode=False)),
    })
    return datasets.Dataset.from_list(rows, features=features)


def tiny_with_chat_template(model_type: str) -> TinyVideo:
    tiny = TinyVideo(model_type, "sdpa")
    tiny.processor.chat_template = video_chat_template(model_type, tiny.spec["prompt"])
    return tiny


def alone(processor, row: dict) -> dict:
    """The conversation alone: its videos decoded whole, sampled by the processor from their metadata."""
    images = [open_image(image, "image") for image in row["images"]]
    videos = [decoded(video["path"]) if video["path"] else decoded_bytes(video["bytes"]) for video in row["videos"]]
    text = processor.apply_chat_template(
        structured_messages(row["messages"], images, "row", [frames for frames, _ in videos]), tokenize=False)
    kwargs = {}
    if videos:
        kwargs = {"videos": [frames for frames, _ in videos],
                  "video_metadata": [{"total_num_frames": len(frames), "fps": fps} for frames, fps in videos]}
    output = processor(text=[text], images=[images] if images else None, return_tensors="pt",
                       add_special_tokens=False, **kwargs)
    output = {key: value for key, value in dict(output).items() if isinstance(value, torch.Tensor) or
              key == "second_per_grid_ts"}
    if "second_per_grid_ts" in output:
        output["second_per_grid_ts"] = torch.as_tensor(output["second_per_grid_ts"], dtype=torch.float32)
    return output


def decoded_bytes(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]), float(
            stream.average_rate)


def documents_of(batch: dict, row: int):
    mask = batch["attention_mask"][row]
    return [(int((mask == d).nonzero()[0]), int((mask == d).nonzero()[-1]) + 1) for d in range(1, int(mask.max()) + 1)]


def test_the_support_table_calls_these_types_end_to_end():
    assert set(TYPES) == set(VIDEO_END_TO_END_TYPES)


@pytest.mark.parametrize("model_type", TYPES)
def test_collated_videos_equal_their_plan_and_each_document_alone(model_type, clip_files):
    tiny = tiny_with_chat_template(model_type)
    rows = conversations(clip_files)
    tokens, _ = plan_conversations(dataset(rows), tiny.processor)
    packed = pack_dataset(dataset(rows), max(int(tokens.max()), int(tokens.sum()) // 3), processor=tiny.processor)
    assert 2 <= len(packed) < len(rows), "several rows, and rows of several conversations"
    collator = DataCollatorWithPacking(processor=tiny.processor, check_model_configured=False)
    batch = collator([packed[i] for i in range(len(packed))])
    assert "pixel_values_videos" in batch and batch["attention_mask"].max() > 1
    references, spans = [], []
    for row in range(len(packed)):
        planned = packed[row]["conversation_lengths"]
        for (start, end), messages, tokens in zip(documents_of(batch, row), packed[row]["messages"], planned,
                                                  strict=True):
            number = int(messages[0]["content"].split(":")[0].split()[1])
            reference = alone(tiny.processor, rows[number])
            assert end - start == tokens == reference["input_ids"].shape[1], (number, end - start, tokens)
            assert torch.equal(batch["input_ids"][row, start:end], reference["input_ids"][0])
            references.append(reference)
            spans.append((row, start, end))
    for name in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "pixel_values", "image_grid_thw"):
        values = [reference[name] for reference in references if name in reference]
        if values and len({value.shape[1:] for value in values}) == 1:  # in packed order (unpadded)
            assert torch.equal(batch[name], torch.cat(values)), name
    model = tiny.model
    with torch.no_grad():
        expected = [model(**{k: v for k, v in reference.items() if k != "labels"}, use_cache=False).logits[0]
                    for reference in references]
        with packing_configured(model):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    worst = max(float((logits[row, start:end] - reference).abs().max())
                for (row, start, end), reference in zip(spans, expected, strict=True))
    print(f"collated video parity {model_type}: {worst:.2e} over {len(spans)} documents in {len(packed)} rows")
    assert worst <= TOLERANCE, (model_type, worst)


def test_video_parts_are_filled_and_counted():
    messages = [{"role": "user", "content": [{"type": "video", "video": None}, {"type": "text", "text": "What?"}]}]
    assert structured_messages(messages, [], "row 0", ["a.mp4"])[0]["content"][0] == {"type": "video",
                                                                                     "video": "a.mp4"}
    with pytest.raises(PackingValueError, match="row 0 has 2 video.s. in `videos` but 1 video part"):
        structured_messages(messages, [], "row 0", ["a.mp4", "b.mp4"])


def test_a_video_changed_since_packing_is_refused(clip_files, tmp_path):
    tiny = tiny_with_chat_template("qwen2_5_vl")
    path = tmp_path / "changing.mp4"
    write_clip(path, clip(0, 8, (64, 48)), 4.0)
    row = {"messages": [{"role": "user", "content": "look"}, {"role": "assistant", "content": "ok"}],
           "images": [], "videos": [{"bytes": None, "path": str(path)}]}
    packed = pack_dataset(dataset([row, conversations(clip_files)[2]]), MAX_LENGTH, processor=tiny.processor)
    write_clip(path, clip(0, 16, (64, 48)), 4.0)
    collator = DataCollatorWithPacking(processor=tiny.processor, check_model_configured=False)
    with pytest.raises(PackingValueError, match="the processor gave .* tokens, but the conversation was packed as"):
        collator([packed[0]])


def test_a_processor_without_a_video_processor_is_refused(clip_files):
    from tiny_processors import make_processor

    processor = make_processor("qwen2_5_vl")
    rows = conversations(clip_files)[:1]
    with pytest.raises(PackingValueError, match="no header-only video rule"):
        pack_dataset(dataset(rows), MAX_LENGTH, processor=processor)
    collator = DataCollatorWithPacking(processor=processor, check_model_configured=False)
    with pytest.raises(PackingValueError, match="has no video processor"):
        collator([dataset(rows)[0]])
