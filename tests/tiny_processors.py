"""Image-text processors built offline, one per processor family, each with its own processor class.

Every processor gets the demo tokenizer (Mistral-7B's BPE, from `mistral-common`: real merges, so newlines and
spaces around image expansions tokenize as they would in a real checkpoint) with the family's special tokens added,
an image processor (the PIL one: no torchvision) sized so that images give a few to a few dozen tokens, and a chat
template that renders image parts as the family's checkpoints do and marks assistant turns with `{% generation %}`.
Photos are matplotlib's sample data, resized.
"""

import functools
import io
import os

import matplotlib
import transformers
from PIL import Image
from tiny_image_text import no_video, without_sub_processors

from llm_packing.demo.chitchat import _mistral_vocab_and_merges


SAMPLE_DATA = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data")
PHOTOS = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# (width, height): portrait, landscape, wide, square, large, tiny: sizes that resize, split and tile differently.
IMAGE_SIZES = [(56, 84), (112, 56), (168, 56), (84, 84), (300, 200), (20, 30)]


def photo(index: int, size: tuple[int, int]) -> Image.Image:
    """A real photo (matplotlib's sample data), resized to `size` = (width, height)."""
    image = Image.open(os.path.join(SAMPLE_DATA, PHOTOS[index % len(PHOTOS)])).convert("RGB")
    return image.resize(size, Image.BICUBIC)


def photo_bytes(index: int, size: tuple[int, int], format: str = "JPEG") -> bytes:
    file = io.BytesIO()
    photo(index, size).save(file, format=format)
    return file.getvalue()


def chat_template(image_prompt: str) -> str:
    """Role tokens, text parts after a space, image parts as `image_prompt`; assistant turns are generated."""
    parts = ("{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image_prompt
             + "{% else %} {{ part['text'] }}{% endif %}{% endfor %}")
    return (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}" + parts + "{{ '<|end|>' }}{% endgeneration %}"
        "{% else %}" + parts + "{{ '<|end|>' }}{% endif %}\n{% endfor %}"
    )


@functools.cache
def _vocab_and_merges():
    return _mistral_vocab_and_merges()


def make_tokenizer(named: dict[str, str], extra: list[str] = ()) -> transformers.PreTrainedTokenizerBase:
    """The demo BPE tokenizer with `named` special tokens (tokenizer attributes, e.g. `image_token`) and `extra`."""
    vocab, merges = _vocab_and_merges()
    tokenizer = transformers.LlamaTokenizer(vocab=dict(vocab), merges=list(merges), pad_token="<unk>",
                                            extra_special_tokens=dict(named))
    tokenizer.add_special_tokens({"additional_special_tokens": [*ROLE_TOKENS, *extra]},
                                 replace_extra_special_tokens=False)
    return tokenizer


def _qwen_image_processor(patch_size=14):
    # Pixel budget small enough for tiny rows: images of 2 to 16 merged tokens.
    return transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": (2 * patch_size) ** 2, "longest_edge": (2 * patch_size) ** 2 * 16},
        patch_size=patch_size, merge_size=2, temporal_patch_size=2,
    )


_QWEN = {"tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
             "extra": ["<|vision_start|>", "<|vision_end|>"], "prompt": "<|vision_start|><|image_pad|><|vision_end|>"}
