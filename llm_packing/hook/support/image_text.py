"""Which image-text model types the hook packs exactly with their images, and why the others are refused.

The candidates are the installed transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`. A type is supported
with images only if it is in `PROVEN_IMAGE_TEXT_TYPES`, the types `tests/test_image_text_parity.py` proved: packed
rows of several documents with 0, 1 and 2 images of different sizes (real photos) and trailing padding give, for
every document, the logits it gives alone within 1e-5 in float32, on each backend listed. Every other type is refused
with its reason in `REFUSED_IMAGE_TEXT_TYPES`; a type of a newer transformers that neither lists is refused until the
matrix covers it. Types that are also causal LMs (`gemma3`, `qwen3_5`, ...) keep their text-only support from the
causal LM table; their packed batches carrying images follow this one.

`python -m llm_packing.hook.support.matrix` renders both tables into docs/support_matrix.md.
"""

import functools
from dataclasses import dataclass

from ...errors import UnsupportedSetupError


# The mechanism that keeps a family's documents apart (besides the text isolation every type gets).
MROPE = "mRoPE: 3-D positions per document"
IMAGE_BLOCKS = "bidirectional image blocks bounded by the document"
IMAGE_TOKENS = "image tokens: text isolation, media in packed order"
CROSS_ATTENTION = "cross-attention to the document's own images"

IMAGE_TEXT_BACKENDS = ("eager", "sdpa", "flex_attention")
# transformers' FlashAttention integration, one path whatever the kernel (`support.architectures.FLASH_BACKENDS`).
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclass(frozen=True)
class ImageTextSupport:
    """A proven image-text type: its `family` (one of the mechanisms above) and the attention `backends` the parity
    matrices proved it on (sdpa on its varlen and dense routes; flex_attention and FlashAttention wherever
    transformers offers them; FlashAttention through its varlen path with a reference kernel,
    `tests/test_image_text_flash.py`)."""

    family: str
    backends: tuple[str, ...] = ("eager", "sdpa")


_WITH_FLEX = ("eager", "sdpa", "flex_attention")
# transformers offers no flex_attention for qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe and glm4v.
_MROPE = ImageTextSupport(MROPE, ("eager", "sdpa", *FLASH_BACKENDS))

# FlashAttention 3 and 4 take flash_attention_2's path with another kernel, so with images they run for one type of
# each family (the support table marks the other cells as inferred).
FLASH_RUN_WITH_IMAGES = ("qwen2_5_vl", "llava")
# Why a family's packed batches with images are refused on FlashAttention (transformers 5.24 offers none for its
# types either: their wrapper classes build 4-D masks).
FLASH_REFUSED_FAMILIES: dict[str, str] = {
    IMAGE_BLOCKS: "FlashAttention's varlen kernel attends each document as one causal segment, and cannot express "
    "bidirectional image blocks inside it (each image's tokens attending to each other); use "
    "`configure_packing(model, attn_implementation='sdpa')` or 'flex_attention'",
    CROSS_ATTENTION: "cross-attention to each document's own images needs a per-token mask, which FlashAttention's "
    "varlen path does not take; use `configure_packing(model, attn_implementation='sdpa')`",
}

# Proven by tests/test_image_text_parity.py (CPU, float32, tolerance 1e-5). Edit only together with a passing matrix.
PROVEN_IMAGE_TEXT_TYPES: dict[str, ImageTextSupport] = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "glm4v"), _MROPE),
    "qwen3_vl_moe": ImageTextSupport(MROPE, (*_WITH_FLEX, *FLASH_BACKENDS)),
    **dict.fromkeys(("gemma3", "gemma4", "paligemma"), ImageTextSupport(IMAGE_BLOCKS, _WITH_FLEX)),
    **dict.fromkeys(
        ("llava", "llava_next", "llava_onevision", "vipllava", "idefics2", "idefics3", "smolvlm", "internvl",
         "mistral3", "aya_vision"),
        ImageTextSupport(IMAGE_TOKENS, (*_WITH_FLEX, *FLASH_BACKENDS)),
    ),
    "mllama": ImageTextSupport(CROSS_ATTENTION, _WITH_FLEX),
}


