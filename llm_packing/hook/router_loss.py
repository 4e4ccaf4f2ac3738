"""MoE load-balancing losses count each token of a packed batch once.

transformers' `load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)` weighs each token's router
probabilities and expert choices by its `attention_mask` entry, read as a 0/1 weight. A packed batch's indexed mask
holds document numbers (`[1, 1, 2, 2, 3]`), so the tokens of a row's third document counted three times, and the
auxiliary loss (`output_router_logits=True`, `router_aux_loss_coef`) and its gradients were not those of the same
documents padded (tiny qwen2_moe, three documents a row: 2.0035 against 2.0012). The replacement hands the loss the
tokens as 1 and padding as 0; the documents then give exactly the padded batch's loss (it is a statistic over all
real tokens of the batch, which packing leaves the same).

The function is replaced in the modeling module of each configured type that has one, and in Mixtral's, whose copy
TRL's fused LM head imports at every call.
"""

import functools
import importlib
import inspect

from ..errors import UnsupportedSetupError
from . import registry
from .masks import is_integer_mask
from .support.model_types import config_parts, modeling_module


_NAME = "load_balancing_loss_func"
_TRL_SOURCE = "transformers.models.mixtral.modeling_mixtral"  # where TRL's fused head imports it from


def patch_load_balancing_losses(config) -> None:
    """Replace `load_balancing_loss_func` in the modeling modules of `config` (and its nested configs) and in
    Mixtral's, where it takes an `attention_mask` (idempotent; restored through the registry)."""
    modules = {modeling_module(part) for part in config_parts(config)} | {importlib.import_module(_TRL_SOURCE)}
    for module in modules - {None}:
        original = getattr(module, _NAME, None)
        if callable(original) and not registry.is_ours(original) and _takes_a_mask(original):
            registry.replace_attribute(module, _NAME, registry.ours(_counting_tokens_once(original), eager=False))


def _takes_a_mask(function) -> bool:
    return "attention_mask" in inspect.signature(function).parameters


def _counting_tokens_once(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_balancing_loss_counting_tokens_once(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        if is_integer_mask(mask) and mask.dim() == 2:  # document numbers, not weights
            _refuse_pieces_of_rows(bound.arguments.get("gate_logits"), mask)
            bound.arguments["attention_mask"] = mask.ne(0).to(mask.dtype)
        return original(*bound.args, **bound.kwargs)

    return load_balancing_loss_counting_tokens_once


def _refuse_pieces_of_rows(gate_logits, mask) -> None:
    """A sequence-parallel shard's router logits cover its piece of each row, its mask the whole row: the loss, a
    statistic over every token of the batch, cannot be taken from a piece (transformers would fail on the shapes)."""
    layers = gate_logits if isinstance(gate_logits, (tuple, list)) else (gate_logits,)
    tokens = layers[0].shape[0] if layers and hasattr(layers[0], "shape") else mask.numel()
    if tokens != mask.numel():
        raise UnsupportedSetupError(
            f"The MoE load-balancing loss got router logits for {tokens} tokens and a packed mask of {mask.numel()}: "
            "under sequence parallelism each rank routes only its piece of every row, and the loss is a statistic "
            "over all tokens of the batch. Pass `output_router_logits=False` (no auxiliary loss) under "
            "`sequence_parallel_size` > 1."
        )
