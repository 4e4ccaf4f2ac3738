"""What a trainer changes for `sequence_parallel_size: N` (Ulysses, `llm_packing.parallel`).

- Batches: the `N` ranks of a group (consecutive ranks) must run the same packed rows, each its own piece. The
  sampler hands out each batch's indices `N` times in a row, so that accelerate's round-robin of batches over the
  processes gives every rank of a group the same batch, and each group a different one (data parallel across groups).
- Loss: each rank's loss is its piece's token losses summed over the batch's target count. Trainer counts the targets
  of every rank's batch (across devices by default), so a group's batch is counted `N` times: the count is divided by
  `N`. DDP then averages the `N`-times-scaled gradients into the group's sum.
"""

import math

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from transformers.trainer_utils import has_length

from ..errors import UnsupportedSetupError
from ..parallel import (
    configure_sequence_parallel,
    sequence_parallel_group,
    shard_packed_batch,
    verify_sequence_parallel,
)


class RepeatedBatches(Sampler):
    """
    The indices of a dataset of `size` rows (shuffled by `seed` and the epoch, or in order) in blocks of
    `batch_size`, each block `repeats` times in a row. The last block is completed with the first indices of the
    epoch (as accelerate's `even_batches` does), so that no block mixes with its copy, or with `drop_last` left out.
    Its own generator: every rank draws the same order without relying on the global random state.

    Example:
    ```python
    >>> list(RepeatedBatches(5, batch_size=2, repeats=2, shuffle=False))
    [0, 1, 0, 1, 2, 3, 2, 3, 4, 0, 4, 0]
    >>> list(RepeatedBatches(5, batch_size=2, repeats=2, shuffle=False, drop_last=True))
    [0, 1, 0, 1, 2, 3, 2, 3]

    ```
    """

    def __init__(self, size: int, batch_size: int, repeats: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        self.size, self.batch_size, self.repeats, self.shuffle, self.seed = size, batch_size, repeats, shuffle, seed
        self.drop_last = drop_last
        self.epoch = 0

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.size, generator=generator).tolist()
        else:
            indices = list(range(self.size))
        if self.drop_last:
            del indices[len(indices) - len(indices) % self.batch_size :]
        elif len(indices) % self.batch_size:
            indices += indices[: self.batch_size - len(indices) % self.batch_size]
        for first in range(0, len(indices), self.batch_size):
            for _ in range(self.repeats):
                yield from indices[first : first + self.batch_size]

    def __len__(self) -> int:
        blocks = self.size // self.batch_size if self.drop_last else math.ceil(self.size / self.batch_size)
        return blocks * self.batch_size * self.repeats

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def setup(trainer, sequence_parallel_size: int, verify: bool, where: str) -> object:
    """Configure the model for sequence parallelism over consecutive ranks, check the group on a tiny packed batch
    under the training's autocast (logging it), and return this rank's group."""
    args = trainer.args
    if args.world_size % sequence_parallel_size:
        raise UnsupportedSetupError(
            f"`sequence_parallel_size` ({sequence_parallel_size}) must divide the number of processes "
            f"({args.world_size}). Launch a multiple of it: `accelerate launch --num_processes "
            f"{sequence_parallel_size} ...` (on CPU: `--config_file recipes/accelerate/cpu-ddp.yaml`)."
        )
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise UnsupportedSetupError(
            f"`train_sampling_strategy`={args.train_sampling_strategy!r} deals batches out per rank itself, but "
            "sequence parallelism needs the ranks of a group to share each batch. Use 'random' or 'sequential'."
        )
    if not has_length(trainer.train_dataset):
        raise UnsupportedSetupError(
            "Sequence parallelism needs a map-style `train_dataset` (with a length): the ranks of a group must read "
            "the same rows, which a stream read per rank does not give. Pack it with `pack_dataset`, or set "
            "`sequence_parallel_size: 1`."
        )
    group = sequence_parallel_group(sequence_parallel_size)
    configure_sequence_parallel(trainer.model, sequence_parallel_size, group=group)
    if verify:
        difference = verify_sequence_parallel(trainer.model, group, autocast=trainer.accelerator.autocast)
        from ..hook.verify import logger

        logger.info("%sisolation verified across %d ranks: packed rows cut across the group give each document's "
                    "own logits (max abs diff %.2g)", where, sequence_parallel_size, difference)
    return group


def piece_of(inputs: dict, group, num_items_in_batch):
    """This rank's piece of a training batch, and the loss's target count over `N`: Trainer's count (every rank of a
    group counted the group's batch), else the batch's own (DDP averages over `N` ranks what must be their sum)."""
    piece = shard_packed_batch(inputs, dist.get_rank(group), dist.get_world_size(group))
    group_count = piece.pop("num_items_in_batch")
    count = group_count if num_items_in_batch is None else num_items_in_batch
    return piece, count / dist.get_world_size(group)
