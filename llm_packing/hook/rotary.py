"""Rotary frequencies per document, where transformers picks them from the longest sequence of the batch.

Two rope types change their frequencies with the sequence length, read as `max(position_ids) + 1` over the whole
batch (`modeling_rope_utils.dynamic_rope_update`):
- `"longrope"` (Phi-3-128k, Phi-3.5, Phi-4-mini, Phi-3.5-MoE): the short factors up to
  `original_max_position_embeddings`, the long ones past it;
- `"dynamic"` NTK scaling: the base stretched to the sequence length past `max_position_embeddings`.
In a packed batch that length is the longest document's, so a short document packed beside one longer than the
original context was rotated with frequencies it never gets alone (tiny configs: 107 of 110 types leaked, 1.2e-5 to
0.36 in the logits, `benchmarks/rope_parity.py`). The replaced `forward` of the rotary module gives each token the
frequencies of its own document's length instead: positions restart at 0 per document, so that length is the last
position of the token's run plus one ([`masks.document_lengths_per_token`], on the device). Each set of frequencies
the batch needs goes through the module's own undecorated `forward` in turn, on the positions of the set's tokens
only, and each token takes its set's cos and sin.

- longrope: two sets (short, long), so nothing waits for the device and `torch.compile` traces it;
- dynamic: one set per document length past `max_position_embeddings`, read on the host (transformers' own dynamic
  update syncs on the same length). Each document gets what it gets alone in a fresh model: transformers also keeps
  a longer earlier batch's frequencies for a later one, which no forward of a single document reproduces.

One rotary module reads the length itself: phimoe's `forward` scales cos and sin by `long_mscale` past
`original_max_position_embeddings` and by `short_mscale` up to it, from the batch's largest position, for every rope
type but the default. Where the two differ, its tokens form the same two sets as longrope's (with one set of
frequencies), so each document is scaled for its own length (tiny phimoe with linear rope and mscales 1.0 and 1.25:
packed documents were 4.2e-2 off alone).

Outside packed batches the rule is the same, read from the positions the model gets: a batch without
`position_ids` (every row at 0, 1, 2, ...) is one run of the batch's length per row, as in transformers. Positions
that restart within a row split it: left-padded generation (each prompt's positions start at 0 on its first token)
rotates each prompt by its own length, as alone, where transformers takes the longest prompt's.
"""

import functools

import torch

from ..errors import UnsupportedSetupError
from . import registry
from .masks import document_lengths_per_token
from .support.model_types import config_parts, modeling_module


LENGTH_DEPENDENT_ROPE_TYPES = ("longrope", "dynamic")


def patch_rotary_embeddings(model_or_config) -> None:
    """Replace the `forward` of each rotary embedding class whose frequencies depend on the batch's length, for the
    rotary modules of a model or, given a config whose rope type is length-dependent, the classes of its modeling
    module (idempotent; restored through the registry)."""
    for cls in _rotary_classes(model_or_config):
        if not registry.is_ours(cls.forward):
            registry.replace_attribute(cls, "forward", registry.ours(_per_document(cls.forward), eager=False))


def _rotary_classes(model_or_config) -> set[type]:
    if isinstance(model_or_config, torch.nn.Module):
        return {
            type(module)
            for module in model_or_config.modules()
            if _length_updated(type(module)) and _module_follows_length(module)
        }
    module = modeling_module(model_or_config) if length_dependent_rope_types(model_or_config) else None
    if module is None:
        return set()
    return {value for value in vars(module).values() if isinstance(value, type) and _length_updated(value)}


def _length_updated(cls: type) -> bool:
    return _length_update(getattr(cls, "forward", None)) is not None


def _length_update(forward):
    """transformers' `dynamic_rope_update` wrapper around a rotary module's `forward`, which updates the frequencies
    from the batch's length before each call, or None. In 5.18 `torch.no_grad()` wraps it in turn (the rotary
    output needs no gradient either way: nothing in it is a parameter)."""
    for _ in range(3):
        code = getattr(forward, "__code__", None)
        in_rope_utils = code is not None and code.co_filename.endswith("modeling_rope_utils.py")
        if in_rope_utils and hasattr(forward, "__wrapped__"):
            return forward
        forward = getattr(forward, "__wrapped__", None)
    return None


