"""Multimodal checkpoints in packed batches: images of the image-text types the image-text parity matrix proved are
packed with their documents (`hook.media.image_text`); every other model refuses media inputs in a packed batch.

`AutoModelForCausalLM` builds some multimodal checkpoints as the whole wrapper (`gemma3` gives
`Gemma3ForConditionalGeneration`, config `gemma3`) and others as the bare language model (`mllama` gives
`MllamaForCausalLM`, whose config is the text config `mllama_text_model`). Text-only batches of both go through the
same mask builders as any decoder, so the hook isolates them. Images or video in a packed row of a type not proven
with them (`llm_packing.hook.support.image_text`, `llm_packing.hook.media.video`), or audio of any type, would need
positions and masks the hook does not build, so a packed forward carrying them is refused.
"""

import functools

import torch

from ...errors import UnsupportedSetupError
from .. import registry
from ..documents import documents_of
from ..masks import is_integer_mask
from ..support.image_text import PROVEN_IMAGE_TEXT_TYPES
from . import image_text


# Forward arguments that carry media (pixel_values, pixel_values_videos, image_sizes, input_features,
# cross_attention_states, ...), and config fields naming the placeholder tokens that media replace.
_MEDIA_ARGUMENT_WORDS = ("pixel", "image", "video", "audio", "input_features", "cross_attention")
_MEDIA_TOKEN_FIELDS = tuple(
    f"{kind}_token_{suffix}" for kind in ("image", "video", "audio") for suffix in ("id", "index")
)

def media_argument_names(model) -> tuple[str, ...]:
    """The arguments of `model.forward` that carry images, video or audio (empty for a text-only model)."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    return tuple(name for name in parameters if any(word in name for word in _MEDIA_ARGUMENT_WORDS))


def guard_media_inputs(model) -> None:
    """Prepare packed forwards of `model` for its images if its type is proven with them (`hook.media.image_text`),
    else make them refuse media inputs, if its forward takes any (idempotent; removed by `unconfigure_packing` through
    the registry)."""
    if not isinstance(model, torch.nn.Module):
        return
    if getattr(getattr(model, "config", None), "model_type", None) in PROVEN_IMAGE_TEXT_TYPES:
        image_text.install(model)
        return
    names = media_argument_names(model)
    config = getattr(model, "config", None)
    token_ids = sorted(
        {value for field in _MEDIA_TOKEN_FIELDS if isinstance(value := getattr(config, field, None), int)}
    )
    if names or token_ids:
        hook = functools.partial(_refuse_media_in_packed_batch, names=names, token_ids=token_ids)
        registry.add_forward_pre_hook(model, "media", hook)


def _refuse_media_in_packed_batch(module, args, kwargs, *, names, token_ids):
    attention_mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    given = [name for name in names if kwargs.get(name) is not None]
    if is_integer_mask(attention_mask) and documents_of(attention_mask, positions).is_packed:
        batch = "A packed batch (indexed `attention_mask`)"
    elif (given and isinstance(positions, torch.Tensor) and positions.dim() in (2, 3)
          and image_text.padding_free_restart(positions, attention_mask) is not None):
        batch = "A padding-free batch (`position_ids` restarting within a row)"
    else:
        return
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(input_ids, torch.Tensor) and token_ids:
        placeholders = torch.isin(input_ids, torch.tensor(token_ids, device=input_ids.device))
        if bool(placeholders.any()):
            given.append(f"input_ids holding media placeholder tokens {token_ids}")
    if given:
        raise UnsupportedSetupError(
            f"{batch} reached {type(module).__name__} with media inputs: "
            f"{', '.join(given)}. Packing isolates its text-only documents; its images, video and audio are not "
            "packed. Train multimodal rows without packing, or pack only text-only rows (image-text types packed "
            "with their images: `llm_packing.hook.support.image_text.supported_image_text_model_types()`)."
        )
