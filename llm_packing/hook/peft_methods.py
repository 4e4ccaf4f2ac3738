"""PEFT methods that read a packed row as one sequence, refused.

LoRA and its variants (DoRA, rsLoRA, IA3, LoHa, LoKr, VeRA, OFT, ...) act on each token alone and pack exactly. Some
PEFT methods act on the row as a whole instead, where each document alone would get its own:
- prompt tuning, p-tuning and prefix tuning (`is_prompt_learning`) put virtual tokens before the row (or its keys):
  only the first document of a packed row would follow them;
- activated LoRA (`LoraConfig(alora_invocation_tokens=...)`) switches the adapter on from the last invocation sequence
  of the row: earlier documents got no adapter and later ones got it from the wrong place (tiny Llama: logits 0.67 and
  gradients 1.16 off alone, silently, and `verify_packing` passed, its rows holding no invocation tokens);
- per-row adapters at inference (`model(..., adapter_names=[...])`) give each row's name to the rows of a call; a
  hybrid's mixers run on batches of documents instead of rows (`hook.mixers`), so their LoRA layers took other rows'
  adapters (lfm2: 0.94 off, silently) or failed with PEFT's own count error.

`configure_packing` refuses a model holding the first two (`check_adapters`); a packed forward refuses an activated
LoRA added after configuring, and a mixer refuses per-row adapters. Prompt learning added after configuring is refused
by the mask builders: PEFT's float mask for the virtual tokens cannot carry document ids.
"""

import torch

from ..errors import UnsupportedSetupError
from . import registry
from .documents import documents_of
from .guards import flattened_layout
from .masks import is_integer_mask


# PEFT's forward pre-hooks that hand a layer one value per row of the model's batch.
_PER_ROW_HOOKS = ("_adapter_names_pre_forward_hook", "_alora_offsets_pre_forward_hook")


def check_adapters(model: torch.nn.Module) -> None:
    """Raise [`UnsupportedSetupError`] if `model` holds a prompt-learning or an activated-LoRA adapter."""
    for holder in dict.fromkeys((model, _transformers_model(model))):
        for name, config in _adapter_configs(holder):
            if getattr(config, "is_prompt_learning", False):
                raise UnsupportedSetupError(
                    f"PEFT adapter {name!r} is {type(config).__name__} (prompt learning): its virtual tokens go "
                    "before the whole packed row, so only the row's first document would follow them, where each "
                    "document alone gets its own. Train it without packing, or use LoRA (`peft.LoraConfig`), which "
                    "packs exactly."
                )
            _refuse_activated_lora(name, config)


def refuse_activated_lora_added_later(model: torch.nn.Module) -> None:
    """Check every packed forward of `model` for an activated LoRA added since configuring (idempotent; removed by
    `unconfigure_packing`)."""
    registry.add_forward_pre_hook(_transformers_model(model), "activated LoRA", _refuse_activated_lora_in_packed_batch)


def refuse_per_row_adapters(module: torch.nn.Module) -> None:
    """Raise if PEFT hands a layer of `module` one value per row of the model's batch (`adapter_names`, activated
    LoRA offsets): `module` is about to run on batches of documents, not of rows."""
    for layer in module.modules():
        for hook in layer._forward_pre_hooks.values():
            if getattr(getattr(hook, "func", hook), "__name__", "") in _PER_ROW_HOOKS:
                raise UnsupportedSetupError(
                    f"A packed batch reached {type(module).__name__} with PEFT's per-row adapters (`adapter_names`, "
                    "or an activated LoRA's offsets): llm_packing runs this mixer on batches of documents, not of "
                    "rows, so its LoRA layers would take other rows' adapters. Run each adapter's rows in a call of "
                    "their own (`model.set_adapter(name)`), without `adapter_names`."
                )


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """A PEFT model's transformers model (PEFT gives it the `peft_config` of its injected adapters), else `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _adapter_configs(holder) -> list:
    configs = getattr(holder, "peft_config", None)
    return list(configs.items()) if isinstance(configs, dict) else []


def _refuse_activated_lora(name: str, config) -> None:
    tokens = getattr(config, "alora_invocation_tokens", None)
    if tokens:
        raise UnsupportedSetupError(
            f"PEFT adapter {name!r} is an activated LoRA (`alora_invocation_tokens`={list(tokens)}): PEFT switches it "
            "on from the last invocation sequence of the whole packed row, not of each document, so earlier "
            "documents would get no adapter and later ones would get it from the wrong place. Train it without "
            "packing, or use a plain `peft.LoraConfig`."
        )


def _refuse_activated_lora_in_packed_batch(module, args, kwargs):
    activated = [(name, config) for name, config in _adapter_configs(module)
                 if getattr(config, "alora_invocation_tokens", None)]
    if not activated:  # LoRA's every forward: the mask is not read here, so the forward keeps its one host copy
        return
    mask = kwargs.get("attention_mask")
    packed = documents_of(mask).is_packed if is_integer_mask(mask) and mask.numel() else flattened_layout(kwargs)
    if packed:
        _refuse_activated_lora(*activated[0])
