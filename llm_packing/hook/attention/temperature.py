"""Llama 4's attention temperature per document.

On its layers without rope (every fourth in Llama 4 Scout and Maverick), Llama 4 scales each query by
`1 + attn_scale * log1p(floor((position + 1) / floor_scale))` (`attn_temperature_tuning`). transformers takes that
position from the row, `arange(length)`, not from `position_ids`: a packed document past `floor_scale` tokens into its
row (8,192 in the released configs, so in rows of 16k tokens and more) got the temperature of its row offset, not of
its own positions (measured with `floor_scale=4` on the tiny model: 1.3e-2 in the logits).

The decoder layer, which receives `position_ids`, hands them to its attention through the keyword arguments; the
attention runs transformers' own `forward` with its temperature off, on a view of itself whose `q_proj` scales each
query by the temperature of its position in its document. The queries there are the projection's output, unchanged
until the temperature (no rope or norm on those layers), so the result is transformers' own with per-document
positions. Nothing is stored on the modules: concurrent forwards on threads each use their own positions.

Outside packed batches the rule is the same, read from the `position_ids` the model gets (as `hook.rotary` reads
them): a left-padded row whose positions start at 0 on its first token takes the temperature of those positions, as
alone, where transformers takes the row's `arange` (tiny config, `floor_scale` 4: 2.0e-4 in the logits). Without
`position_ids` both are the row's `arange`.
"""

import functools
import importlib

import torch

from .. import registry


# model_type -> the modeling module holding Llama 4's text decoder layer and attention.
TEMPERATURE_MODULES = {"llama4": "llama4", "llama4_text": "llama4"}
_POSITIONS = "llm_packing_document_positions"


def patch_attention_temperature(model_type: str) -> None:
    """Wrap Llama 4's text decoder layer and attention `forward`s (idempotent; restored through the registry)."""
    if model_type not in TEMPERATURE_MODULES:
        return
    name = TEMPERATURE_MODULES[model_type]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    for cls, wrap in ((module.Llama4TextDecoderLayer, _hand_positions), (module.Llama4TextAttention, _per_document)):
        if not registry.is_ours(cls.forward):
            registry.replace_attribute(cls, "forward", registry.ours(wrap(cls.forward), eager=False))


def length_switches(config) -> dict[str, int]:
    """`floor_scale` where `config` (or its text config) tunes the temperature of layers without rope: a packed check
    crosses the first step only with a document longer than it. Empty for every other model.

    Example:
    ```python
    >>> from transformers import Llama4TextConfig
    >>> from llm_packing.hook.attention.temperature import length_switches
    >>> length_switches(Llama4TextConfig(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], floor_scale=8192))
    {"Llama 4's attention temperature step (floor_scale)": 8192}

    ```
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    without_rope = not all(getattr(text, "no_rope_layers", None) or [1])
    if text.model_type in TEMPERATURE_MODULES and getattr(text, "attn_temperature_tuning", False) and without_rope:
        return {"Llama 4's attention temperature step (floor_scale)": text.floor_scale}
    return {}


def _tunes_temperature(attention) -> bool:
    return bool(getattr(attention, "attn_temperature_tuning", False)) and not getattr(attention, "use_rope", True)


def _hand_positions(original):
    @functools.wraps(original)
    def decoder_layer_forward(self, *args, **kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and _tunes_temperature(self.self_attn):
            kwargs[_POSITIONS] = position_ids
        return original(self, *args, **kwargs)

    return decoder_layer_forward


def _per_document(original):
    @functools.wraps(original)
    def attention_forward(self, *args, **kwargs):
        positions = kwargs.pop(_POSITIONS, None)
        if positions is None:
            return original(self, *args, **kwargs)
        temperature = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return original(_TemperedQueries(self, temperature[..., None]), *args, **kwargs)

    return attention_forward


class _TemperedQueries:
    """The attention as its own `forward` reads it, with the temperature off and `q_proj` scaling each token's query
    by `temperature` (`(batch_size, length, 1)`, float32), cast back as transformers casts its scaled queries."""

    def __init__(self, attention: torch.nn.Module, temperature: torch.Tensor):
        self.__dict__.update(_attention=attention, _temperature=temperature, attn_temperature_tuning=False)

    def q_proj(self, hidden_states: torch.Tensor) -> torch.Tensor:
        queries = self._attention.q_proj(hidden_states)
        return (queries * self._temperature).to(queries.dtype)

    def __getattr__(self, name: str):
        return getattr(self._attention, name)
