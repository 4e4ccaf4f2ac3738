"""Which image-text model types the hook packs exactly with their videos, on which backends, and why the others'
videos are refused.

A type packs videos only if it is in `VIDEO_TYPES`, the types `tests/test_video_parity.py` proved on
`VIDEO_BACKENDS`: rows of 2 to 4 documents with 0 to 2 videos and images each give every document its logits alone
within 1e-5 (float32). Every other (type, backend) is refused by `video_refusal`, which the hook raises with
(`hook.media.video.refuse_media_not_packed`) and the support table prints (`support.matrix`): a type whose image-text
class takes no `pixel_values_videos` has no video input at all; one that takes them is not yet in the video parity
matrix.

Example:
```python
>>> from llm_packing.hook.support.video import video_refusal
>>> video_refusal("qwen2_5_vl", "sdpa") is None, video_refusal("qwen2_5_vl", "flash_attention_2")
(True, "not in the video parity matrix on 'flash_attention_2' (it proved eager, sdpa)")

```
"""

import functools
import inspect


MROPE_VIDEO = "mRoPE: 3-D positions with temporal steps per document"
VIDEO_TOKENS = "video tokens: text isolation, frames in packed order"
VIDEO_BACKENDS = ("eager", "sdpa")

# model_type -> how its documents' videos are kept apart. Proven by tests/test_video_parity.py (CPU, float32,
# tolerance 1e-5); edit only together with a passing matrix.
VIDEO_TYPES: dict[str, str] = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"), MROPE_VIDEO),
    "llava_onevision": VIDEO_TOKENS,
}
# Video types that tests/test_video_collator.py also runs end to end: `pack_dataset` plans MP4 clips, the collator
# decodes them and the packed batch gives each document its logits alone.
VIDEO_END_TO_END_TYPES = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")


def _image_text_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


@functools.cache
def takes_videos(model_type: str) -> bool:
    """Whether the installed transformers' image-text class of `model_type` takes videos (`pixel_values_videos`)."""
    cls = _image_text_class(model_type)
    return cls is not None and "pixel_values_videos" in inspect.signature(cls.forward).parameters


@functools.cache
def has_video_processor(model_type: str) -> bool:
    """Whether the installed transformers maps `model_type` to a video processor."""
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    return model_type in VIDEO_PROCESSOR_MAPPING_NAMES


def no_video_input(model_type: str) -> str | None:
    """Why `model_type` has no video input, or None if its image-text class takes videos."""
    if takes_videos(model_type):
        return None
    how = ("its processor passes a video's frames as images" if has_video_processor(model_type)
           else "transformers maps it no video processor")
    return f"no video input (its forward takes no `pixel_values_videos`; {how})"


def video_refusal(model_type: str, backend: str | None) -> str | None:
    """Why packed batches with videos of `model_type` are refused on `backend`, or None if the video parity matrix
    proved them there."""
    if model_type not in VIDEO_TYPES:
        return no_video_input(model_type) or (
            "not in the video parity matrix (its forward takes `pixel_values_videos`; not yet run)")
    if backend not in VIDEO_BACKENDS:
        return f"not in the video parity matrix on {backend!r} (it proved {', '.join(VIDEO_BACKENDS)})"
    return None
