"""The token count of a video, planned from its container header without decoding a frame.

A processor expands each video placeholder into as many tokens as the frames it samples and their size give.
`video_header` reads the frame count, frame rate and frame size from the container's stream header (PyAV, imported on
first use; no frame is decoded). `video_replacement` then does what the processor does after decoding: the video
processor's own `sample_frames` picks the frames from the header's numbers (fps or a fixed count), and the
processor's own `replace_video_token` builds the expansion, handed the few numbers it reads (the grid from the video
processor's own `get_num_of_video_patches`, the sampled frame indices that Qwen3-VL's timestamps come from, the
frame count LLaVA-OneVision multiplies). Tokenizing that string is exact where counting placeholders is not (Qwen3-VL
writes a timestamp before each temporal patch).

`VIDEO_RULES` says which numbers each processor class reads; each rule is checked against the processor's real
expansion of the decoded clip in `tests/test_video_plan.py`. A processor without a rule is refused by name.
"""

import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import PackingTypeError, PackingValueError


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container says about its frames: their count, rate (frames a second) and size."""

    frames: int
    fps: float
    width: int
    height: int


def video_header(video, where: str) -> VideoHeader:
    """
    The [`VideoHeader`] of `video` (a file path, the file's bytes or a `{"bytes": ..., "path": ...}` value) read from
    its container's stream header, without decoding; `where` names it in errors (e.g. `"video 0 of row 3"`).

    Example:
    ```python
    >>> import av, io, numpy as np
    >>> file = io.BytesIO()
    >>> with av.open(file, mode="w", format="mp4") as container:
    ...     stream = container.add_stream("libx264", rate=4)
    ...     stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
    ...     for _ in range(6):
    ...         frame = av.VideoFrame.from_ndarray(np.zeros((16, 32, 3), np.uint8), format="rgb24")
    ...         _ = [container.mux(packet) for packet in stream.encode(frame)]
    ...     _ = [container.mux(packet) for packet in stream.encode()]
    >>> video_header(file.getvalue(), "video 0 of row 0")
    VideoHeader(frames=6, fps=4.0, width=32, height=16)

    ```
    """
    import av

    source = _source(video, where)
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise PackingValueError(f"{where} ({_describe(video)}) has no video stream. Fix that row's video.")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = stream.frames
            if not frames and rate and stream.duration is not None and stream.time_base is not None:
                frames = round(float(stream.duration * stream.time_base) * float(rate))
            width, height = stream.codec_context.width, stream.codec_context.height
    except FileNotFoundError:
        raise PackingValueError(
            f"{where}: the file {_describe(video)} does not exist (working directory {os.getcwd()!r}). Fix the path "
            "in that row, or drop the row before packing."
        ) from None
    except av.FFmpegError as error:
        raise PackingValueError(
            f"{where} ({_describe(video)}) cannot be read as a video ({type(error).__name__}: {error}). Replace or "
            "remove that video, or drop the row before packing."
        ) from None
    if not frames or not rate or not width or not height:
        raise PackingValueError(
            f"{where} ({_describe(video)}): its container header gives frames={frames}, fps={rate}, "
            f"size={width}x{height}, so its token count cannot be planned without decoding. Remux it with a frame "
            "count in the header (`ffmpeg -i in -c copy out.mp4`), or drop the row before packing."
        )
    return VideoHeader(int(frames), float(rate), int(width), int(height))


def read_frames(video, indices, where: str) -> np.ndarray:
    """
    The frames of `video` at `indices` (sorted frame numbers, e.g. [`sampled_frames`]'s), decoded with PyAV as
    transformers' `load_video(..., backend="pyav")` decodes them: `(len(indices), height, width, 3)` uint8 RGB. A video
    with fewer frames than its header said is refused.
    """
    import av

    wanted = {int(index) for index in indices}
    frames = []
    with av.open(_source(video, where)) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if number in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if len(frames) == len(wanted):
                break
    if len(frames) != len(wanted):
        raise PackingValueError(
            f"{where} ({_describe(video)}) decoded to fewer frames than its header gives: frame "
            f"{max(wanted)} was asked for and {len(frames)} of {len(wanted)} frames were found. Remux it "
            "(`ffmpeg -i in -c copy out.mp4`) so that its header counts its frames, or drop the row and pack again."
        )
    return np.stack(frames)


def _source(video, where: str):
    if isinstance(video, (str, os.PathLike)):
        return os.fspath(video)
    if isinstance(video, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(video))
    if isinstance(video, dict) and (video.get("bytes") or video.get("path")):
        return io.BytesIO(video["bytes"]) if video.get("bytes") else video["path"]
    raise PackingTypeError(
        f"{where} is {type(video).__name__}, not a video: expected a file path, the file's bytes or a "
        "`{'bytes': ..., 'path': ...}` value. Fix that row's `videos`."
    )


def _describe(video) -> str:
    if isinstance(video, dict):
        video = video.get("path") or video.get("bytes")
    return repr(os.fspath(video)) if isinstance(video, (str, os.PathLike)) else f"<{len(video)} bytes>"


def sampled_frames(video_processor, header: VideoHeader, where: str) -> np.ndarray:
    """The indices of the frames `video_processor` keeps of a video with `header`: its own `sample_frames` when it
    samples (`do_sample_frames`), else every frame. A video it cannot sample (more frames asked than it has) is
    refused, as the processor would refuse it."""
    from transformers.video_utils import VideoMetadata

    if not getattr(video_processor, "do_sample_frames", False):
        return np.arange(header.frames)
    metadata = VideoMetadata(total_num_frames=header.frames, fps=header.fps, width=header.width,
                             height=header.height, duration=header.frames / header.fps)
    try:
        return np.asarray(video_processor.sample_frames(metadata=metadata))
    except ValueError as error:
        raise PackingValueError(
            f"{where} ({header.frames} frames at {header.fps:g} fps) cannot be sampled by "
            f"{type(video_processor).__name__} (num_frames={getattr(video_processor, 'num_frames', None)}, "
            f"fps={getattr(video_processor, 'fps', None)}): {error} Lower the video processor's `fps` or "
            "`num_frames`, or drop the row before packing."
        ) from None


def _grid(processor, header: VideoHeader, indices: np.ndarray) -> dict:
    # Qwen2-VL family: `video_grid_thw` rows (temporal patches, 1, spatial patches a frame) and, for Qwen3-VL's
    # timestamps, the metadata of the sampled frames.
    from transformers.video_utils import VideoMetadata

    video_processor = processor.video_processor
    patches = video_processor.get_num_of_video_patches(len(indices), header.height, header.width, {})
    temporal = math.ceil(len(indices) / video_processor.temporal_patch_size)
    metadata = VideoMetadata(total_num_frames=header.frames, fps=header.fps, width=header.width,
                             height=header.height, frames_indices=list(indices))
    return {"video_grid_thw": np.array([[temporal, 1, patches // temporal]], dtype=np.int64),
            "video_metadata": [metadata]}


def _frame_count(processor, header: VideoHeader, indices: np.ndarray) -> dict:
    # LLaVA-OneVision: its frames (each pooled to a fixed number of tokens) plus one newline token.
    return {"pixel_values_videos": [np.broadcast_to(np.zeros((), np.float32), (len(indices), 1))]}


# Processor class name -> the inputs its `replace_video_token` reads, from the header and the sampled frames. A
# subclass takes its base class's rule.
VIDEO_RULES: dict[str, Callable] = {
    **dict.fromkeys(("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor"), _grid),
    "LlavaOnevisionProcessor": _frame_count,
}


def video_rule(processor) -> Callable | None:
    """The `VIDEO_RULES` entry of `processor`'s class (or of the nearest base class that has one)."""
    for cls in type(processor).__mro__:
        if cls.__name__ in VIDEO_RULES:
            return VIDEO_RULES[cls.__name__]
    return None


def video_replacement(processor, header: VideoHeader, where: str) -> str:
    """The text `processor` puts in place of one video placeholder for a video with `header`; `where` names the video
    in errors."""
    rule = video_rule(processor)
    if rule is None or getattr(processor, "video_processor", None) is None:
        raise PackingValueError(
            f"{where}: {type(processor).__name__} has no header-only video rule (processors with one: "
            f"{', '.join(VIDEO_RULES)}). Pack this model's video rows unpacked, or use a "
            "processor of those families (with its video processor)."
        )
    indices = sampled_frames(processor.video_processor, header, where)
    return processor.replace_video_token(rule(processor, header, indices), video_idx=0)
