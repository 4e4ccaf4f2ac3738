"""Ulysses attention over a packed row cut across the ranks of a sequence-parallel group.

Each rank holds `length / N` consecutive tokens of every row and all `H` heads. One all-to-all per tensor trades that
for all `length` tokens and `H / N` heads; the hook's per-document sdpa route (`llm_packing.hook.attention.varlen`)
then attends every document of the whole row, with the whole row's layout (global boundaries, sliding windows); a last
all-to-all trades the output back. Attention is per head, so the head-sharded call is exactly the unsharded one.
"""

import torch.distributed as dist

from ..errors import UnsupportedSetupError
from ..hook import registry
from ..hook.attention import varlen
from .collectives import all_to_all


def sharded_attention(group):
    """The attention the hook's sdpa route calls for a shard's queries while sequence parallelism over `group` is
    configured (`hook.attention.varlen.sharded_attention`)."""

    def ulysses_attention(module, query, key, value, mask: varlen.PackedAttentionMask, dropout=0.0, scaling=None,
                          **kwargs):
        world = dist.get_world_size(group)
        heads = query.shape[1]
        check_heads(heads, world)
        if query.shape[2] * world != mask.length:
            raise UnsupportedSetupError(
                f"A shard of {query.shape[2]} tokens reached attention with a row of {mask.length} tokens, but "
                f"the sequence-parallel group has {world} ranks (pieces of {mask.length // world}). Build each "
                "rank's batch with `llm_packing.parallel.shard_packed_batch(batch, rank, world_size)` with the "
                "group's size."
            )
        key, value = (_kv_heads_for_ranks(tensor, heads, world) for tensor in (key, value))
        # (batch, heads, length / N, dim) -> (batch, heads / N, length, dim)
        query, key, value = (all_to_all(tensor, group, scatter_dim=1, gather_dim=2) for tensor in (query, key, value))
        output = varlen.packed_sdpa_attention(module, query, key, value, mask, dropout, scaling, **kwargs)
        # (batch, length, heads / N, dim) -> (batch, length / N, heads, dim), the layout attention functions return,
        # contiguous as theirs is: afmoe, dory and jetmoe `view` it
        return all_to_all(output, group, scatter_dim=1, gather_dim=2).contiguous()

    # Like every replacement of the hook, eager inside a compiled model: its layout and collectives are per forward.
    attention = registry.outside_graphs(ulysses_attention)
    attention.group = group  # `shard_packed_batch` checks the group's batches
    return attention


def check_heads(heads: int, world: int, name: str = "num_attention_heads") -> None:
    """Ulysses gives each rank `heads / N` query heads: refuse a count the group size does not divide."""
    if heads % world:
        divisors = [size for size in range(1, heads + 1) if heads % size == 0]
        raise UnsupportedSetupError(
            f"Sequence parallelism splits the attention heads across the group: `{name}` ({heads}) must be a "
            f"multiple of `sequence_parallel_size`, got {world}. Use a `sequence_parallel_size` in {divisors}."
        )


def _kv_heads_for_ranks(tensor, heads: int, world: int):
    """Key or value heads that the all-to-all can deal out so that each rank receives those its query heads read:
    unchanged when `N` divides them; repeated to `N` heads when fewer (each rank's query heads then share one); else
    repeated to one per query head."""
    kv_heads = tensor.shape[1]
    if kv_heads % world == 0:
        return tensor
    copies = world // kv_heads if world % kv_heads == 0 else heads // kv_heads
    return tensor.repeat_interleave(copies, dim=1)