def _not_run(why: str) -> str:
    return f"not in the image-text parity matrix: {why}"


_NO_TINY = "its tiny config does not build offline ({}), so the parity matrix cannot run it"
_TORCHVISION = "its image processor exists only as a torchvision class, which has no build for the CPU torch tested"
_TOO_BIG = "its tiny build keeps {} parameters (a sub-config the generic shrink does not reach)"
_ENCODER_DECODER = (
    "an encoder-decoder: the encoder reads the whole packed input bidirectionally and the decoder cross-attends to "
    "all of it, so documents of a row see each other"
)
_Q_FORMER = (
    "a Q-Former feeds learned queries to a text model called with its own embeddings and mask, which the hook does "
    "not reach (its tiny text forward raised TypeError)"
)
_MROPE_UNRUN = "an mRoPE family member like qwen2_5_vl, but " + "{}"
_OMNI = (
    "its `get_rope_index` keeps only tokens whose mask is 1 (`attention_mask == 1`), so documents 2, 3, ... of a "
    "packed row get no rope index of their own; and it takes audio, which the hook does not pack"
)
_RECURRENT = "its text model is a recurrent hybrid ({}) whose mixers are not in the hook's mixer table"

# Every other type of transformers 5.24's image-text mapping, with the reason it is refused.
REFUSED_IMAGE_TEXT_TYPES: dict[str, str] = {
    "apertus1p5": _not_run(_NO_TINY.format("StrictDataclassClassValidationError") + "; " + _TORCHVISION),
    "aria": _not_run("its projector cross-attends learned queries to the image patches; not yet run"),
    "blip": "a BERT-style text decoder cross-attending to the image; "
    + _not_run("its tiny text forward raised TypeError"),
    "blip-2": _Q_FORMER,
    "chameleon": _not_run("images are VQ tokens in `input_ids`; " + _NO_TINY.format("AttributeError")),
    "cohere2_vision": _not_run(_TOO_BIG.format("10.9M") + "; " + _TORCHVISION),
    "cohere_compass": _not_run(_MROPE_UNRUN.format(_NO_TINY.format("KeyError"))),
    "cosmos3_edge": _not_run(_MROPE_UNRUN.format(_NO_TINY.format("StrictDataclassClassValidationError"))),
    "cosmos3_omni": _not_run(_MROPE_UNRUN.format("not yet run")),
    "deepseek_ocr2": _not_run("image blocks from `block_sequence_ids`; " + _NO_TINY.format("TypeError")),
    "deepseek_vl": _not_run("image tokens on a llama text model; not yet run"),
    "deepseek_vl_hybrid": _not_run(_TOO_BIG.format("8.5M")),
    "diffusion_gemma": "a block-diffusion model: its text attends bidirectionally within blocks of the row "
    "(`or_mask_function`), not a causal next-token objective the parity matrix defines",
    "dots3_note": _not_run("vision and audio; its text model is a supported causal LM, its image path not yet run"),
    "emu3": _not_run("images are VQ tokens in `input_ids`; " + _NO_TINY.format("AttributeError")),
    "ernie4_5_vl_moe": _not_run(_MROPE_UNRUN.format(_NO_TINY.format("StrictDataclassFieldValidationError"))),
    "evolla": "a protein-text model (protein sequences, not images), outside image-text packing",
    "exaone4_5": _not_run("image tokens with a windowed vision tower on an exaone4 text model; not yet run"),
    "fast_vlm": _not_run("image tokens on a qwen2 text model; its processor maps no PIL image processor"),
    "florence2": _ENCODER_DECODER,
    "fuyu": _not_run("image patches are embedded straight into the token sequence; not yet run"),
    "gemma3n": _not_run("its vision tower is built by timm, which needs torchvision; it also takes audio"),
    "gemma4_unified": _not_run("image blocks like gemma4, but " + _TORCHVISION),
    "git": _not_run("image blocks over an image prefix (`block_sequence_ids`); not yet run"),
    "glm46v": _not_run(_MROPE_UNRUN.format(_TOO_BIG.format("21M"))),
    "glm4v_moe": _not_run(_MROPE_UNRUN.format(_TOO_BIG.format("21M"))),
    "glm5_next": _RECURRENT.format("recurrent attention") + "; " + _NO_TINY.format(
        "StrictDataclassClassValidationError"),
    "glm_ocr": _not_run(_MROPE_UNRUN.format(_TOO_BIG.format("24M"))),
    "glmga": _not_run(_MROPE_UNRUN.format(_TOO_BIG.format("21M"))),
    "got_ocr2": _not_run("image tokens on a qwen2 text model; not yet run"),
    "granite4_vision": _not_run(_NO_TINY.format("TypeError")),
    "granite_docling": _not_run(_NO_TINY.format("StrictDataclassClassValidationError")),
    "hunyuan_vl": _not_run("mRoPE with an (axes + 1)-row `position_ids` layout the hook does not build; "
                           + _NO_TINY.format("TypeError")),
    "hy_v4_vl": _not_run(_MROPE_UNRUN.format(_NO_TINY.format("StrictDataclassClassValidationError"))),
    "hyperclovax_vision_v2": _not_run("image tokens with a windowed vision tower; not yet run"),
    "idefics": "gated cross-attention (Idefics v1) over per-token image attention masks the hook does not bound by "
    "document; " + _not_run("its tiny text forward raised ValueError and its PIL processor AttributeError"),
    **dict.fromkeys(("inkling2", "inkling2_loop", "inkling_mm_model"), _not_run(
        "a short-convolution text model (whose mixers the hook isolates on text); " + _TORCHVISION)),
    "instructblip": _Q_FORMER,
    "instructblipvideo": _Q_FORMER + "; and video",
    "janus": _not_run(_TOO_BIG.format("119M")),
    "kimi_k25": _not_run("clip-level vision `cu_seqlens`; " + _TORCHVISION),
    "kosmos-2": _not_run("image embeddings placed at given positions; its tiny text forward raised ValueError"),
    "kosmos-2.5": _not_run("image tokens; not yet run"),
    "lfm2_vl": _not_run("a conv-hybrid text model (lfm2, whose mixers the hook isolates); " + _TORCHVISION),
    "lfm3_vl": _not_run("a conv-hybrid text model (lfm3, whose mixers the hook isolates); not yet run"),
    "lighton_ocr": _not_run("Pixtral-style images; PixtralProcessor needs torchvision"),
    "llama4": _not_run("chunked attention text layers; " + _TOO_BIG.format("18M") + "; " + _TORCHVISION),
    "llava_next_video": _not_run("image tokens like llava_next, plus video; not yet run"),
    "minicpm_ocr": _not_run("a qwen3_5 (gated delta net) text model; " + _TORCHVISION),
    "minicpmv4_6": _not_run("a qwen3_5 (gated delta net) text model; not yet run"),
    "minicpmv4_7": _not_run("mRoPE with a 3-row `position_ids` layout on a gated delta net text model; not yet run"),
    "minimax_m3_vl": _not_run("image tokens; " + _TORCHVISION),
    "mistral4": "a text-only class in the image-text mapping (its tiny text forward raised RuntimeError)",
    "mistral_large4": _not_run("Pixtral-style images; PixtralProcessor needs torchvision"),
    "molmo2": _not_run("image blocks from `block_sequence_ids`; " + _NO_TINY.format(
        "StrictDataclassClassValidationError") + "; " + _TORCHVISION),
    "muse_glimmer": _not_run(_TOO_BIG.format("42M") + "; " + _TORCHVISION),
    "muse_spark": _not_run(_NO_TINY.format("StrictDataclassClassValidationError") + "; " + _TORCHVISION),
    "nemotron_h_omni": _not_run("a mamba-hybrid text model with audio; " + _TOO_BIG.format("25M") + "; "
                                + _TORCHVISION),
    "ovis2": _not_run("visual-embedding-table image tokens on a qwen2 text model; not yet run"),
    "paddleocr_vl": _not_run(_MROPE_UNRUN.format("its tiny text forward raised RuntimeError")),
    "perception_lm": _not_run(_NO_TINY.format("TypeError") + "; " + _TORCHVISION),
    "pi0": "a vision-language-action model: a prefix-LM over images and text plus an action expert, whose action "
    "targets are not next-token labels",
    "pix2struct": _ENCODER_DECODER,
    "pp_chart2table": _not_run("image tokens on a qwen2 text model; not yet run"),
    "pp_formulanet": _ENCODER_DECODER,
    "qianfan_ocr": _not_run("image tokens on a qwen3 text model; not yet run"),
    "qwen2_5_omni_thinker": _OMNI,
    "qwen3_omni_moe_thinker": _OMNI,
    "qwen4_exp": _not_run("mRoPE on a gated delta net + indexed-attention text model; not yet run"),
    "shieldgemma2": _not_run("Gemma 3's class as an image classifier (yes/no scores); not yet run"),
    "step3p7": _not_run("`or_mask_function` only with bidirectional attention; " + _TORCHVISION),
    "t5gemma2": _ENCODER_DECODER,
    "udop": _ENCODER_DECODER,
    "unlimited_ocr": _not_run("or/and mask functions with block ids; " + _TORCHVISION),
    "video_llama_3": _not_run("image tokens with per-image vision `cu_seqlens`; not yet run"),
    "video_llava": _not_run("image tokens like llava, plus video; not yet run"),
    "vision-encoder-decoder": _ENCODER_DECODER,
}


