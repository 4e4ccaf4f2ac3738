"""Mllama's cross-attention to images, bounded by the document.

Mllama's text tokens cross-attend to image tiles; `cross_attention_mask` `(batch, length, images, tiles)` says which
image slots each token sees, and the packed batch gives each document's tokens its own slots only
(`llm_packing.batches.image_text`). That is not enough: transformers' `_prepare_cross_attention_mask` turns the row of
a token that sees no slot (text before a document's first image, every token of a document without images) into
zeros, i.e. attend to every vision token of the batch row uniformly, and the layer zeroes only its MLP branch for that
token (`full_text_row_masked_out_mask`). Alone, such a token attends to its own document's images (the only ones
there), and a document without images skips the cross-attention layers altogether; packed, both would read other
documents' images (packed logits differed from the documents alone by 0.039). While packing is configured:
- a forward pre-hook records, on the forward's documents (`hook.documents`), which document owns each image slot (a
  slot seen by tokens of two documents, or by padding, is refused);
- `_prepare_cross_attention_mask` gives a token that sees no slot its own document's slots, or none at all in a
  document without images;
- the cross-attention returns zeros for a token with no visible key: the attention branch of a document without
  images vanishes (its MLP branch already does), as when the layer is skipped for it alone.
An unpacked batch never yields a row without a visible key, so it runs as before.
"""

import functools
import inspect

import torch

from ...errors import PackingValueError
from .. import registry
from ..documents import current_documents, documents_of, same_elements, version_of
from ..masks import is_integer_mask


_SLOTS = "cross-attention slots"


def install(base_model: torch.nn.Module) -> None:
    """Add the slot record to `base_model` (the module called with `cross_attention_mask`) and replace Mllama's mask
    preparation and cross-attention, through the registry."""
    from transformers.models.mllama import modeling_mllama

    registry.add_forward_pre_hook(base_model, "cross-attention slots", _record_slot_documents)
    prepare = modeling_mllama._prepare_cross_attention_mask
    if not registry.is_ours(prepare):
        registry.replace_attribute(modeling_mllama, "_prepare_cross_attention_mask", registry.ours(_bounded(prepare)))
    attention = modeling_mllama.MllamaTextCrossAttention
    forward = attention.__dict__["forward"]
    if not registry.is_ours(forward):
        registry.replace_attribute(attention, "forward", registry.ours(_silent_without_keys(forward)))


def _record_slot_documents(module, args, kwargs):
    attention_mask, cross_attention_mask = kwargs.get("attention_mask"), kwargs.get("cross_attention_mask")
    if cross_attention_mask is None or not is_integer_mask(attention_mask) or not attention_mask.numel():
        return
    documents = documents_of(attention_mask)
    if not documents.is_packed:
        return
    ids = attention_mask.to(device=cross_attention_mask.device, dtype=torch.long)
    sees = cross_attention_mask.amax(-1) > 0  # (batch, length, slots)
    owner = torch.where(sees, ids[:, :, None], 0).amax(1)
    shared = torch.where(sees, ids[:, :, None], torch.iinfo(torch.long).max).amin(1) != owner
    seen = sees.any(1)
    if bool((seen & shared).any()) or bool((sees & (ids == 0)[:, :, None]).any()):
        row, slot = map(int, (seen & shared).nonzero()[0]) if bool((seen & shared).any()) else (-1, -1)
        raise PackingValueError(
            "`cross_attention_mask` lets tokens of several documents (or padding) see the same image slot"
            f"{f' (row {row}, slot {slot})' if row >= 0 else ''}: a document's tokens must see its own images only. "
            "Build the batch with `llm_packing.batches.image_text.pack_image_text_documents`."
        )
    documents.derived(_SLOTS, dict)["record"] = (
        cross_attention_mask, version_of(cross_attention_mask), ids, torch.where(seen, owner, -1)
    )


def _slot_documents(cross_attention_mask: torch.Tensor):
    """`(ids, slot_document)` recorded for this `cross_attention_mask` in this thread's forward, or None."""
    documents = current_documents()
    record = documents.derived(_SLOTS, dict).get("record") if documents is not None else None
    if record is None or not same_elements(record[0], record[1], cross_attention_mask):
        return None
    return record[2], record[3]


def _bounded(prepare):
    @functools.wraps(prepare)
    def prepare_bounded_by_document(cross_attention_mask, num_vision_tokens, dtype):
        mask, full_text_row = prepare(cross_attention_mask, num_vision_tokens=num_vision_tokens, dtype=dtype)
        slots = _slot_documents(cross_attention_mask)
        if slots is None:
            return mask, full_text_row
        ids, slot_document = slots
        own = (ids[:, :, None] == slot_document[:, None, :]).to(mask.device)
        own = own.repeat_interleave(cross_attention_mask.shape[-1] * num_vision_tokens, dim=2)[:, None]
        own_slots_only = torch.zeros_like(mask).masked_fill(~own, torch.finfo(mask.dtype).min)
        return torch.where(full_text_row == 0, own_slots_only, mask), full_text_row

    return prepare_bounded_by_document


def _silent_without_keys(forward):
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def cross_attention_silent_without_keys(*args, **kwargs):
        output, weights = forward(*args, **kwargs)
        mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            return output, weights
        sees_a_key = (mask > torch.finfo(mask.dtype).min).any(-1).any(1)[:, :, None]  # (batch, length, 1)
        return torch.where(sees_a_key, output, 0), weights

    return cross_attention_silent_without_keys
