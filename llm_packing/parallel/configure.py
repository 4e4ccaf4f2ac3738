"""`configure_sequence_parallel(model, sequence_parallel_size)`: packing configured as usual, plus Ulysses attention
for batches cut by [`shard_packed_batch`](`llm_packing.parallel.shards`), and what sequence parallelism refuses.

Proven (`tests/test_sequence_parallel.py`, 2 and 4 gloo ranks): per-document logits, the loss and every parameter's
gradient equal each document run alone, for the types of `SEQUENCE_PARALLEL_MODEL_TYPES`. Refused: hybrid models (a
linear-attention or SSM mixer carries its state along the row, which a shard cannot see the start of), image-text
models, every type not proven, and MoE load-balancing losses (`output_router_logits`: a statistic over the whole
batch, of which a rank holds a piece). Attention runs on the hook's sdpa varlen route only (on CUDA
in half precision that is torch's FlashAttention varlen kernel).
"""

import torch
import torch.distributed as dist

from ..core.checks import check_integer
from ..errors import UnsupportedSetupError
from ..hook import registry
from ..hook.attention import varlen
from ..hook.configure import configure_packing
from ..hook.rotary import length_dependent_rope_types
from ..hook.support.architectures import non_attention_layer_types
from ..hook.support.mixers import MIXERS
from ..hook.support.sequence_parallel import SEQUENCE_PARALLEL_MODEL_TYPES
from .ulysses import check_heads, sharded_attention


_groups: dict[tuple[int, int], object] = {}  # (world size, group size) -> this rank's group


def configure_sequence_parallel(model, sequence_parallel_size: int, *, group=None):
    """
    Configure packing for rows cut across `sequence_parallel_size` ranks (Ulysses sequence parallelism).

    Every rank of a group gets the same packed batch and runs its own piece of each row (built by
    [`shard_packed_batch`]); each attention layer exchanges the pieces for a share of the heads, attends every
    document of the whole row with the row's global boundaries, and exchanges back. Each rank's loss is its token
    losses summed over the batch's target count, and each parameter's gradient is the sum over the group
    ([`sum_gradients`]): together they equal one process training on the whole rows.

    Args:
        model ([`~transformers.PreTrainedModel`]): the causal LM, the same on every rank.
        sequence_parallel_size (`int`): ranks a row is cut across, `N`. It must divide `num_attention_heads`.
        group (`torch.distributed.ProcessGroup`, *optional*): this rank's group of `N` ranks; by default consecutive
            ranks (`[0, N)`, `[N, 2N)`, ...; data parallel across groups), made with [`sequence_parallel_group`].

    Returns:
        The same `model`.

    Raises:
        `UnsupportedSetupError`: an unproven, hybrid or image-text model type, `output_router_logits=True`, heads
            not divisible by `N`, a backend other than sdpa's varlen route, or a group of another size.

    Example (on each of 2 ranks, after `torch.distributed.init_process_group`):
    ```python
    from llm_packing import configure_sequence_parallel, shard_packed_batch
    from llm_packing.parallel import sequence_parallel_group, sum_gradients

    configure_sequence_parallel(model, 2)
    group = sequence_parallel_group(2)
    for batch in loader:  # DataCollatorWithPacking batches, the same on both ranks of a group
        piece = shard_packed_batch(batch, rank=torch.distributed.get_rank(group), world_size=2)
        model(**piece).loss.backward()
        sum_gradients(model, group)
        optimizer.step()
        optimizer.zero_grad()
    ```
    """
    check_integer("sequence_parallel_size", sequence_parallel_size, meaning="ranks a packed row is cut across",
                  fix="Write `sequence_parallel_size: 1` for no sequence parallelism.")
    config = model.config
    require_sequence_parallel_support(config, sequence_parallel_size)
    if sequence_parallel_size == 1:
        return configure_packing(model)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        raise UnsupportedSetupError(
            f"Sequence parallelism runs attention on sdpa's per-document route, but the model uses "
            f"`attn_implementation`={config._attn_implementation!r}. Load it with `attn_implementation='sdpa'` (on "
            "CUDA in bfloat16 that route runs torch's FlashAttention varlen kernel)."
        )
    group = sequence_parallel_group(sequence_parallel_size) if group is None else group
    if dist.get_rank(group) < 0:
        raise UnsupportedSetupError(
            f"This process (global rank {dist.get_rank()}) is not a rank of `group`: each rank configures the group "
            "it belongs to. Pass this rank's group (`llm_packing.parallel.sequence_parallel_group(N)` on every rank), "
            "or leave `group` out."
        )
    if dist.get_world_size(group) != sequence_parallel_size:
        raise UnsupportedSetupError(
            f"`group` has {dist.get_world_size(group)} ranks but `sequence_parallel_size` is "
            f"{sequence_parallel_size}. Pass a group of that size, or leave `group` out."
        )
    configure_packing(model, attention_route="varlen")
    registry.replace_attribute(varlen, "sharded_attention", sharded_attention(group))
    return model


