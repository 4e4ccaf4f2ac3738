"""Tiny image-text models with their own processors, built offline, and real photos to feed them.

For each model type of `SPECS`: a tiny config (`tiny_models.tiny_config` plus the vision sizes below), a WordLevel
tokenizer holding the model's special tokens (ids below 128, written into the config's token-id fields), and the
model's own processor class around its PIL image processor, sized to the tiny vision tower (no torchvision, no hub).
`TinyImageText(model_type).document(n_words, image_sizes, seed)` is one processed conversation: input_ids with the
placeholders expanded, pixel tensors, grids, ..., exactly what the model's processor gives for it. The photos are
matplotlib's sample data (`mpl-data/sample_data`), resized.

Weights that a model initialises at zero would make its images invisible to the text (Gemma 3's
`mm_input_projection_weight`, Mllama's cross-attention gates), so that a parity test could pass without the images
mattering: they are re-drawn (see `TinyImageText.__init__`; `tests/test_image_text_parity.py` checks that replacing a
document's pixels by noise moves its logits).
"""

import os
import random

import matplotlib
import torch
import transformers
from PIL import Image
from tiny_models import VOCAB_SIZE, tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.processing_utils import ProcessorMixin


SAMPLE_DATA = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data")
PHOTOS = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")
WORDS = [f"w{i}" for i in range(40)]


def photo(index: int, size: tuple[int, int]) -> Image.Image:
    """A real photo (matplotlib's sample data), resized to `size` = (width, height)."""
    image = Image.open(os.path.join(SAMPLE_DATA, PHOTOS[index % len(PHOTOS)])).convert("RGB")
    return image.resize(size, Image.BICUBIC)


