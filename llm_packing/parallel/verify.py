"""The behavioural check of sequence parallelism: a tiny packed batch cut across the group, against each of its
documents run alone on this rank."""

import logging

import torch
import torch.distributed as dist

from ..errors import ContaminationError
from .shards import shard_packed_batch


logger = logging.getLogger("llm_packing")

# Documents straddling every piece boundary of groups up to 8 ranks (a 37-token row), a one-token document, an odd
# row length (padded by the shard) and trailing padding in the first row.
_DOCUMENT_LENGTHS = ((11, 1, 13, 5), (4, 17, 16))
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}


@torch.no_grad()
def verify_sequence_parallel(model, group) -> float:
    """
    Run a tiny packed batch cut across `group` (every rank of the group must call this, with the same model) and
    compare each document's logits with the document run alone; raise `ContaminationError` past the tolerance of the
    model's dtype (1e-4 in float32, 1e-2 in half precision). Returns the largest difference.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    length = max(sum(row) for row in _DOCUMENT_LENGTHS)
    batch = {name: torch.zeros(len(_DOCUMENT_LENGTHS), length, dtype=torch.long)
             for name in ("input_ids", "attention_mask")}
    batch["input_ids"] = torch.randint(3, model.config.vocab_size, batch["input_ids"].shape, generator=generator)
    for row, lengths in enumerate(_DOCUMENT_LENGTHS):
        batch["attention_mask"][row, : sum(lengths)] = torch.repeat_interleave(
            torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    batch["labels"] = batch["input_ids"].clone()
    piece = shard_packed_batch(batch, rank, world)
    piece = {name: value.to(device) for name, value in piece.items() if name in ("input_ids", "attention_mask",
                                                                                  "position_ids")}
    training = model.training
    model.eval()
    try:
        logits = model(**piece, use_cache=False).logits.contiguous()
        pieces = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(pieces, logits, group=group)
        packed = torch.cat(pieces, dim=1)
        difference = 0.0
        for row, lengths in enumerate(_DOCUMENT_LENGTHS):
            start = 0
            for document_length in lengths:
                ids = batch["input_ids"][row : row + 1, start : start + document_length].to(device)
                alone = model(input_ids=ids, use_cache=False).logits
                difference = max(difference, (packed[row, start : start + document_length] - alone[0]).abs().max()
                                 .item())
                start += document_length
    finally:
        model.train(training)
    tolerance = _TOLERANCE.get(logits.dtype, 1e-2)
    if not difference <= tolerance:
        raise ContaminationError(
            f"Sequence parallelism over {world} ranks changed packed logits by {difference:.3g} against each document "
            f"alone (tolerance {tolerance:g} in {logits.dtype}): documents are not isolated across ranks. Train with "
            "`sequence_parallel_size: 1`, and report the model type and versions."
        )
    return difference
