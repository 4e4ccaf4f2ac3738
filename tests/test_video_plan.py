"""Planning a video's tokens from its container header (`llm_packing.data.video`), checked against the processor's
real expansion: MP4 clips written here with PyAV (real photos panned frame by frame) of several lengths, frame rates
and sizes, decoded with PyAV and run through each family's processor and real video processor class
(`tests/tiny_video.py`); the planned token count must equal the processor's for every clip."""

import av
import numpy as np
import pytest
from tiny_processors import SPECS, make_tokenizer
from tiny_video import VIDEO_SPECS, clip, video_processor, video_prompt, with_video_processor, write_clip

from llm_packing.data.video import VideoHeader, video_header, video_replacement
from llm_packing.errors import PackingTypeError, PackingValueError


# (frames, fps, (width, height)): short and long, slow and fast, portrait and landscape, sizes off the patch grid
# (H.264 needs even sides).
CLIPS = ((8, 4, (64, 48)), (13, 6, (48, 80)), (30, 10, (96, 40)), (5, 2, (38, 54)), (24, 24, (56, 56)))
# family, video processor settings changed from tests/tiny_video.py's (LLaVA-OneVision sampling by fps, not a count).
FAMILIES = (("qwen2_vl", {}), ("qwen2_5_vl", {}), ("qwen3_vl", {}), ("llava_onevision", {}),
            ("llava_onevision", {"num_frames": None, "fps": 3.0}), ("qwen2_5_vl", {"do_sample_frames": False}))


def processor_with_video(family: str):
    spec = SPECS[family]
    tokenizer = make_tokenizer(spec["tokens"], spec.get("extra", ()))
    image_processor = spec["processor"](tokenizer).image_processor
    kwargs = {"num_image_tokens": 16, "vision_feature_select_strategy": "full"} if family == "llava_onevision" else {}
    return with_video_processor(VIDEO_SPECS[family][0])(image_processor, tokenizer, video_processor(family), **kwargs)


def decoded(path):
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return frames, float(stream.average_rate)


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    paths = []
    for index, (frames, fps, size) in enumerate(CLIPS):
        path = folder / f"clip{index}.mp4"
        write_clip(path, clip(index, frames, size), fps)
        paths.append(path)
    return paths


def test_headers_give_frames_rate_and_size_without_decoding(clip_files):
    for path, (frames, fps, (width, height)) in zip(clip_files, CLIPS, strict=True):
        assert video_header(path, "clip") == VideoHeader(frames, float(fps), width, height)
        assert video_header(path.read_bytes(), "clip") == video_header({"bytes": None, "path": str(path)}, "clip")


@pytest.mark.parametrize(("family", "settings"), FAMILIES)
def test_planned_tokens_equal_the_processors_expansion(family, settings, clip_files):
    processor = processor_with_video(family)
    for name, value in settings.items():
        setattr(processor.video_processor, name, value)
    text = f"w1 w2 {video_prompt(family)} w3"
    for index, path in enumerate(clip_files):
        frames, fps = decoded(path)
        header = video_header(path, f"clip {index}")
        try:
            real = processor(text=[text], videos=[frames], return_tensors="np",
                             video_metadata=[{"total_num_frames": len(frames), "fps": fps}])["input_ids"][0]
        except ValueError as error:  # a clip shorter than the frames asked for: refused by both
            print(f"{family} clip {index} {CLIPS[index]}: the processor refuses it ({error})")
            with pytest.raises(PackingValueError, match=f"clip {index} .*cannot be sampled"):
                video_replacement(processor, header, f"clip {index}")
            continue
        expanded = text.replace(processor.video_token, video_replacement(processor, header, f"clip {index}"), 1)
        planned = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        print(f"{family} clip {index} {CLIPS[index]}: planned {len(planned)}, processor {len(real)}")
        assert len(planned) == len(real) and list(planned) == list(real), (family, index)


def test_unreadable_videos_are_refused(tmp_path):
    with pytest.raises(PackingValueError, match=r"video 0 of row 2: the file .*missing.mp4' does not exist"):
        video_header(str(tmp_path / "missing.mp4"), "video 0 of row 2")
    with pytest.raises(PackingValueError, match="cannot be read as a video"):
        video_header(b"not a video", "video 0 of row 2")
    with pytest.raises(PackingTypeError, match="not a video: expected a file path"):
        video_header(3, "video 0 of row 2")


def test_a_processor_without_a_video_rule_is_refused():
    from tiny_processors import tiny_processor

    with pytest.raises(PackingValueError, match="Gemma3Processor has no header-only video rule"):
        video_replacement(tiny_processor("gemma3"), VideoHeader(8, 4.0, 32, 32), "video 0 of row 0")