_IDEFICS3_EXTRA = (["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
                   + [f"<row_{i}_col_{j}>" for i in range(1, 4) for j in range(1, 4)])
_PINPOINTS = [[56, 112], [112, 56], [112, 112]]

SPECS = {
    "qwen2_vl": dict(**_QWEN, processor=lambda tok: no_video(transformers.Qwen2VLProcessor)(
        _qwen_image_processor(), tok)),
    "qwen2_5_vl": dict(**_QWEN, processor=lambda tok: no_video(transformers.Qwen2_5_VLProcessor)(
        _qwen_image_processor(), tok)),
    "qwen3_vl": dict(**_QWEN, processor=lambda tok: no_video(transformers.Qwen3VLProcessor)(
        _qwen_image_processor(16), tok)),
    "glm4v": {
        "tokens": {"image_token": "<|image|>", "video_token": "<|video|>"},
        "extra": ["<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"],
        "prompt": "<|begin_of_image|><|image|><|end_of_image|>",
        "processor": lambda tok: no_video(transformers.Glm4vProcessor)(transformers.Glm4vImageProcessorPil(
            size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}, patch_size=14, merge_size=2,
            temporal_patch_size=2), tok),
    },
    "llava": {
        "tokens": {"image_token": "<image>"}, "prompt": "<image>",
        "processor": lambda tok: transformers.LlavaProcessor(
            transformers.LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
            tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    },
    "llava_next": {
        "tokens": {"image_token": "<image>"}, "prompt": "<image>",
        "processor": lambda tok: transformers.LlavaNextProcessor(
            transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                                    image_grid_pinpoints=_PINPOINTS),
            tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    },
    "llava_onevision": {
        "tokens": {"image_token": "<image>", "video_token": "<video>"}, "prompt": "<image>",
        "processor": lambda tok: no_video(transformers.LlavaOnevisionProcessor)(
            transformers.LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56},
                                                         image_grid_pinpoints=_PINPOINTS),
            tok, num_image_tokens=16, vision_feature_select_strategy="full"),
    },
    "gemma3": {
        "tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                   "eoi_token": "<end_of_image>"},
        "prompt": "<start_of_image>",
        "processor": lambda tok: transformers.Gemma3Processor(
            transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}), tok, image_seq_length=4),
    },
    "idefics3": {
        "tokens": {"image_token": "<image>"}, "extra": _IDEFICS3_EXTRA, "prompt": "<image>",
        "processor": lambda tok: transformers.Idefics3Processor(
            transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
            tok, image_seq_len=1),
    },
    "internvl": {
        "tokens": {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"},
        "prompt": "<IMG_CONTEXT>",
        "processor": lambda tok: no_video(transformers.InternVLProcessor)(
            transformers.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                                  min_patches=1, max_patches=4), tok, image_seq_length=1),
    },
    "aya_vision": {
        "tokens": {}, "extra": ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>",
                          "TILE", "TILE_GLOBAL"] + [f"TILE_{i}" for i in range(1, 6)],
        "prompt": "<image>",
        "processor": lambda tok: transformers.AyaVisionProcessor(
            transformers.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                                  min_patches=1, max_patches=4),
            tok, patch_size=14, img_size=28, downsample_factor=2),
    },
    "mllama": {
        "tokens": {"image_token": "<|image|>"}, "extra": ["<|python_tag|>"], "prompt": "<|image|>",
        "processor": lambda tok: transformers.MllamaProcessor(
            transformers.MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2), tok),
    },
    "gemma4": {
        "tokens": {"image_token": "<|image|>", "boi_token": "<|image_start|>", "eoi_token": "<|image_end|>",
                "audio_token": "<|audio|>", "boa_token": "<|audio_start|>", "eoa_token": "<|audio_end|>"},
        "extra": ["<|video|>"], "prompt": "<|image|>",
        "processor": lambda tok: without_sub_processors(
            transformers.Gemma4Processor, "feature_extractor", "video_processor")(
            None, transformers.Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=70, pooling_kernel_size=2),
            tok, None, image_seq_length=70),
    },
}
# Processor families whose planning is proven (tests/test_image_text_plan.py): every spec.
FAMILIES = tuple(SPECS)


@functools.cache
def tiny_processor(family: str):
    """The processor of `family` (a cached instance: do not modify it)."""
    return make_processor(family)


def make_processor(family: str):
    """A new processor of `family`, with its chat template."""
    spec = SPECS[family]
    processor = spec["processor"](make_tokenizer(spec["tokens"], spec.get("extra", ())))
    processor.chat_template = chat_template(spec["prompt"])
    return processor


# Tiny image-text models for the processors above: the tests' shrink (tests/tiny_models.py) plus vision towers small
# enough for CPU, the processor's token ids written into the config, the vocabulary the tokenizer's.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
MODEL_CONFIGS = {
    "qwen2_5_vl": {
        # Window attention over 2x2 merged tokens (56 px) in block 0, full attention in block 1.
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]},
        "text_config": {"rope_parameters": _MROPE},
        "token_ids": {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                      "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"},
    },
    # 56 px images, 14 px patches (4 x 4), pooled to 2 x 2 = 4 soft tokens per image; image tokens attend both ways.
    "gemma3": {"vision_config": {"image_size": 56, "patch_size": 14}, "mm_tokens_per_image": 4,
               "token_ids": {"image_token_id": "<image_soft_token>", "boi_token_id": "<start_of_image>",
                             "eoi_token_id": "<end_of_image>"}},
    # CLIP tower at 56 px / 14 px patches: 16 tokens per image (CLS dropped).
    "llava": {"vision_config": {"image_size": 56, "patch_size": 14}, "image_seq_length": 16,
              "token_ids": {"image_token_id": "<image>"}},
}


def tiny_image_text_model(family: str, processor, attn_implementation: str = "sdpa", seed: int = 0):
    """A randomly initialised float32 model of `family` matching `processor` (its token ids and vocabulary)."""
    import torch
    from tiny_models import tiny_config

    spec = dict(MODEL_CONFIGS[family])
    token_ids = {field: processor.tokenizer.convert_tokens_to_ids(token)
                 for field, token in spec.pop("token_ids").items()}
    vocab = len(processor.tokenizer)
    text = {**spec.pop("text_config", {}), "vocab_size": vocab}
    config = tiny_config(family, text_config=text, **spec)
    for part in (config, getattr(config, "text_config", None)):
        for field, value in {**token_ids, "vocab_size": vocab}.items():
            if part is not None and (hasattr(part, field) or field in getattr(part, "attribute_map", {})):
                setattr(part, field, value)
        if part is not None:
            part.use_cache = False
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32)
    with torch.no_grad():  # matrices initialised at 0 (Gemma 3's projection) would hide the images from the text
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.normal_(std=0.02)
    return model
