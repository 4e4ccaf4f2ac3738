"""Sequence parallelism with packing (Ulysses): a packed row too long for one device, cut across `N` ranks, each
document still attending exactly as if it were alone.

- `shards`: [`shard_packed_batch`], a collated packed batch to one rank's contiguous piece of each row, with labels
  shifted over the whole row first (so no shard loses its last target), global per-document positions and the whole
  row's indexed mask;
- `collectives`: the all-to-all with its autograd (gradients made contiguous: gloo returned wrong ones otherwise);
- `ulysses`: the attention of a shard, sequence-sharded to head-sharded and back around the hook's per-document sdpa
  route over the whole row;
- `configure`: [`configure_sequence_parallel`], what is proven or refused under sequence parallelism, the rank groups,
  and the sum of gradients over a group;
- `verify`: the behavioural check, a tiny packed batch cut across the group against each document alone.

May import: `llm_packing.hook`, `llm_packing.core`, `llm_packing.errors`, torch and transformers; never `data`,
`batches`, `trainers`, `demo` or `cli`.
"""

from .configure import (
    SEQUENCE_PARALLEL_MODEL_TYPES,
    configure_sequence_parallel,
    require_sequence_parallel_support,
    sequence_parallel_group,
    sum_gradients,
)
from .shards import shard_packed_batch
from .verify import verify_sequence_parallel


__all__ = [
    "SEQUENCE_PARALLEL_MODEL_TYPES",
    "configure_sequence_parallel",
    "require_sequence_parallel_support",
    "sequence_parallel_group",
    "shard_packed_batch",
    "sum_gradients",
    "verify_sequence_parallel",
]
