"""Built-in video demo: short clips made from matplotlib's sample photos, and a tiny Qwen2.5-VL processor with video.

- Clips: each photo of `demo.photos` panned (and, for every other clip, zoomed) frame by frame, 4 to 16 frames at 4
  or 8 frames a second, 48 to 96 pixels a side, written as H.264 MP4 bytes with PyAV: real video files, nothing
  downloaded.
- Conversations: the `"photos"` demo's format (`messages` + `images`) with a `videos` column
  (`datasets.Video(decode=False)`, MP4 bytes); questions about one or two clips, a clip and a photo, a photo alone, or
  no media, answered with the photos' captions.
- Processor: the `"demo-qwen2.5-vl"` one with Qwen2-VL's video processor (2 frames a second, at most 16 merged
  tokens a frame) and a chat template that renders `{"type": "video"}` parts.

transformers' video processors resize and normalise with torchvision. Where torchvision cannot be imported (a CPU
torch without a matching torchvision build), the demo's video processor is the same class with those two kernels in
torch (antialiased bicubic resize, normalize): frame sampling, sizes, grids and token counts are the class's own;
pixel values differ slightly from torchvision's. PyAV (`av`) and matplotlib are in the `demo` extra.
"""

import functools
import io


DEMO_VIDEO_DATASET_NAME = "clips"
DEMO_VIDEO_PROCESSOR_NAME = "demo-qwen2.5-vl-video"

# (frames, fps, (width, height)) of each clip: short and long, slow and fast, landscape, portrait, square.
_CLIPS = ((8, 4, (64, 48)), (12, 4, (48, 64)), (4, 4, (56, 56)), (16, 8, (96, 56)), (6, 4, (48, 96)),
          (10, 8, (72, 72)))
_QUESTIONS = ("What happens in this clip?", "Describe the video.", "What does the camera show?")
_VIDEO_PARTS = "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"


def demo_clip_bytes(index: int) -> bytes:
    """Clip `index` of `_CLIPS` (photo `index` of the demo's), as H.264 MP4 bytes."""
    import av
    import numpy as np
    from PIL import Image

    from .photos import demo_images

    frames, fps, (width, height) = _CLIPS[index % len(_CLIPS)]
    data, _ = demo_images()[index % len(demo_images())]
    with Image.open(io.BytesIO(data)) as opened:
        photo = np.asarray(opened.convert("RGB").resize((2 * width, 2 * height), Image.BICUBIC))
    file = io.BytesIO()
    with av.open(file, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in range(frames):
            shift = frame * max(1, width // (2 * frames))
            zoom = frame * (index % 2)  # every other clip zooms in while it pans
            window = photo[shift // 2 + zoom : shift // 2 + height + zoom, shift : shift + width]
            picture = Image.fromarray(np.ascontiguousarray(window)).resize((width, height), Image.BICUBIC)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(picture), format="rgb24")))
        container.mux(stream.encode())
    return file.getvalue()


def load_clip_conversations(max_conversations: int | None = None):
    """
    The demo's video conversations as a `datasets.Dataset` (`messages`, `images` of `datasets.Image`, `videos` of
    `datasets.Video(decode=False)`, MP4 bytes), the same on every run.
    """
    import datasets

    from .photos import demo_images

    images = demo_images()
    clips = [demo_clip_bytes(index) for index in range(len(_CLIPS))]
    rows = []
    for i, (data, caption) in enumerate(images):
        clip = clips[i % len(clips)]
        question = _QUESTIONS[i % len(_QUESTIONS)]
        kind = i % 4
        if kind == 0:
            row = ([clip], [], question, f"The camera pans across this: {caption}")
        elif kind == 1:
            row = ([clip, clips[(i + 1) % len(clips)]], [], "What do these two clips show?",
                   f"The first pans across this: {caption} The second shows another photo in motion.")
        elif kind == 2:
            row = ([clip], [data], "Is the photo in the clip?", f"The photo shows this: {caption}")
        else:
            row = ([], [data], "Describe the image.", caption)
        videos, photos, question, answer = row
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                     "images": photos, "videos": [{"bytes": video, "path": None} for video in videos]})
    rows = rows[:max_conversations]
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
        "videos": datasets.List(datasets.Video(decode=False)),
    })
    return datasets.Dataset.from_list(rows, features=features)


def load_demo_video_processor():
    """
    The `"demo-qwen2.5-vl"` processor with a Qwen2-VL video processor: 2 frames a second, 4 to 16 merged tokens a
    frame.

    Example:
    ```python
    >>> processor = load_demo_video_processor()
    >>> processor.video_token, type(processor.video_processor).__name__
    ('<|video_pad|>', 'Qwen2VLVideoProcessor')

    ```
    """
    import transformers

    from .photos import DEMO_IMAGE_TEXT_CHAT_TEMPLATE, load_demo_processor

    images = load_demo_processor()
    video_processor = _qwen2_vl_video_processor()(
        size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}, patch_size=14, merge_size=2,
        temporal_patch_size=2, do_sample_frames=True, fps=2.0, min_frames=2, max_frames=16, cap_pixels_per_frame=False)

    class Qwen2_5_VLProcessor(transformers.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":  # a class of transformers' own, maybe with torch kernels
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    chat_template = DEMO_IMAGE_TEXT_CHAT_TEMPLATE.replace("{% else %}{{ part['text'] }}",
                                                          _VIDEO_PARTS + "{% else %}{{ part['text'] }}")
    return Qwen2_5_VLProcessor(image_processor=images.image_processor, tokenizer=images.tokenizer,
                               video_processor=video_processor, chat_template=chat_template)


@functools.cache
def _qwen2_vl_video_processor():
    """Qwen2-VL's video processor class; without torchvision, with torch resize and normalize kernels."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or built for another torch
        pass
    else:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        return Qwen2VLVideoProcessor
    from .torch_video_kernels import import_without_torchvision, with_torch_kernels

    module = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    return with_torch_kernels(module.Qwen2VLVideoProcessor)