def require_sequence_parallel_support(config, sequence_parallel_size: int) -> None:
    """Raise `UnsupportedSetupError` unless sequence parallelism over `sequence_parallel_size` ranks is proven for
    this config's type and heads."""
    model_type = config.model_type
    hybrid = model_type in MIXERS or non_attention_layer_types(config)
    if hybrid or getattr(config, "vision_config", None) is not None or model_type not in SEQUENCE_PARALLEL_MODEL_TYPES:
        if sequence_parallel_size == 1:
            return
        reason = (
            "its linear-attention / SSM mixers carry a state along the row, which a rank holding a later piece "
            "never sees the start of" if hybrid else
            "image-text rows are not proven under sequence parallelism" if getattr(config, "vision_config", None)
            else "not proven under sequence parallelism"
        )
        raise UnsupportedSetupError(
            f"Sequence parallelism cannot be used with model_type {model_type!r}: {reason}. The "
            f"{len(SEQUENCE_PARALLEL_MODEL_TYPES)} proven types are in "
            "`llm_packing.parallel.SEQUENCE_PARALLEL_MODEL_TYPES` (docs/support_matrix.md, 'Sequence parallelism'). "
            "Set `sequence_parallel_size: 1`, or use one of those."
        )
    if sequence_parallel_size > 1 and (rope_types := length_dependent_rope_types(config)):
        raise UnsupportedSetupError(
            f"Sequence parallelism cannot be used with model_type {model_type!r} and its rope type "
            f"{rope_types}: the rotary frequencies follow each document's length, which a rank holding a "
            "piece of a document cannot read from its positions. Set `sequence_parallel_size: 1`."
        )
    if sequence_parallel_size > 1 and getattr(config, "output_router_logits", False):
        raise UnsupportedSetupError(
            f"Sequence parallelism cannot be used with model_type {model_type!r} while its config sets "
            "`output_router_logits=True`: the MoE load-balancing loss is a statistic over all tokens of the batch, "
            "and each rank holds only its piece of every row. Set `model.config.output_router_logits = False` (no "
            "auxiliary loss; TRL's trainers set it from `router_aux_loss_coef`, so pass "
            "`SFTConfig(router_aux_loss_coef=0.0)` there), or `sequence_parallel_size: 1`."
        )
    check_heads(config.num_attention_heads, sequence_parallel_size)


def sequence_parallel_group(sequence_parallel_size: int):
    """
    This rank's group of `sequence_parallel_size` consecutive ranks (`[0, N)`, `[N, 2N)`, ...). Every rank must
    call it (creating groups is collective); later calls return the same group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedSetupError(
            "Sequence parallelism needs `torch.distributed`: run under `accelerate launch` or `torchrun`, or call "
            "`torch.distributed.init_process_group` first."
        )
    world = dist.get_world_size()
    if world % sequence_parallel_size:
        raise UnsupportedSetupError(
            f"`sequence_parallel_size` ({sequence_parallel_size}) must divide the number of processes ({world}): "
            "the processes form groups of that size. Launch a multiple of it (`--num_processes`)."
        )
    key = (world, sequence_parallel_size)
    if key not in _groups:
        rank = dist.get_rank()
        for first in range(0, world, sequence_parallel_size):
            ranks = list(range(first, first + sequence_parallel_size))
            made = dist.new_group(ranks)
            if rank in ranks:
                _groups[key] = made
    return _groups[key]


def sum_gradients(model: torch.nn.Module, group) -> None:
    """Add up every parameter's gradient over the sequence-parallel `group`: each rank holds the gradient of its own
    tokens' losses only. (Data parallelism across groups averages as usual, e.g. DDP over the whole world with the
    loss scaled by `N`.)"""
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=group)