@functools.cache
def image_text_model_types() -> tuple[str, ...]:
    """The image-text model types of the installed transformers (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


@functools.cache
def supported_image_text_model_types() -> tuple[str, ...]:
    """
    The image-text model types whose packed batches with images the hook isolates exactly: those of the installed
    transformers that the image-text parity matrix proved.

    Example:
    ```python
    >>> from llm_packing.hook.support.image_text import supported_image_text_model_types
    >>> "qwen2_5_vl" in supported_image_text_model_types(), "blip-2" in supported_image_text_model_types()
    (True, False)

    ```
    """
    return tuple(t for t in image_text_model_types() if t in PROVEN_IMAGE_TEXT_TYPES)


def image_text_refusal_reason(model_type: str) -> str | None:
    """Why packed batches with images are refused for `model_type`, or None if they are supported."""
    if model_type in PROVEN_IMAGE_TEXT_TYPES and model_type in image_text_model_types():
        return None
    if model_type in REFUSED_IMAGE_TEXT_TYPES:
        return REFUSED_IMAGE_TEXT_TYPES[model_type]
    if model_type not in image_text_model_types():
        return "not an image-text model of the installed transformers (no entry in its image-text mapping)"
    return "not verified by llm_packing's image-text parity matrix for this transformers version"


def refused_image_text_model_types() -> dict[str, str]:
    """Every image-text type of the installed transformers that is not supported, with its reason."""
    return {t: image_text_refusal_reason(t) for t in image_text_model_types() if t not in PROVEN_IMAGE_TEXT_TYPES}


def backend_refusal(model_type: str, backend: str | None) -> str | None:
    """Why packed batches with images of the proven `model_type` are refused on `backend`, or None if proven there."""
    support = PROVEN_IMAGE_TEXT_TYPES[model_type]
    if backend in FLASH_BACKENDS and support.family in FLASH_REFUSED_FAMILIES:
        return f"not on {backend!r}: {FLASH_REFUSED_FAMILIES[support.family]}"
    if backend not in support.backends:
        return (f"the image-text parity matrix proved it on {', '.join(support.backends)}, not on {backend!r}; use "
                "`configure_packing(model, attn_implementation='sdpa')`")
    return None


def require_images_supported(model_type: str, backend: str | None) -> ImageTextSupport:
    """The support entry of `model_type` if its packed batches with images are proven on `backend`, else raise
    [`UnsupportedSetupError`] with the reason."""
    reason = image_text_refusal_reason(model_type) or backend_refusal(model_type, backend)
    if reason is None:
        return PROVEN_IMAGE_TEXT_TYPES[model_type]
    raise UnsupportedSetupError(
        f"Packed batches with images cannot be isolated for model_type {model_type!r}: {reason}. Image-text types "
        f"packed with their images: {', '.join(supported_image_text_model_types())}. Pack only text-only rows for "
        "this model, or train its image rows unpacked."
    )
