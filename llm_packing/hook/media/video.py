"""Videos in packed batches: which types pack them, how many placeholder tokens each video fills, and in which
document each lands.

A video is packed the way an image is: its features fill its placeholder tokens in packed order, so each video's
placeholders must lie in one document and the videos must fill the batch's video placeholders exactly
(`placeholders.unit_owners`). mRoPE models also give video tokens temporal positions, which `hook.media.mrope`
computes per document from that document's own `video_grid_thw` (and Qwen2.5-VL's `second_per_grid_ts`, the seconds
one temporal patch spans). Which types pack videos, on which backends, and why the others are refused is data
(`support.video`: `VIDEO_TYPES`, `video_refusal`); audio of every type is refused.
"""

import math
from collections.abc import Callable

import numpy as np
import torch

from ...errors import PackingValueError, UnsupportedSetupError
from ..documents import ForwardDocuments
from ..support.video import VIDEO_BACKENDS, VIDEO_TYPES, video_refusal
from .placeholders import unit_owners


# Forward arguments that carry one value per video, in packed order.
VIDEO_ARGUMENTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_NOT_PACKED_WORDS = ("audio", "input_features")


def _grids(config, media) -> list[int]:
    """mRoPE models: `t * h * w / merge_size**2` tokens per `video_grid_thw` row."""
    return (media["video_grid_thw"].prod(-1) // config.vision_config.spatial_merge_size**2).tolist()


def _pooled_frames(config, media) -> list[int]:
    """LLaVA-OneVision: each frame's patches pooled 2 x 2 (rounding up), plus one newline token per video."""
    side = math.ceil(config.vision_config.image_size // config.vision_config.patch_size / 2)
    videos, frames = media["pixel_values_videos"].shape[:2]
    return [frames * side * side + 1] * videos


# model_type -> the placeholder tokens of each video, in packed order, from (config, media kwargs).
VIDEO_UNITS: dict[str, Callable[..., list[int]]] = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"), _grids),
    "llava_onevision": _pooled_frames,
}


def is_video_argument(name: str) -> bool:
    return "video" in name or name == "second_per_grid_ts"


def refuse_media_not_packed(model_type: str, backend: str | None, given: dict) -> None:
    """Raise [`UnsupportedSetupError`] for audio in a packed batch, and for videos of a type or on a backend the video
    parity matrix did not prove."""
    audio = sorted(name for name in given if any(word in name for word in _NOT_PACKED_WORDS))
    if audio:
        raise UnsupportedSetupError(
            f"A packed batch carries {', '.join(audio)}: llm_packing packs images and videos with their documents, "
            "not audio. Pack the rows holding audio without packing, or leave the audio out."
        )
    videos = sorted(name for name in given if is_video_argument(name))
    if not videos:
        return
    reason = video_refusal(model_type, backend)
    if reason is None:
        return
    fix = ("Use `configure_packing(model, attn_implementation='sdpa')`, or train the video rows unpacked."
           if model_type in VIDEO_TYPES else "Train this model's video rows unpacked, or leave the videos out.")
    raise UnsupportedSetupError(
        f"A packed batch of model_type {model_type!r} on attn_implementation={backend!r} carries {', '.join(videos)}: "
        f"{reason}. Types packed with their videos: {', '.join(sorted(VIDEO_TYPES))}, on "
        f"{', '.join(VIDEO_BACKENDS)}. {fix}"
    )


def documents_of_videos(
    model_type: str, config, documents: ForwardDocuments, placeholders: np.ndarray, media: dict
) -> np.ndarray:
    """
    The index (in the order of `documents.starts`) of the document each video of the batch lands in, after checking
    that its placeholders lie in that one document and that the videos fill the batch's video placeholders exactly.

    Raises [`~llm_packing.errors.PackingValueError`] naming the video, its token count and where it runs over.
    """
    if not media and not placeholders.any():
        return np.zeros(0, dtype=np.int64)
    try:
        counts = VIDEO_UNITS[model_type](config, media) if media else []
    except KeyError as missing:
        raise PackingValueError(
            f"A packed batch for model_type {model_type!r} carries {sorted(media)} without `{missing.args[0]}`, "
            "which its processor returns with its videos. Pass each document's whole processor output."
        ) from None
    return unit_owners(np.asarray(counts, dtype=np.int64), placeholders, documents, "Video")


def per_document(values, owners: np.ndarray | None, n_documents: int) -> list | None:
    """Per document (order of the forward's documents), its rows of `values` (one row per image unit or video, packed
    order; `owners` their documents), or None without units; the mRoPE inputs of `hook.media.mrope`."""
    if values is None or owners is None or not len(owners):
        return None
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values)
    rows: list[torch.Tensor | None] = [None] * n_documents
    for document in np.unique(owners):
        rows[int(document)] = values[torch.from_numpy(np.flatnonzero(owners == document))]
    return rows