def make_tokenizer(named: dict[str, str], extra=()) -> PreTrainedTokenizerFast:
    """WordLevel tokenizer: 4 control tokens, `WORDS`, then the model's special tokens (`named` become tokenizer
    attributes, e.g. `tokenizer.image_token`; `extra` are plain added special tokens)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens=dict(named),
    )
    if extra:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra)}, replace_extra_special_tokens=False)
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    return tokenizer


def without_sub_processors(processor_class, *names):
    """`processor_class` without the sub-processors `names` (video processors and audio feature extractors need
    torchvision or audio packages; the tiny documents hold images only)."""

    class DropNamed(ProcessorMixin):
        # Sits between the processor and ProcessorMixin in the MRO: drops the keyword sub-processors left out.
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{k: v for k, v in kwargs.items() if k not in names})

    class Without(processor_class, DropNamed):
        @classmethod
        def get_attributes(cls):
            return [name for name in super().get_attributes() if name not in names]

    Without.__name__ = processor_class.__name__ + "Without"
    return Without


def no_video(processor_class):
    return without_sub_processors(processor_class, "video_processor")


class PixtralStandIn:
    """PixtralProcessor's placeholder expansion (its `replace_image_token`, copied): the class itself cannot be
    imported without torchvision (processing_pixtral imports a helper of the torchvision image processor)."""

    image_token = "[IMG]"

    def __init__(self, image_processor, tokenizer, patch_size, spatial_merge_size):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.step = patch_size * spatial_merge_size

    def __call__(self, text, images=None, return_tensors="pt"):
        (text,) = text
        out = {}
        if images:
            out = dict(self.image_processor(images[0], return_tensors="pt"))
            pieces = text.split("[IMG]")
            expanded = pieces[0]
            for (height, width), piece in zip(out["image_sizes"].tolist(), pieces[1:], strict=True):
                rows = [["[IMG]"] * (width // self.step) + ["[IMG_BREAK]"]] * (height // self.step)
                tokens = [token for row in rows for token in row]
                tokens[-1] = "[IMG_END]"
                expanded += "".join(tokens) + piece
            text = expanded
        out.update(self.tokenizer([text], return_tensors=return_tensors))
        return out


def _with_seq_length(image_processor, length):
    image_processor.image_seq_length = length
    return image_processor


def _qwen_image_processor(patch_size=14):
    # A pixel budget small enough for tiny rows: images of 2 to 12 merged tokens.
    return transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": (2 * patch_size) ** 2, "longest_edge": (2 * patch_size) ** 2 * 16},
        patch_size=patch_size, merge_size=2, temporal_patch_size=2,
    )


_QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
_QWEN_EXTRA = ["<|vision_start|>", "<|vision_end|>"]
_QWEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_QWEN_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN = {"tokens": _QWEN_TOKENS, "extra": _QWEN_EXTRA, "ids": _QWEN_IDS, "prompt": _QWEN_PROMPT}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
_QWEN3_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE, "head_dim": 16,
               "rope_parameters": {**_MROPE, "mrope_section": [2, 2, 2], "mrope_interleaved": True}}
_QWEN3_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                 "num_position_embeddings": 64}
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                 "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_QWEN3_5_TEXT = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 4,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"], "rope_parameters": _QWEN3_5_ROPE,
}
_TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 32}
_PINPOINTS = [[56, 112], [112, 56], [112, 112]]
_IDEFICS3_EXTRA = (["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
                   + [f"<row_{i}_col_{j}>" for i in range(1, 4) for j in range(1, 4)])
_LLAVA_TOKENS = {"tokens": {"image_token": "<image>"}, "ids": {"image_token_id": "<image>"}, "prompt": "<image>"}


# model_type -> config overrides, tokenizer tokens (`tokens`: named, `extra`: plain), config token ids (`ids`), the
# placeholder written in the text where an image goes (`prompt`), and the processor built around the tokenizer.
SPECS = {
    "qwen2_vl": {
        **_QWEN,
        "config": {
            "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
            "text_config": {"rope_parameters": _MROPE},
        },
        "processor": lambda tok: no_video(transformers.Qwen2VLProcessor)(_qwen_image_processor(), tok),
    },
    "qwen2_5_vl": {
        **_QWEN,
        # Window attention over 2 x 2 merged tokens (56 px) in block 0, full attention in block 1.
        "config": {
            "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]},
            "text_config": {"rope_parameters": _MROPE},
        },
        "processor": lambda tok: no_video(transformers.Qwen2_5_VLProcessor)(_qwen_image_processor(), tok),
    },
    "qwen3_vl": {
        **_QWEN,
        "config": {"vision_config": {**_QWEN3_VISION, "deepstack_visual_indexes": [0]}, "text_config": _QWEN3_TEXT},
        "processor": lambda tok: no_video(transformers.Qwen3VLProcessor)(_qwen_image_processor(16), tok),
    },
    "qwen3_vl_moe": {
        **_QWEN,
        "config": {
            "vision_config": {**_QWEN3_VISION, "deepstack_visual_indexes": [0]},
            "text_config": {**_QWEN3_TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        },
        "processor": lambda tok: no_video(transformers.Qwen3VLProcessor)(_qwen_image_processor(16), tok),
    },
    # Gated delta net + attention text model, tiny vision tower.
    "qwen3_5": {
        **_QWEN,
        "config": {"vision_config": _QWEN3_VISION, "text_config": _QWEN3_5_TEXT},
        "processor": lambda tok: no_video(transformers.Qwen3VLProcessor)(_qwen_image_processor(16), tok),
    },
    "qwen3_5_moe": {
        **_QWEN,
        "config": {"vision_config": _QWEN3_VISION, "text_config": {**_QWEN3_5_TEXT, **_TINY_EXPERTS}},
        "processor": lambda tok: no_video(transformers.Qwen3VLProcessor)(_qwen_image_processor(16), tok),
    },
    "glm4v": {
        "config": {
            "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 64, "image_size": 56},
            "text_config": {"rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}},
        },
        "tokens": {"image_token": "<|image|>", "video_token": "<|video|>"},
        "extra": ["<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"],
        "ids": {"image_token_id": "<|image|>", "video_token_id": "<|video|>",
                "image_start_token_id": "<|begin_of_image|>", "image_end_token_id": "<|end_of_image|>",
                "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>"},
        "prompt": "<|begin_of_image|><|image|><|end_of_image|>",
        "processor": lambda tok: no_video(transformers.Glm4vProcessor)(transformers.Glm4vImageProcessorPil(
            size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}, patch_size=14, merge_size=2,
            temporal_patch_size=2), tok),
    },
    "gemma3": {
        # 56 px images, 14 px patches (4 x 4), pooled to 2 x 2 = 4 soft tokens per image.
        "config": {"vision_config": {"image_size": 56, "patch_size": 14}, "mm_tokens_per_image": 4},
        "tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                   "eoi_token": "<end_of_image>"},
        "ids": {"image_token_id": "<image_soft_token>", "boi_token_id": "<start_of_image>",
                "eoi_token_id": "<end_of_image>"},
        "prompt": "<start_of_image>",
        "processor": lambda tok: transformers.Gemma3Processor(
            transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}), tok, image_seq_length=4),
    },
    "gemma4": {
        # Variable resolution (8 px patches, 2 x 2 pooling, at most 70 soft tokens per image), bidirectional
        # attention over vision tokens (`use_bidirectional_attention="vision"`), sliding and full text layers.
        "config": {
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                              "head_dim": 16, "patch_size": 8, "pooling_kernel_size": 2,
                              "position_embedding_size": 64},
            "text_config": {"global_head_dim": 32, "use_bidirectional_attention": "vision"},
            "audio_config": None,
        },
        # Gemma4Processor requires the audio tokens even without audio (the checkpoints' tokenizers have them).
        "tokens": {"image_token": "<|image|>", "boi_token": "<|image_start|>", "eoi_token": "<|image_end|>",
                   "audio_token": "<|audio|>", "boa_token": "<|audio_start|>", "eoa_token": "<|audio_end|>"},
        "extra": ["<|video|>"],
        "ids": {"image_token_id": "<|image|>", "boi_token_id": "<|image_start|>", "eoi_token_id": "<|image_end|>",
                "video_token_id": "<|video|>"},
        "prompt": "<|image|>",
        "processor": lambda tok: without_sub_processors(
            transformers.Gemma4Processor, "feature_extractor", "video_processor")(
            None, transformers.Gemma4ImageProcessorPil(patch_size=8, max_soft_tokens=70, pooling_kernel_size=2),
            tok, None, image_seq_length=70),
    },
    "paligemma": {
        # Prefix-LM: image + prompt attend both ways (block 0 from token_type_ids == 0), the suffix causally.
        "config": {"vision_config": {"image_size": 56, "patch_size": 14}, "projection_dim": 64},
        "tokens": {"image_token": "<image>"}, "ids": {"image_token_id": "<image>"}, "prompt": "",
        "processor": lambda tok: transformers.PaliGemmaProcessor(_with_seq_length(
            transformers.SiglipImageProcessorPil(size={"height": 56, "width": 56}), 16), tok),
        "images_first": True,
    },
    "llava": {
        **_LLAVA_TOKENS,
        # CLIP tower at 56 px / 14 px patches: 16 tokens per image (CLS dropped, strategy "default").
        "config": {"vision_config": {"image_size": 56, "patch_size": 14}, "image_seq_length": 16},
        "processor": lambda tok: transformers.LlavaProcessor(
            transformers.LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
            tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    },
    "llava_next": {
        **_LLAVA_TOKENS,
        "config": {"vision_config": {"image_size": 56, "patch_size": 14}, "image_grid_pinpoints": _PINPOINTS},
        "processor": lambda tok: transformers.LlavaNextProcessor(
            transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                                    image_grid_pinpoints=_PINPOINTS),
            tok, patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1),
    },
    "llava_onevision": {
        "config": {"vision_config": {"image_size": 56, "patch_size": 14}, "image_grid_pinpoints": _PINPOINTS},
        "tokens": {"image_token": "<image>", "video_token": "<video>"},
        "ids": {"image_token_id": "<image>", "video_token_id": "<video>"}, "prompt": "<image>",
        "processor": lambda tok: no_video(transformers.LlavaOnevisionProcessor)(
            transformers.LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56},
                                                         image_grid_pinpoints=_PINPOINTS),
            tok, num_image_tokens=16, vision_feature_select_strategy="full"),
    },
    "vipllava": {
        **_LLAVA_TOKENS,
        "config": {"vision_config": {"image_size": 56, "patch_size": 14}, "vision_feature_layers": [-2, -1]},
        "processor": lambda tok: transformers.LlavaProcessor(
            transformers.CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
            tok, patch_size=14, vision_feature_select_strategy="full", num_additional_image_tokens=0),
    },
    "idefics2": {
        # Perceiver resampler: 4 latents per image.
        "config": {
            "vision_config": {"image_size": 32, "patch_size": 16},
            "perceiver_config": {"resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 2,
                                 "resampler_head_dim": 16, "num_key_value_heads": 1},
        },
        "tokens": {}, "extra": ["<fake_token_around_image>", "<image>", "<end_of_utterance>"],
        "ids": {"image_token_id": "<image>"}, "prompt": "<image>",
        "processor": lambda tok: transformers.Idefics2Processor(
            transformers.Idefics2ImageProcessorPil(size={"shortest_edge": 32, "longest_edge": 32},
                                                   do_image_splitting=False), tok, image_seq_len=4),
    },
    "idefics3": {
        # 32 px tiles of 16 px patches (2 x 2), scale factor 2: 1 token per tile; images split into up to 2 x 2
        # tiles plus the global image, so the token count depends on the image size.
        "config": {"vision_config": {"image_size": 32, "patch_size": 16}, "scale_factor": 2},
        "tokens": {"image_token": "<image>"}, "extra": _IDEFICS3_EXTRA, "ids": {"image_token_id": "<image>"},
        "prompt": "<image>",
        "processor": lambda tok: transformers.Idefics3Processor(
            transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
            tok, image_seq_len=1),
    },
    "smolvlm": {
        "config": {"vision_config": {"image_size": 32, "patch_size": 16}, "scale_factor": 2},
        "tokens": {"image_token": "<image>"}, "extra": _IDEFICS3_EXTRA, "ids": {"image_token_id": "<image>"},
        "prompt": "<image>",
        "processor": lambda tok: no_video(transformers.SmolVLMProcessor)(
            transformers.SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
            tok, None, image_seq_len=1),
    },
    "internvl": {
        # 28 px tiles of 14 px patches (2 x 2), pixel shuffle 0.5: 1 token per tile; up to 4 tiles + thumbnail.
        "config": {"vision_config": {"image_size": [28, 28], "patch_size": [14, 14]}},
        "tokens": {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        "ids": {"image_token_id": "<IMG_CONTEXT>"}, "prompt": "<IMG_CONTEXT>",
        "processor": lambda tok: no_video(transformers.InternVLProcessor)(
            transformers.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                                  min_patches=1, max_patches=4), tok, image_seq_length=1),
    },
    "mistral3": {
        # Pixtral tower, 14 px patches, images up to 56 px, 2 x 2 patch merger.
        "config": {"vision_config": {"image_size": 56, "patch_size": 14, "head_dim": 16}, "spatial_merge_size": 2},
        "tokens": {}, "extra": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "ids": {"image_token_id": "[IMG]"},
        "prompt": "[IMG]",
        "processor": lambda tok: PixtralStandIn(
            transformers.PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=14), tok, patch_size=14,
            spatial_merge_size=2),
    },
    "aya_vision": {
        # 28 px tiles of 14 px patches, pixel shuffle 2: 1 token per tile; up to 4 tiles + thumbnail.
        "config": {"vision_config": {"image_size": 28, "patch_size": 14}, "downsample_factor": 2},
        "tokens": {},
        "extra": ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE",
                  "TILE_GLOBAL", *(f"TILE_{i}" for i in range(1, 6))],
        "ids": {"image_token_id": "<|IMG_PATCH|>"}, "prompt": "<image>",
        "processor": lambda tok: transformers.AyaVisionProcessor(
            transformers.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                                  min_patches=1, max_patches=4),
            tok, patch_size=14, img_size=28, downsample_factor=2),
    },
    "mllama": {
        # Cross-attention family: tiles of 28 px (14 px patches), up to 2 tiles per image.
        "config": {
            "vision_config": {"image_size": 28, "patch_size": 14, "max_num_tiles": 2, "num_global_layers": 1,
                              "intermediate_layers_indices": [0], "vision_output_dim": 128,
                              "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]},
            "text_config": {"cross_attention_layers": [1]},
        },
        "tokens": {"image_token": "<|image|>"}, "extra": ["<|python_tag|>"],
        "ids": {"image_token_id": "<|image|>"}, "prompt": "<|image|>",
        "processor": lambda tok: transformers.MllamaProcessor(
            transformers.MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2), tok),
    },
}


def _set_token_ids(config, ids: dict[str, int]) -> None:
    """Write token ids into the config (and its text config) under every alias the config knows."""
    for part in (config, getattr(config, "text_config", None)):
        if part is None:
            continue
        for field, value in ids.items():
            for name in (field, field.replace("_id", "_index")):
                if hasattr(part, name) or name in getattr(part, "attribute_map", {}):
                    setattr(part, name, value)


def tiny_image_text_config(model_type: str):
    """The tiny config of `model_type` with the token ids of its tiny tokenizer (`make_tokenizer`)."""
    spec = SPECS[model_type]
    tokenizer = make_tokenizer(spec.get("tokens", {}), spec.get("extra", ()))
    config = tiny_config(model_type, **spec["config"])
    _set_token_ids(config, {field: tokenizer.convert_tokens_to_ids(token) for field, token in spec["ids"].items()})
    config.use_cache = False
    if hasattr(config, "text_config"):
        config.text_config.use_cache = False
    return config


class TinyImageText:
    """A tiny image-text model of `model_type` on `backend` (float32, eval mode, seeded), its processor, and
    processed documents."""

    def __init__(self, model_type: str, backend: str = "sdpa", seed: int = 0):
        spec = SPECS[model_type]
        self.model_type, self.spec = model_type, spec
        self.tokenizer = make_tokenizer(spec.get("tokens", {}), spec.get("extra", ()))
        self.processor = spec["processor"](self.tokenizer)
        torch.manual_seed(seed)
        self.model = transformers.AutoModelForImageTextToText.from_config(
            tiny_image_text_config(model_type), attn_implementation=backend, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if name.endswith("gate") and parameter.numel() == 1 and float(parameter.abs()) == 0.0:
                    parameter.fill_(0.7)  # Mllama's tanh gates: closed at 0, the cross-attention would be skipped
                elif parameter.dim() >= 2 and not parameter.any():
                    parameter.normal_(std=0.02)  # Gemma 3's image projection: at 0, image features vanish

    def document(self, n_words: int, image_sizes=(), seed: int = 0) -> dict:
        """One conversation: `n_words` words with one image of each (width, height) of `image_sizes` spread among
        them (after the first word). Returns the processor's tensors (batch 1), plus `n_images`."""
        rng = random.Random(seed)
        words = [rng.choice(WORDS) for _ in range(n_words)]
        slots = sorted(rng.sample(range(1, n_words), len(image_sizes))) if image_sizes else []
        parts, images = [], []
        for i, word in enumerate(words):
            if i in slots:
                k = slots.index(i)
                parts.append(self.spec["prompt"])
                images.append(photo(seed + k, image_sizes[k]))
            parts.append(word)
        text = " ".join(parts)
        kwargs = {}
        if self.spec.get("images_first"):
            # PaliGemma: the processor puts the images before the prompt; the second half of the words is the suffix.
            half = max(1, n_words // 2)
            text, kwargs["suffix"] = " ".join(words[:half]), " ".join(words[half:])
        if kwargs and not images:
            # PaliGemma's processor refuses text without an image: tokenize prefix + suffix as it does.
            inputs = self.tokenizer([text], text_pair=[kwargs["suffix"] + "</s>"], return_token_type_ids=True,
                                    return_tensors="pt")
        else:
            inputs = self.processor(text=[text], images=[images] if images else None, return_tensors="pt", **kwargs)
        inputs = {key: value for key, value in dict(inputs).items() if key != "labels"}
        inputs["n_images"] = len(images)
        return inputs


def model_inputs(document: dict) -> dict:
    """The tensors of a processed document, as the model's forward takes them."""
    return {key: value for key, value in document.items() if isinstance(value, torch.Tensor)}
