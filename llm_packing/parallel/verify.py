"""The behavioural check of sequence parallelism: a tiny packed batch cut across the group, against each of its
documents run alone on this rank, within the limit `verify_packing` calibrates (`hook.verify_limits`)."""

import contextlib
import logging

import torch
import torch.distributed as dist

from ..errors import ContaminationError
from ..hook import guards
from ..hook.autocast import computed_dtype
from ..hook.verify import noise_floor_rows
from ..hook.verify_limits import compare
from .shards import shard_packed_batch


logger = logging.getLogger("llm_packing")

# Documents straddling every piece boundary of groups up to 8 ranks (a 37-token row), a one-token document, an odd
# row length (padded by the shard) and trailing padding in the first row.
_DOCUMENT_LENGTHS = ((11, 1, 13, 5), (4, 17, 16))


@torch.no_grad()
def verify_sequence_parallel(model, group, *, autocast=contextlib.nullcontext) -> float:
    """
    Run a tiny packed batch cut across `group` (every rank of the group must call this, with the same model) and
    compare each document's logits with the document run alone, within `autocast()` (the trainer's
    `accelerator.autocast`, so that the check runs the kernels and precision training runs).

    The limit is [`~llm_packing.verify_packing`]'s, calibrated on the spot: attention kernels round differently for
    different lengths, so a document's logits move when anything follows it, even where nothing can reach it (on
    SmolLM2-135M: up to 7e-4 in float32, 2.5 in bfloat16). Each document is also run followed by the other documents'
    tokens, unpacked, and the packed logits may differ from the alone ones by `max(base, 3 x that noise floor)` (the
    base: `1e-6`, or `2**-6` in half precision, times the largest logit alone). Raises `ContaminationError` past it.

    Returns:
        `float`: the largest absolute logit difference found.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    length = max(sum(row) for row in _DOCUMENT_LENGTHS)
    input_ids = torch.randint(3, model.config.vocab_size, (len(_DOCUMENT_LENGTHS), length), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    documents = []  # (row, start, token ids)
    for row, lengths in enumerate(_DOCUMENT_LENGTHS):
        start = 0
        for index, document_length in enumerate(lengths, start=1):
            attention_mask[row, start : start + document_length] = index
            documents.append((row, start, input_ids[row, start : start + document_length]))
            start += document_length
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.clone()}
    piece = {name: value.to(device) for name, value in shard_packed_batch(batch, rank, world).items()
             if name in ("input_ids", "attention_mask", "position_ids")}
    followed_ids = noise_floor_rows([ids for _, _, ids in documents], length).to(device)
    training = model.training
    model.eval()
    try:
        with autocast(), guards.unpacked_forwards():
            logits = model(**piece, use_cache=False).logits.contiguous()
            pieces = [torch.empty_like(logits) for _ in range(world)]
            dist.all_gather(pieces, logits, group=group)
            packed_logits = torch.cat(pieces, dim=1)
            followed_logits = model(input_ids=followed_ids, use_cache=False).logits
            alone = [model(input_ids=ids[None].to(device), use_cache=False).logits[0] for _, _, ids in documents]
            dtype = computed_dtype(next(model.parameters()))  # under autocast, the limits of its half precision
    finally:
        model.train(training)
    packed = [packed_logits[row, start : start + len(ids)] for row, start, ids in documents]
    followed = [followed_logits[k, : len(ids)] for k, (_, _, ids) in enumerate(documents)]
    compared = compare("logits", packed, followed, alone, None, dtype=dtype)
    if not compared.exact:
        raise ContaminationError(
            f"Sequence parallelism over {world} ranks changed packed logits by {compared.difference:.3g} against each "
            f"document alone ({compared.explained}): documents are not isolated across ranks. Train with "
            "`sequence_parallel_size: 1`, and report the model type and versions."
        )
    return compared.difference
