"""NEFTune per document: each packed document's embedding noise scaled by its own length, as alone.

NEFTune (`neftune_noise_alpha`) adds uniform noise of magnitude `alpha / sqrt(length x hidden size)` to the input
embeddings in training, `length` being the batch's row length (transformers' `neftune_post_forward_hook`). A packed
row is `max_length` long, so every document got several times less noise than alone, and more or less by where it
was packed. Here the hook reads each token's document length from the forward's own documents (the indexed mask the
hook read on this thread: `nn.DataParallel` runs each replica's slice on a thread of its own), else from the batch's
`position_ids` (they restart at 0 per document), so a document gets the noise it gets trained alone (padding, masked
anyway, as one-token runs).
"""

import contextlib
import functools
import threading

import torch
from transformers.integrations.neftune import deactivate_neftune

from ..hook.documents import current_documents
from ..hook.masks import document_lengths_per_token, document_position_ids


class _Positions(threading.local):
    position_ids = None  # the `position_ids` of the batch this thread's trainer is computing the loss of


_batch = _Positions()


@contextlib.contextmanager
def batch_positions(inputs: dict):
    """Keep `inputs`' `position_ids` for the hook while the loss is computed on this thread."""
    previous, _batch.position_ids = _batch.position_ids, inputs.get("position_ids")
    try:
        yield
    finally:
        _batch.position_ids = previous


def activate(model, alpha: float, accelerator):
    """Register the per-document hook on `model`'s input embeddings (unwrapped, PEFT's base model's for PEFT); the
    handle for `deactivate`."""
    embeddings = _embeddings(accelerator.unwrap_model(model))
    embeddings.neftune_noise_alpha = alpha
    return embeddings.register_forward_hook(functools.partial(_noise_per_document, alpha=alpha))


def deactivate(model, handle, accelerator) -> None:
    deactivate_neftune(model, handle, accelerator)


def _embeddings(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.get_input_embeddings()


def _noise_per_document(module, args, output, *, alpha: float):
    """
    Uniform noise in `(-alpha / sqrt(n x d), alpha / sqrt(n x d))` on each token's embedding, `n` its document's
    length, `d` the hidden size; transformers' own row-length noise where the batch carries no `position_ids`.
    """
    if not module.training:
        return output
    positions = _forward_positions(output)
    if positions is None or positions.shape[-2:] != output.shape[:2]:
        magnitude = alpha / (output.size(1) * output.size(2)) ** 0.5
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
    lengths = document_lengths_per_token(positions.to(output.device))
    magnitude = alpha / (lengths.to(output.dtype) * output.size(2)).sqrt()
    noise = torch.zeros_like(output).uniform_(-1.0, 1.0) * magnitude[..., None]
    return output + noise


def _forward_positions(output: torch.Tensor) -> torch.Tensor | None:
    """The per-document positions of the forward running on this thread: from its indexed mask where the hook read one
    of `output`'s shape, else those the trainer's thread recorded for its batch (padding-free batches)."""
    documents = current_documents()
    if documents is not None and documents.is_packed and documents.ids.shape == tuple(output.shape[:2]):
        # The forward's mask builders derive the same positions under this key: computed once, whoever comes first.
        return documents.derived("position_ids", lambda: document_position_ids(documents.mask))
    return _batch.position_ids