def _module_follows_length(module) -> bool:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str) and hasattr(module, "config"):
        return _follows_length(_parameters(module, None) | {"rope_type": rope_type})
    return _is_length_dependent(rope_type)


def _is_length_dependent(rope_type) -> bool:
    """`rope_type` is a name, or a dict of names per layer type."""
    names = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(name, str) and name.startswith(LENGTH_DEPENDENT_ROPE_TYPES) for name in names)


def length_dependent_rope_types(config) -> list[str]:
    """The rope types of `config` (and of the configs nested in it, per layer type too) whose frequencies, or phimoe's
    scale, follow the sequence length; empty for most models."""
    return sorted({entry["rope_type"] for _, entry in _rope_entries(config) if _follows_length(entry)})


def length_switches(config) -> dict[str, int]:
    """The sequence lengths, in tokens, past which `config`'s length-dependent rope changes its frequencies: a packed
    check crosses one only with a document longer than it.

    Example:
    ```python
    >>> from transformers import Phi3Config
    >>> from llm_packing.hook.rotary import length_switches
    >>> length_switches(Phi3Config(max_position_embeddings=131072, rope_parameters={
    ...     "rope_type": "longrope", "original_max_position_embeddings": 4096, "short_factor": [1.0] * 48,
    ...     "long_factor": [2.0] * 48, "rope_theta": 10000.0}))
    {"longrope's original_max_position_embeddings": 4096}

    ```
    """
    found = {}
    for part, entry in _rope_entries(config):
        if entry["rope_type"] == "longrope" and entry.get("original_max_position_embeddings"):
            found["longrope's original_max_position_embeddings"] = entry["original_max_position_embeddings"]
        elif entry["rope_type"] == "dynamic" and getattr(part, "max_position_embeddings", None):
            found["dynamic rope's max_position_embeddings"] = part.max_position_embeddings
        elif _switches_mscale(entry):
            found["phimoe's mscale (original_max_position_embeddings)"] = entry["original_max_position_embeddings"]
    return found


def _follows_length(parameters: dict) -> bool:
    """Whether rope `parameters` (with their `rope_type`) change with the sequence length."""
    return _is_length_dependent(parameters["rope_type"]) or _switches_mscale(parameters)


def _switches_mscale(parameters: dict) -> bool:
    """phimoe's rope parameters: cos and sin scaled by `long_mscale` or `short_mscale` by the sequence length, for
    every rope type but the default; a switch only where the two differ."""
    return (parameters.get("rope_type") != "default" and bool(parameters.get("original_max_position_embeddings"))
            and parameters.get("long_mscale", 1.0) != parameters.get("short_mscale", 1.0))


def _rope_entries(config):
    """(config part, rope parameters with a `rope_type`) of `config` and its nested configs, per layer type too."""
    for part in config_parts(config):
        parameters = getattr(part, "rope_parameters", None) or {}
        per_layer = parameters.values() if all(isinstance(value, dict) for value in parameters.values()) else []
        for entry in [parameters, *per_layer]:
            if isinstance(entry, dict) and entry.get("rope_type"):
                yield part, entry


def _per_document(original):
    rope_forward = _length_update(original).__wrapped__  # the module's own forward, without the length update

    @functools.wraps(original)
    def rotary_per_document(self, x, position_ids, layer_type=None):
        rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
        keywords = {} if layer_type is None else {"layer_type": layer_type}
        parameters = _parameters(self, layer_type)
        if not _follows_length(parameters | {"rope_type": rope_type}):
            return original(self, x, position_ids, **keywords)
        prefix = "" if layer_type is None else f"{layer_type}_"
        lengths = document_lengths_per_token(position_ids)
        if rope_type == "longrope":
            frequency_sets = _longrope_sets(self, lengths, x.device, layer_type, prefix)
        elif _is_length_dependent(rope_type):
            frequency_sets = _dynamic_sets(self, lengths, x.device, layer_type, prefix)
        else:  # phimoe's mscale: its frequencies as they are, its scale per set
            inv_freq, switch = getattr(self, f"{prefix}inv_freq"), parameters["original_max_position_embeddings"]
            frequency_sets = [(inv_freq, lengths <= switch), (inv_freq, lengths > switch)]
        embeddings = None
        for inv_freq, selected in frequency_sets:
            # The set's own tokens only, the others at position 0: a forward that reads the length itself (phimoe's
            # mscale) reads this set's.
            set_positions = position_ids.masked_fill(~selected.expand_as(position_ids), 0)
            module = _WithFrequencies(self, f"{prefix}inv_freq", inv_freq)
            # (cos, sin) for most types, one complex tensor for some (deepseek_v2, llama4)
            set_embeddings = rope_forward(module, x, set_positions, **keywords)
            embeddings = set_embeddings if embeddings is None else _select(selected, set_embeddings, embeddings)
        return embeddings

    return rotary_per_document


