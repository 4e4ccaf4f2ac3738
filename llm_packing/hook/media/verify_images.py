"""The image part of `verify_packing`, for an image-text model given with its processor.

One packed row holds a text document, a document with two images of different shapes (made by the model's own
processor, so placeholders, pixels and grids are what training sees) and another text document, then padding. For a
type that packs videos (`support.video.VIDEO_TYPES`) whose processor has a video processor, the document holds a video
too (8 frames of seeded noise at 4 fps, sampled by the video processor as in training). The
image document's media go to the model as the processor made them; its token-aligned columns (`mm_token_type_ids`,
`token_type_ids`, Mllama's `cross_attention_mask`) are laid into the row at the document's place. Each document's
packed logits are compared with its logits alone. Cost: one packed forward and the image document alone.
"""

import numpy as np
import torch

from ...errors import PackingTypeError
from .image_text import causal_through_token_types


IMAGE_SIZES = ((56, 84), (84, 56))  # (width, height): a tall and a wide image
VIDEO_FRAMES, VIDEO_FPS, VIDEO_SIZE = 8, 4.0, (56, 56)  # a 2-second clip
PADDING = 3
# Columns of a processor output with one entry per token (along dimension 1), laid into the packed row.
_TOKEN_COLUMNS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "cross_attention_mask")


def includes_video(model_type: str, processor) -> bool:
    """Whether the image document of `processor` holds a video: its type packs videos, and it has a video processor."""
    from ..support.video import VIDEO_TYPES

    return model_type in VIDEO_TYPES and getattr(processor, "video_processor", None) is not None


def image_document(processor, seed: int, device, video: bool = False) -> dict[str, torch.Tensor]:
    """A short conversation with two images (seeded noise), processed by `processor` with its own placeholder
    (`processor.image_token`), the first image at the start; with `video`, a clip of seeded noise after them
    (`processor.video_token`)."""
    from PIL import Image

    placeholder = getattr(processor, "image_token", None)
    if not isinstance(placeholder, str):
        raise PackingTypeError(
            f"`processor` ({type(processor).__name__}) has no `image_token`: pass the model's own processor (e.g. "
            "`AutoProcessor.from_pretrained(checkpoint)`), whose `image_token` marks where an image goes."
        )
    generator = np.random.default_rng(seed)
    images = [Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8))
              for width, height in IMAGE_SIZES]
    # A word between the images: mRoPE's `get_rope_index` takes a run of image tokens for one image.
    text = f"{placeholder} describe {placeholder} these two pictures"
    kwargs = {}
    if video:
        width, height = VIDEO_SIZE
        kwargs = {"videos": [generator.integers(0, 256, (VIDEO_FRAMES, height, width, 3), dtype=np.uint8)],
                  "video_metadata": [{"total_num_frames": VIDEO_FRAMES, "fps": VIDEO_FPS}]}
        text += f" and {processor.video_token} this clip"
    output = dict(processor(text=[text], images=[images], return_tensors="pt", **kwargs))
    if "second_per_grid_ts" in output:  # Qwen2.5-VL returns a list: the model takes it as a tensor
        output["second_per_grid_ts"] = torch.as_tensor(output["second_per_grid_ts"], dtype=torch.float32)
    return {key: value.to(device) for key, value in output.items()
            if isinstance(value, torch.Tensor) and key != "labels"}


def packed_row(text_documents: list[torch.Tensor], document: dict[str, torch.Tensor], suffix_text: bool = False):
    """The packed inputs of one row `[text 0, image document, text 1, padding]` and the `(start, length)` of each of
    the three documents."""
    lengths = [len(text_documents[0]), document["input_ids"].shape[-1], len(text_documents[1])]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    columns = sum(lengths) + PADDING
    device = document["input_ids"].device
    inputs = {key: value for key, value in document.items() if key not in _TOKEN_COLUMNS}
    for key in _TOKEN_COLUMNS[2:]:
        if key in document:
            value = document[key]
            # PaliGemma's text documents are suffix (`token_type_ids` 1), as `verify_packing` runs them alone.
            fill = 1 if key == "token_type_ids" and suffix_text else 0
            column = torch.full((1, columns, *value.shape[2:]), fill, dtype=value.dtype, device=device)
            column[:, starts[1] : starts[1] + lengths[1]] = value
            inputs[key] = column
    input_ids = torch.zeros(1, columns, dtype=torch.long, device=device)
    attention_mask = torch.zeros(1, columns, dtype=torch.long, device=device)
    position_ids = torch.zeros(1, columns, dtype=torch.long, device=device)
    pieces = [text_documents[0], document["input_ids"][0], text_documents[1]]
    for number, (start, length, piece) in enumerate(zip(starts, lengths, pieces, strict=True), start=1):
        input_ids[0, start : start + length] = piece
        attention_mask[0, start : start + length] = number
        position_ids[0, start : start + length] = torch.arange(length, device=device)
    inputs.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return inputs, list(zip(starts, lengths, strict=True))


def image_row_difference(model, processor, text_documents, text_alone, seed: int, logits) -> float:
    """Largest difference between the packed row's documents and the same documents alone (the text documents'
    logits alone are `text_alone`); `logits(model, **inputs)` runs the model."""
    video = includes_video(model.config.model_type, processor)
    document = image_document(processor, seed, text_documents[0].device, video)
    inputs, spans = packed_row(text_documents, document, causal_through_token_types(model.config))
    packed = logits(model, **inputs)[0]
    alone = [text_alone[0], logits(model, **document)[0], text_alone[1]]
    return max((packed[start : start + length] - expected).abs().max().item()
               for (start, length), expected in zip(spans, alone, strict=True))
