"""Tiny video-text models with their own processors, video processors included, and real clips to feed them.

transformers' video processors are torchvision classes (`TorchvisionBackend`), and torchvision has no build for the
CPU torch tested (its wheel's operators fail to load). `video_processor(model_type)` builds the model's real video
processor class (frame sampling by fps or count, `smart_resize`, temporal patches, merge size: all transformers' own
code) with only the two pixel kernels that torchvision provides replaced by torch ones (`TorchKernels`: resize by
antialiased bicubic interpolation, normalize). Token counts and grids are the real class's; pixel values are close
to torchvision's, and every parity check compares the same pixels packed and alone.

Clips are real photos in motion: matplotlib's sample images, panned and zoomed frame by frame (`clip`). `write_clip`
writes one as an MP4 with PyAV, as a dataset would hold it.
"""

import random

import numpy as np
import torch
import transformers
from tiny_image_text import WORDS, TinyImageText, photo

from llm_packing.demo.torch_video_kernels import TorchKernels, import_without_torchvision, with_torch_kernels


def with_video_processor(processor_class):
    """`processor_class` accepting a `TorchKernels` video processor (it checks the argument against
    `transformers.BaseVideoProcessor`, a placeholder without torchvision)."""

    class WithVideo(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and isinstance(argument, TorchKernels):
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    WithVideo.__name__ = processor_class.__name__ + "WithVideo"
    return WithVideo


def _qwen2_video(**kwargs):
    module = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    return with_torch_kernels(module.Qwen2VLVideoProcessor)(cap_pixels_per_frame=False, **kwargs)


def _qwen3_video(**kwargs):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return with_torch_kernels(Qwen3VLVideoProcessor)(cap_pixels_per_frame=False, **kwargs)


def _onevision_video(**kwargs):
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    return with_torch_kernels(LlavaOnevisionVideoProcessor)(**kwargs)


# Pixel budgets small enough for tiny rows: a frame gives 2 to 16 merged tokens, as the tiny image processors do.
# Qwen samples 2 frames a second (2 to 8 frames); LLaVA-OneVision 4 frames a video (its packed videos share a shape).
_QWEN2_VIDEO = {"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}, "patch_size": 14,
                "merge_size": 2, "temporal_patch_size": 2, "fps": 2.0, "min_frames": 2, "max_frames": 8}
_QWEN3_VIDEO = {**_QWEN2_VIDEO, "size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 16}, "patch_size": 16}

# model_type -> its processor class (with its video processor), the video processor, and the video prompt.
VIDEO_SPECS = {
    "qwen2_vl": (transformers.Qwen2VLProcessor, lambda: _qwen2_video(**_QWEN2_VIDEO)),
    "qwen2_5_vl": (transformers.Qwen2_5_VLProcessor, lambda: _qwen2_video(**_QWEN2_VIDEO)),
    "qwen3_vl": (transformers.Qwen3VLProcessor, lambda: _qwen3_video(**_QWEN3_VIDEO)),
    "qwen3_vl_moe": (transformers.Qwen3VLProcessor, lambda: _qwen3_video(**_QWEN3_VIDEO)),
    "llava_onevision": (transformers.LlavaOnevisionProcessor,
                        lambda: _onevision_video(size={"height": 56, "width": 56}, do_sample_frames=True,
                                                 num_frames=4)),
}
VIDEO_PROMPTS = {"llava_onevision": "<video>"}
_QWEN_VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"


def video_processor(model_type: str):
    """The real video processor of `model_type`, tiny budgets, torch pixel kernels."""
    return VIDEO_SPECS[model_type][1]()


def video_prompt(model_type: str) -> str:
    return VIDEO_PROMPTS.get(model_type, _QWEN_VIDEO_PROMPT)


def clip(index: int, frames: int, size: tuple[int, int]) -> np.ndarray:
    """`frames` frames of (width, height) `size`, `(frames, height, width, 3)` uint8: a real photo (matplotlib's
    sample data) panned and zoomed a little each frame."""
    width, height = size
    base = np.asarray(photo(index, (2 * width, 2 * height)))
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for frame in range(frames):
        shift = frame * max(1, width // (2 * max(frames, 1)))
        out[frame] = base[shift // 2 : shift // 2 + height, shift : shift + width][:height, :width]
    return out


def write_clip(path, frames: np.ndarray, fps: float) -> None:
    """Write `(frames, height, width, 3)` uint8 `frames` to `path` as an H.264 MP4 (PyAV)."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=int(fps) if float(fps).is_integer() else fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


class TinyVideo(TinyImageText):
    """A tiny model of `model_type` (`TinyImageText`) whose processor has its video processor."""

    def __init__(self, model_type: str, backend: str = "sdpa", seed: int = 0):
        super().__init__(model_type, backend, seed)
        processor_class, make_video_processor = VIDEO_SPECS[model_type]
        image_processor = self.processor.image_processor
        kwargs = {}
        if model_type == "llava_onevision":
            kwargs = {"num_image_tokens": 16, "vision_feature_select_strategy": "full"}
        self.processor = with_video_processor(processor_class)(
            image_processor, self.tokenizer, make_video_processor(), **kwargs)

    def document(self, n_words: int, image_sizes=(), seed: int = 0, videos=()) -> dict:
        """One conversation of `n_words` words with images of `image_sizes` and videos `videos` (each
        `(frames, (width, height), fps)`), spread among the words after the first. Returns the processor's tensors
        (batch 1), plus `n_images` and `n_videos`."""
        rng = random.Random(seed)
        words = [rng.choice(WORDS) for _ in range(n_words)]
        kinds = ["image"] * len(image_sizes) + ["video"] * len(videos)
        rng.shuffle(kinds)
        slots = sorted(rng.sample(range(1, n_words), len(kinds))) if kinds else []
        parts, images, clips, metadata = [], [], [], []
        for i, word in enumerate(words):
            if i in slots:
                kind = kinds[slots.index(i)]
                if kind == "image":
                    parts.append(self.spec["prompt"])
                    images.append(photo(seed + len(images), image_sizes[len(images)]))
                else:
                    frames, size, fps = videos[len(clips)]
                    parts.append(video_prompt(self.model_type))
                    clips.append(clip(seed + len(clips), frames, size))
                    metadata.append({"total_num_frames": frames, "fps": fps, "width": size[0], "height": size[1]})
            parts.append(word)
        kwargs = {"videos": clips, "video_metadata": metadata} if clips else {}
        inputs = self.processor(text=[" ".join(parts)], images=images or None, return_tensors="pt", **kwargs)
        inputs = {key: value for key, value in dict(inputs).items() if key != "labels"}
        if "second_per_grid_ts" in inputs:
            inputs["second_per_grid_ts"] = torch.as_tensor(inputs["second_per_grid_ts"], dtype=torch.float32)
        inputs["n_images"], inputs["n_videos"] = len(images), len(clips)
        return inputs