class _WithFrequencies:
    """The rotary module as its own `forward` reads it, with the frequencies `inv_freq` under `name`. The module is
    never modified: a forward on another thread (`nn.DataParallel`, or one model shared by threads) may be reading it
    at the same time, and transformers' own updates leave its buffer aliased with `original_inv_freq` or
    `long_inv_freq` (5.18 registers those very tensors), which a copy into it would overwrite."""

    def __init__(self, module: torch.nn.Module, name: str, inv_freq: torch.Tensor):
        self.__dict__.update({"_module": module, name: inv_freq})

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _select(selected: torch.Tensor, chosen, others):
    """`chosen` where `selected` (per token, `(batch_size, length)`), else `others`: tensors or tuples of them, laid
    out `(batch_size, length, ...)` or, for 3-D rope, `(3, batch_size, length, ...)`."""
    if isinstance(chosen, tuple):
        return tuple(_select(selected, new, old) for new, old in zip(chosen, others, strict=True))
    offset = 0 if chosen.shape[:2] == selected.shape else 1
    if chosen.shape[offset : offset + 2] != selected.shape:
        raise UnsupportedSetupError(
            f"A rotary embedding returned shape {tuple(chosen.shape)} for positions laid out {tuple(selected.shape)}: "
            "its frequencies cannot be chosen per document. Use a rope type whose frequencies do not depend on the "
            "sequence length, or call `unconfigure_packing()` and train without packing."
        )
    shape = (1,) * offset + tuple(selected.shape) + (1,) * (chosen.dim() - offset - 2)
    return torch.where(selected.view(shape), chosen, others)


def _parameters(module, layer_type: str | None) -> dict:
    """The rotary module's rope parameters (of `layer_type`, where it has them per layer type)."""
    parameters = getattr(module.config, "rope_parameters", None) or {}
    return parameters.get(layer_type, {}) if layer_type is not None else parameters


def _longrope_sets(self, lengths, device, layer_type, prefix):
    """Short frequencies for the tokens of documents up to the original context, long ones for the others."""
    original_length = _parameters(self, layer_type)["original_max_position_embeddings"]
    long_inv_freq = getattr(self, f"{prefix}long_inv_freq", None)
    if long_inv_freq is None:  # what transformers' longrope update computes and keeps, under the same name
        long_inv_freq = _inv_freq(self.config, "longrope", device, original_length + 1, layer_type)
        setattr(self, f"{prefix}long_inv_freq", long_inv_freq)
    long_inv_freq = long_inv_freq.to(device)
    short_inv_freq = getattr(self, f"{prefix}original_inv_freq").to(device)
    return [(short_inv_freq, lengths <= original_length), (long_inv_freq, lengths > original_length)]


def _dynamic_sets(self, lengths, device, layer_type, prefix):
    """The original frequencies for the tokens of documents up to `max_position_embeddings`, then those of each
    longer document's length for its tokens."""
    rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
    original_length = self.original_max_seq_len
    sets = [(getattr(self, f"{prefix}original_inv_freq").to(device), lengths <= original_length)]
    for length in torch.unique(lengths[lengths > original_length]).tolist():
        inv_freq = _inv_freq(self.config, rope_type, device, length, layer_type)
        sets.append((inv_freq, lengths == length))
    return sets


def _inv_freq(config, rope_type: str, device, length: int, layer_type: str | None) -> torch.Tensor:
    """The frequencies transformers' `rope_type` gives a sequence of `length` tokens."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    keywords = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=length, **keywords)[0]
