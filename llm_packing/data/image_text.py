"""The true token count of an image-text conversation, planned without decoding a pixel.

A processor expands each image placeholder of the chat text into the tokens the model fills with image features, as
many as the image's size gives. The planner does what the processor's own text path does (`apply_chat_template`
without tokenizing, `prepare_inputs_layout`, `replace_image_token` per image, `get_text_with_replacements`, then the
tokenizer), except that `replace_image_token` is handed the few numbers it reads, worked out from each image's
(width, height) as read from its file header, instead of processed pixels. Building the expansion string and
tokenizing it is exact where counting placeholders is not (Idefics3's split images add newlines that merge with the
text around them).

Videos (`{"type": "video"}` parts, a `videos` column) are planned the same way from their container headers
(`video.py`: frame count, rate and size; the video processor's own frame sampling; `replace_video_token`).

`HEADER_RULES` says, per processor class, which inputs `replace_image_token` needs and how they follow from the
sizes; each rule is checked against the processor's real expansion in `tests/test_image_text_plan.py`. A processor
without a rule, or set up in a way its rule does not cover (Gemma 3's pan-and-scan, LLaVA without a center crop), is
planned with stand-in images: blank images of each image's size, run through the processor. That is exact too, but
pays for resizing and normalising them.
"""

import logging
from collections.abc import Callable

import numpy as np

from ..core.image_text import image_size, structured_messages
from ..errors import PackingValueError
from .video import video_header, video_replacement


logger = logging.getLogger(__name__)


def _grid(processor, sizes):
    # Qwen2-VL family: `image_grid_thw` rows whose product is the image's patch count.
    patches = [processor.image_processor.get_number_of_image_patches(height, width, {}) for width, height in sizes]
    return {"image_grid_thw": np.array([[1, 1, count] for count in patches], dtype=np.int64)}


def _center_crop(processor, sizes):
    # LLaVA: the height and width of the processed image, the center crop.
    image_processor = processor.image_processor
    if not getattr(image_processor, "do_center_crop", False):
        return None
    crop = image_processor.crop_size
    return {"pixel_values": [_blank_shape(crop["height"], crop["width"])] * len(sizes)}


def _any_resolution(processor, sizes):
    # LLaVA-NeXT / OneVision: each image's original size, the patch size (the crop), and how many images the
    # conversation has (OneVision gives every image of a multi-image conversation a fixed count).
    crop = getattr(processor.image_processor, "crop_size", None) or processor.image_processor.size
    return {"image_sizes": [[height, width] for width, height in sizes],
            "pixel_values": [[_blank_shape(crop["height"], crop["width"])]], "batch_num_images": [len(sizes)]}


def _no_crops(processor, sizes):
    # Gemma 3: one image sequence per image, unless pan-and-scan adds crops (their count depends on the size).
    if getattr(processor.image_processor, "do_pan_and_scan", False):
        return None
    return {"num_crops": [0] * len(sizes)}


def _rows_and_columns(processor, sizes):
    # Idefics3: the tiles an image is split into, by rows and columns.
    tiles = [processor.image_processor.get_number_of_image_patches(height, width, {}) for width, height in sizes]
    return {"rows": [[rows for _, rows, _ in tiles]], "cols": [[columns for _, _, columns in tiles]]}


def _tile_count(processor, sizes):
    # InternVL / Aya Vision: tiles per image, the thumbnail included.
    return {"num_patches": [processor.image_processor.get_number_of_image_patches(height, width, {})
                            for width, height in sizes]}


def _soft_tokens(processor, sizes):
    # Gemma 4: soft tokens per image, from its aspect-preserving resize.
    counts = processor._get_num_multimodal_tokens(image_sizes=[(height, width) for width, height in sizes])
    return {"num_soft_tokens_per_image": list(counts["num_image_tokens"])}


def _nothing(processor, sizes):
    # Mllama: cross-attention; the placeholder stays one token.
    return {}


# Processor class name -> how `replace_image_token`'s inputs follow from the images' (width, height). A subclass
# (e.g. a processor without its video processor) takes its base class's rule.
HEADER_RULES: dict[str, Callable] = {
    **dict.fromkeys(("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Glm4vProcessor",
                     "Glm46VProcessor"), _grid),
    "LlavaProcessor": _center_crop,
    **dict.fromkeys(("LlavaNextProcessor", "LlavaOnevisionProcessor"), _any_resolution),
    "Gemma3Processor": _no_crops,
    "Idefics3Processor": _rows_and_columns,
    **dict.fromkeys(("InternVLProcessor", "AyaVisionProcessor"), _tile_count),
    "Gemma4Processor": _soft_tokens,
    "MllamaProcessor": _nothing,
}


def _blank_shape(height: int, width: int) -> np.ndarray:
    """A (3, height, width) array that takes no memory: the shape is all `replace_image_token` reads."""
    return np.broadcast_to(np.zeros((), np.float32), (3, height, width))


