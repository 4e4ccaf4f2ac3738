"""Packed batches refused by the models that call no mask builder, unless their own type was configured.

`configure_packing` replaces transformers' causal mask builders for every model in the process, and those builders
refuse a packed batch reaching a model of a type that was not configured (`hook.builders`). Some causal LMs call no
builder at all: the pure SSMs and recurrent LMs (mamba, falcon_mamba, mamba2, rwkv, xlstm) and a few older
architectures with masks of their own (xlnet, reformer, openai-gpt, ...; their modeling source names no builder:
`support.architectures.calls_no_mask_builder`). Once another model was configured, such a model took
`DataCollatorWithPacking`'s batches without a word: mamba and falcon_mamba 4.9-5.4 off each document alone.

While packing is configured, the `__call__` of their model classes refuses a packed batch (an indexed
`attention_mask`, or a padding-free one) for a type that was not configured; a configured type (mamba, rwkv, ...)
passes through untouched to the per-document mixers (`hook.mixers`). The causal LMs' modeling modules are checked and
patched as they are imported (`registry.patch_on_import`): importing, or even reading, them all up front would cost
seconds, or half a second.
"""

import functools
import inspect
import sys

from . import registry
from .builders import unconfigured_model_type_error
from .guards import flattened_layout
from .masks import is_indexed_packed_mask
from .support.architectures import calls_no_mask_builder, causal_lm_modeling_modules


_GUARDED = "__llm_packing_refuses_unconfigured_packing__"


def refuse_packed_batches_in_builderless_models() -> None:
    """Guard the model classes of every causal LM modeling module that calls no mask builder, now or when it is
    imported (idempotent; `unconfigure_packing` restores them through the registry)."""
    for module_name in causal_lm_modeling_modules():
        registry.patch_on_import(module_name, functools.partial(_guard_module, module_name))


def _guard_module(module_name: str) -> None:
    from transformers import PreTrainedModel

    if not calls_no_mask_builder(module_name):
        return
    for cls in list(vars(sys.modules[module_name]).values()):
        if (
            isinstance(cls, type) and issubclass(cls, PreTrainedModel) and cls.__module__ == module_name
            and _takes_a_mask(cls.forward) and not getattr(cls.__call__, _GUARDED, False)
        ):
            guarded = registry.ours(_refusing_unconfigured_packing(cls.__call__, cls.forward), eager=False)
            setattr(guarded, _GUARDED, True)
            registry.replace_attribute(cls, "__call__", guarded)


def _takes_a_mask(forward) -> bool:
    """Whether `forward` takes an `attention_mask`, by name or in its `**kwargs` (xLSTM's)."""
    parameters = inspect.signature(forward).parameters.values()
    return any(p.name == "attention_mask" or p.kind is p.VAR_KEYWORD for p in parameters)


def _refusing_unconfigured_packing(call, forward):
    signature = inspect.signature(forward)

    @functools.wraps(call)
    def call_refusing_unconfigured_packing(self, *args, **kwargs):
        model_type = getattr(self.config, "model_type", None)
        if not registry.is_configured_model_type(model_type):
            layout = _packed_layout({**kwargs, **signature.bind_partial(self, *args).arguments})
            if layout is not None:
                raise unconfigured_model_type_error(model_type, layout)
        return call(self, *args, **kwargs)

    return call_refusing_unconfigured_packing


def _packed_layout(arguments: dict) -> str | None:
    if is_indexed_packed_mask(arguments.get("attention_mask")):
        return "indexed `attention_mask`"
    return flattened_layout(arguments)
