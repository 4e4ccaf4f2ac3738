"""One rank's piece of a packed batch under sequence parallelism.

Every rank of a sequence-parallel group receives the same collated batch (`DataCollatorWithPacking`: `input_ids`,
`labels`, `position_ids`, the indexed `attention_mask` `[1, 1, 2, 2, 2, 0]`) and keeps a contiguous piece of each
row. What must be decided over the whole row is decided before cutting it (peers lost exactness on each of these):
- labels are shifted over the whole row, a target crossing into the next document dropped, so the last token of a
  piece keeps its target, the first token of the next piece (the model must not shift again: `shift_labels`);
- positions restart per document over the whole row: a piece starting inside a document continues its positions;
- the attention layers get the whole row's indexed mask, so document boundaries stay global.
"""

import numpy as np
import torch
import torch.distributed as dist

from ..core.checks import check_integer
from ..core.rows import IGNORE_INDEX
from ..errors import ContaminationError, PackingTypeError, PackingValueError, UnsupportedSetupError
from ..hook.attention import varlen
from ..hook.masks import document_position_ids, is_integer_mask, validate_document_ids


_ROW_KEYS = ("input_ids", "labels", "position_ids")


def shard_packed_batch(batch: dict, rank: int, world_size: int) -> dict:
    """
    The piece of a packed batch that rank `rank` of a sequence-parallel group of `world_size` ranks runs.

    Rows are padded to a multiple of `world_size` (pad tokens belong to no document and have no target) and cut into
    `world_size` contiguous pieces; rank `r` keeps piece `r` of every row. While sequence parallelism is configured
    ([`~llm_packing.configure_sequence_parallel`]) every rank of the group must call this with the same batch: one
    small collective checks that each holds the batch of the others and asks for its own piece (two ranks running the
    same piece, or pieces of different batches, would attend to the wrong tokens without an error). Called in a
    DataLoader worker (a `collate_fn`), which belongs to no group, it checks nothing.

    Args:
        batch (`dict`):
            A batch of `DataCollatorWithPacking`: `input_ids`, `attention_mask` (indexed, `(batch_size, length)`),
            `labels` (unshifted, as the collator emits them) and optionally `position_ids` (checked to restart per
            document). Media inputs (image-text rows) are refused.
        rank (`int`): this rank's index in its sequence-parallel group, in `[0, world_size)`.
        world_size (`int`): the sequence-parallel size `N`.

    Returns:
        `dict`: `input_ids`, `position_ids` and `labels` of the piece (`labels` already shifted, and again as
        `shift_labels`, which transformers' causal LM loss takes unshifted), the whole row's padded `attention_mask`,
        and `num_items_in_batch`, the targets of the whole batch: each rank's loss is its summed token losses over
        that count, so the group's losses add up to the batch's mean token loss.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.parallel import shard_packed_batch
    >>> batch = {
    ...     "input_ids": torch.tensor([[11, 12, 21, 22, 23]]),
    ...     "attention_mask": torch.tensor([[1, 1, 2, 2, 2]]),
    ...     "labels": torch.tensor([[-100, 12, -100, 22, 23]]),
    ... }
    >>> piece = shard_packed_batch(batch, rank=1, world_size=2)
    >>> piece["input_ids"], piece["position_ids"], piece["labels"]
    (tensor([[22, 23,  0]]), tensor([[1, 2, 0]]), tensor([[  23, -100, -100]]))
    >>> piece["attention_mask"], piece["num_items_in_batch"]
    (tensor([[1, 1, 2, 2, 2, 0]]), tensor(3))

    ```
    """
    check_integer("world_size", world_size, meaning="the sequence-parallel size",
                  fix="Pass `sequence_parallel_size`, e.g. 2.")
    check_integer("rank", rank, minimum=0, fix=f"Pass this rank's index in its group, below {world_size}.")
    if rank >= world_size:
        raise PackingValueError(
            f"`rank` must be below `world_size` ({world_size}), got {rank}. Pass the rank within the "
            "sequence-parallel group (`torch.distributed.get_rank(group)`), not the global rank."
        )
    mask = _indexed_mask(batch)
    _refuse_other_inputs(batch)
    group = getattr(varlen.sharded_attention, "group", None)
    if group is not None and torch.utils.data.get_worker_info() is None:  # a DataLoader worker has no group to ask
        _check_the_group_holds_this_batch(batch["input_ids"], mask, rank, world_size, group)
    ids = mask.detach().cpu().numpy().astype(np.int64)
    validate_document_ids(ids)
    positions = document_position_ids(mask)
    if batch.get("position_ids") is not None:
        _check_positions(batch["position_ids"], positions, mask)
    shifted = _shift_within_documents(batch["labels"], mask)
    rows = {"input_ids": batch["input_ids"], "position_ids": positions, "labels": shifted}
    padding = -mask.shape[1] % world_size
    single = ids.max(initial=0) <= 1
    if single and padding == 0 and not (ids == 0).any():
        padding = world_size  # room for the padding document below
    fills = {"input_ids": 0, "position_ids": 0, "labels": IGNORE_INDEX}
    rows = {name: _pad(tensor, padding, fills[name]) for name, tensor in rows.items()}
    piece = rows["input_ids"].shape[1] // world_size
    cut = slice(rank * piece, (rank + 1) * piece)
    shard = {name: tensor[:, cut].contiguous() for name, tensor in rows.items()}
    shard["shift_labels"] = shard["labels"]
    shard["attention_mask"] = _pad(mask, padding, 0)
    if single:
        # The hook routes a mask without a document id above 1 to transformers' own builders, which know nothing of
        # pieces: the padding becomes a document of its own (never trained on), so that the row counts as packed.
        shard["attention_mask"] = shard["attention_mask"].masked_fill(shard["attention_mask"] == 0, 2)
    shard["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return shard


def _check_the_group_holds_this_batch(input_ids, mask, rank: int, world_size: int, group) -> None:
    """Refuse ranks of `group` holding different batches, or asking for pieces other than their own: one all-gather
    of each rank's shape, token and mask checksums, and `rank`/`world_size` against its place in the group, on the
    device the group communicates on. Every rank sees every rank's values, so all raise together."""
    place = (dist.get_rank(group), dist.get_world_size(group))
    device = "cpu"
    if dist.get_backend(group) == "nccl":  # this rank's own GPU
        device = input_ids.device if input_ids.is_cuda else torch.device("cuda", torch.cuda.current_device())
    weights = torch.arange(1, input_ids.numel() + 1, device=device).view(input_ids.shape)
    # Built where it is gathered: the one host sync is reading what everyone sent.
    mine = torch.tensor([*input_ids.shape, 0, 0, rank, world_size, *place], device=device)
    mine[2:4] = torch.stack([(tensor.to(device).long() * weights).sum() for tensor in (input_ids, mask)])
    everyone = [torch.empty_like(mine) for _ in range(place[1])]
    dist.all_gather(everyone, mine, group=group)
    everyone = torch.stack(everyone).tolist()
    misplaced = [other[4:] for other in everyone if other[4:6] != other[6:]]
    if misplaced:
        claimed_rank, claimed_size, actual_rank, actual_size = misplaced[0]
        raise PackingValueError(
            f"`shard_packed_batch(..., rank={claimed_rank}, world_size={claimed_size})` was called on rank "
            f"{actual_rank} of a sequence-parallel group of {actual_size} ranks: two ranks would run the same piece "
            "of each row, or a piece would be missing. Pass `rank=torch.distributed.get_rank(group)` and "
            "`world_size=torch.distributed.get_world_size(group)`."
        )
    if any(other[:4] != everyone[0][:4] for other in everyone):
        raise ContaminationError(
            f"The ranks of a sequence-parallel group hold different batches (rows, length, token and mask checksums: "
            f"{[other[:4] for other in everyone]}): their pieces would attend to each other. Give every rank of the "
            "group the same batch: under `PackedSFTTrainer`, let it build its train dataloader and leave "
            "accelerate's `split_batches` off; in a loop of your own, load the same batch on each rank of the group."
        )


def _indexed_mask(batch: dict) -> torch.Tensor:
    missing = [name for name in ("input_ids", "attention_mask", "labels") if batch.get(name) is None]
    if missing:
        raise PackingTypeError(
            f"A sequence-parallel batch needs `input_ids`, `attention_mask` (indexed) and `labels`; missing "
            f"{missing}. Collate with `llm_packing.DataCollatorWithPacking` (its default layout)."
        )
    mask = batch["attention_mask"]
    if not is_integer_mask(mask) or mask.shape != batch["input_ids"].shape:
        raise PackingTypeError(
            f"`attention_mask` must be the indexed integer mask of shape {tuple(batch['input_ids'].shape)} "
            f"(`[1, 1, 2, 2, 2, 0]`), got {getattr(mask, 'dtype', type(mask).__name__)} of shape "
            f"{tuple(getattr(mask, 'shape', ()))}. Collate with `DataCollatorWithPacking` without `padding_free` or "
            "`return_flash_attn_kwargs`: sequence parallelism needs the document ids of the whole row."
        )
    return mask


def _refuse_other_inputs(batch: dict) -> None:
    """Image-text rows (pixel values, image grids, token types) are not proven under sequence parallelism: their
    vision towers and mRoPE positions would need the whole row on every rank."""
    other = sorted(set(batch) - {"input_ids", "attention_mask", *_ROW_KEYS})
    if other:
        raise UnsupportedSetupError(
            f"Sequence parallelism takes text rows only (`input_ids`, `attention_mask`, `labels`, `position_ids`); "
            f"the batch also holds {other}. Image-text rows are not proven under sequence parallelism: train them "
            "with `sequence_parallel_size: 1`."
        )


def _check_positions(given: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    wrong = (mask > 0) & (given.to(expected.device) != expected)
    if bool(wrong.any()):
        row, column = (int(index) for index in wrong.nonzero()[0])
        raise ContaminationError(
            f"`position_ids` must restart at 0 for every document of the whole row; row {row} position {column} has "
            f"{int(given[row, column])} where its document needs {int(expected[row, column])}. Pass the "
            "`position_ids` of DataCollatorWithPacking (or none: they are derived from the mask)."
        )


def _shift_within_documents(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`labels[:, t + 1]` as the target of token `t`, where token `t + 1` is in the same document; else -100."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    same_document = (mask[:, 1:] == mask[:, :-1]) & (mask[:, :-1] > 0)
    shifted[:, :-1] = torch.where(same_document, labels[:, 1:], IGNORE_INDEX)
    return shifted


def _pad(tensor: torch.Tensor, padding: int, fill: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, padding), value=fill) if padding else tensor