def header_rule(processor) -> Callable | None:
    """The `HEADER_RULES` entry of `processor`'s class (or of the nearest base class that has one)."""
    for cls in type(processor).__mro__:
        if cls.__name__ in HEADER_RULES:
            return HEADER_RULES[cls.__name__]
    return None


class ConversationPlanner:
    """
    Token counts of image-text conversations, as `processor.apply_chat_template(..., tokenize=True)` gives them
    (TRL's vision collator's call, `add_special_tokens=False`), from the text and the images' header sizes.

    Args:
        processor (`ProcessorMixin`):
            The processor training will use.
        chat_template (`str`, *optional*):
            A chat template other than the processor's, as `SFTConfig.chat_template_path` gives TRL's collator.
    """

    def __init__(self, processor, chat_template: str | None = None):
        self.processor, self.chat_template = processor, chat_template
        self.rule = header_rule(processor)
        self._told = False

    def plan(self, messages: list[dict], images: list, where: str, videos: list | None = None) -> tuple[int, int]:
        """
        `(tokens, media_end)` of one conversation: its token count with every image and video placeholder expanded,
        and the tokens up to the end of its last image's or video's expansion (0 without either). Videos are planned
        from their container headers (`data/video.py`). `where` names the row in errors.
        """
        videos = list(videos or [])
        structured = structured_messages(messages, images, where, videos)
        text = self.processor.apply_chat_template(structured, chat_template=self.chat_template, tokenize=False)
        sizes = [image_size(image, f"image {i} of {where}") for i, image in enumerate(images or [])]
        video_replacements = [video_replacement(self.processor, video_header(video, f"video {i} of {where}"),
                                                f"video {i} of {where}") for i, video in enumerate(videos)]
        for kind, count in (("image", len(sizes)), ("video", len(videos))):
            _check_placeholders(self.processor, text, kind, count, where)
        inputs = self.rule(self.processor, sizes) if self.rule is not None and sizes else None
        if sizes and inputs is None:
            if videos:
                raise PackingValueError(
                    f"{where} holds videos, and {type(self.processor).__name__} as set up has no header-only rule for "
                    "its images: conversations with both cannot be planned. Pack its video rows unpacked."
                )
            return self._plan_with_stand_ins(text, sizes)
        text = self.processor.prepare_inputs_layout(images=None, text=[text])[1][0]
        replacements = [self.processor.replace_image_token(inputs, image_idx=i) for i in range(len(sizes))]
        (text,), (offsets,) = self._expanded(text, replacements, video_replacements)
        encoding = self.processor.tokenizer(text, add_special_tokens=False)
        tokens = len(encoding["input_ids"])
        media_end = max((offset["new_span"][1] for offset in offsets), default=0)
        return tokens, _token_end(encoding, media_end, tokens) if offsets else 0

    def _expanded(self, text: str, replacements: list[str], video_replacements: list[str]):
        if not replacements and not video_replacements:
            return [text], [[]]
        return self.processor.get_text_with_replacements([text], images_replacements=replacements,
                                                         videos_replacements=video_replacements)

    def _plan_with_stand_ins(self, text: str, sizes: list[tuple[int, int]]) -> tuple[int, int]:
        from PIL import Image

        if not self._told:
            logger.info("%s has no header-only rule for its settings: planning with blank stand-in images of each "
                        "image's size (exact, but each is resized and normalised)", type(self.processor).__name__)
            self._told = True
        stand_ins = [Image.new("RGB", size) for size in sizes]
        output = self.processor(text=[text], images=stand_ins, add_special_tokens=False,
                                return_text_replacement_offsets=True)
        ids = output["input_ids"][0]
        offsets = output.get("text_replacement_offsets")
        if not offsets or not offsets[0]:  # a processor that does not report where images went: the last image id
            return len(ids), _last_media_token(self.processor, ids) + 1
        return len(ids), _token_end(output, offsets[0][-1]["new_span"][1], len(ids))


def _check_placeholders(processor, text: str, kind: str, count: int, where: str) -> None:
    token = getattr(processor, f"{kind}_token", None)
    if token is not None and text.count(token) != count:
        raise PackingValueError(
            f"{where}: its chat text holds {text.count(token)} {kind} placeholder(s) {token!r} for {count} {kind}(s): "
            f"the processor would refuse it, or pair text and {kind}s wrongly. Remove {token!r} from that row's "
            f"message texts, give it one {kind} per placeholder, or use a chat template that renders "
            f"`{{'type': '{kind}'}}` parts."
        )


def _token_end(encoding, character_end: int, tokens: int) -> int:
    """The number of tokens up to and including the one holding character `character_end - 1` of the text."""
    for character in range(character_end - 1, -1, -1):
        token = encoding.char_to_token(0, character) if hasattr(encoding, "char_to_token") else None
        if token is not None:
            return token + 1
    return tokens


def _last_media_token(processor, ids) -> int:
    media = {getattr(processor, name, None) for name in ("image_token_id", "video_token_id")} - {None}
    positions = [i for i, token in enumerate(ids) if token in media]
    return positions[-1] if positions else len(ids) - 1
