"""Indexed packed attention masks: `[1, 1, 2, 2, 2, 0]` = document 1 (2 tokens), document 2 (3 tokens), one pad.

Everything here is vectorised over rows and documents. An integer mask is copied to the host once per forward
(`host_copy`, the only device sync), shared by the hook's mask builders, `get_unpad_data` (which also remembers its
last answer, so the per-layer calls of FlashAttention's `_upad_input` reuse it), the varlen layout and the hybrid
mixers. A plain 0/1 (or bool) mask gets exactly what transformers' own `_get_unpad_data` gives.
"""

import threading
import weakref

import numpy as np
import torch

from ..errors import PackingTypeError, PackingValueError


def is_indexed_packed_mask(attention_mask: torch.Tensor | None) -> bool:
    """
    Whether `attention_mask` is an indexed packed mask: a 2-D integer tensor where some row holds a document index > 1.

    Args:
        attention_mask (`torch.Tensor` or `None`):
            A mask of shape `(batch_size, sequence_length)`.

    Returns:
        `bool`: `True` for indexed masks, `False` for `None`, bool, float, 0/1 and non-2-D masks.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.masks import is_indexed_packed_mask
    >>> is_indexed_packed_mask(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    True
    >>> is_indexed_packed_mask(torch.tensor([[1, 1, 1, 0]]))
    False

    ```
    """
    if not _is_integer_2d(attention_mask) or attention_mask.numel() == 0:
        return False
    return bool(attention_mask.max() > 1)


def get_seqlens_in_batch(attention_mask: torch.Tensor) -> torch.Tensor:
    """
    Lengths of the documents of an indexed mask, row by row, in order.

    Args:
        attention_mask (`torch.Tensor`):
            Indexed mask of shape `(batch_size, sequence_length)`: 1-based document index per token, 0 for padding.

    Returns:
        `torch.Tensor`: int32 lengths, one per document, on the mask's device.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.masks import get_seqlens_in_batch
    >>> get_seqlens_in_batch(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    tensor([2, 3, 1, 2, 3], dtype=torch.int32)

    ```
    """
    _, cu_seqlens, _ = get_unpad_data(attention_mask)
    return cu_seqlens.diff()


def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """
    Unpadding data for varlen attention kernels, one segment per document (a drop-in for transformers'
    `_get_unpad_data`).

    Args:
        attention_mask (`torch.Tensor`):
            Indexed mask of shape `(batch_size, sequence_length)`: 1-based document index per token, 0 for padding.
            A 0/1 or bool mask gives one segment per row, exactly as transformers does.

    Returns:
        `tuple`: `indices` (int64 positions of the non-padding tokens in the flattened mask), `cu_seqlens` (int32
        cumulative document lengths, starting at 0) and `max_seqlen` (`int`, the longest document).

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.masks import get_unpad_data
    >>> indices, cu_seqlens, max_seqlen = get_unpad_data(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    >>> indices
    tensor([ 0,  1,  2,  3,  4,  6,  7,  8,  9, 10, 11])
    >>> cu_seqlens
    tensor([ 0,  2,  5,  6,  8, 11], dtype=torch.int32)
    >>> max_seqlen
    3

    ```
    """
    if not isinstance(attention_mask, torch.Tensor):
        raise PackingTypeError(
            f"`attention_mask` must be a torch.Tensor of shape (batch_size, sequence_length), got "
            f"{type(attention_mask).__name__}. Convert it first, e.g. `torch.tensor(mask)`."
        )
    if attention_mask.dim() != 2:
        raise PackingTypeError(
            f"`attention_mask` must be 2-D (batch_size, sequence_length), got shape {tuple(attention_mask.shape)}. "
            "Pass the indexed 2-D mask from DataCollatorWithPacking, not a prepared 4-D mask."
        )
    cached = _last_unpad.get(attention_mask)
    if cached is not None:
        return cached
    if _is_integer_2d(attention_mask):
        ids, _ = host_copy(attention_mask)
    else:
        host = attention_mask.detach().cpu()
        if host.is_floating_point() and bool(((host != 0) & (host != 1)).any()):
            raise PackingTypeError(
                f"`attention_mask` is {host.dtype} with values other than 0 and 1 (max {host.max().item():g}): "
                "document ids would be rounded. Pass the indexed mask as integers (`attention_mask.long()`)."
            )
        ids = host.to(torch.int64).numpy()
    if ids.max(initial=0) > 1:
        validate_document_ids(ids)
        indices, first = document_runs(ids)
        cu_seqlens = np.append(first, len(indices))
    else:
        # One segment per row, rows without tokens included, as transformers' own `_get_unpad_data` does.
        indices = np.flatnonzero(ids.reshape(-1))
        cu_seqlens = np.concatenate([[0], np.cumsum((ids != 0).sum(axis=1))])
    max_seqlen = int(np.diff(cu_seqlens).max(initial=0))
    device = attention_mask.device
    result = (
        torch.from_numpy(indices).to(device),
        torch.from_numpy(cu_seqlens.astype(np.int32)).to(device),
        max_seqlen,
    )
    _last_unpad.set(attention_mask, result)
    return result


def document_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """
    Positions restarting at 0 for every document of an indexed mask; each padding token is its own segment at 0.

    Computed on the mask's device with no host sync.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.masks import document_position_ids
    >>> document_position_ids(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    tensor([[0, 1, 0, 1, 2, 0],
            [0, 0, 1, 0, 1, 2]])

    ```
    """
    ids = attention_mask.long()
    columns = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = (ids[:, 1:] != ids[:, :-1]) | (ids[:, 1:] == 0)
    first_column_of_segment = torch.where(starts, columns, torch.zeros_like(columns)).cummax(dim=1).values
    return columns - first_column_of_segment


def document_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """
    The real tokens of indexed document ids (`(batch_size, length)`, 0 on padding) and where each document starts.

    Returns the flat indices of the non-zero ids, and for each document the position in that array of its first token:
    a document starts where the (row, document id) pair changes between consecutive real tokens.

    Example:
    ```python
    >>> import numpy as np
    >>> document_runs(np.array([[1, 1, 2, 2, 2, 0], [1, 0, 0, 0, 0, 0]]))
    (array([0, 1, 2, 3, 4, 6]), array([0, 2, 5]))

    ```
    """
    flat = ids.reshape(-1)
    tokens = np.flatnonzero(flat)
    row = tokens // ids.shape[1]
    starts = np.ones(len(tokens), dtype=bool)
    starts[1:] = (flat[tokens[1:]] != flat[tokens[:-1]]) | (row[1:] != row[:-1])
    return tokens, np.flatnonzero(starts)


class _HostCopy(threading.local):
    """The host copy of the last integer mask (and `position_ids`) seen in this thread, and its document spans. It
    holds the tensors themselves: while they live, no other tensor can reuse their memory and pass for them."""

    mask = version = positions = positions_version = None
    ids = host_positions = spans = None


_host = _HostCopy()


def _same_tensor(held: torch.Tensor | None, tensor: torch.Tensor, version) -> bool:
    """`tensor` is `held` or a view of the same elements (transformers hands hybrid mixers
    `attention_mask[:, -length:].contiguous()`, a new view of the mask the builders saw), unmodified since."""
    if held is None or tensor.numel() == 0:
        return False
    same = held is tensor or (
        held.device == tensor.device and held.dtype == tensor.dtype and held.shape == tensor.shape
        and held.stride() == tensor.stride() and held.storage_offset() == tensor.storage_offset()
        and held.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    )
    return same and tensor._version == version


def host_copy(attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None):
    """
    int64 host copies of an integer 2-D mask and, if given, of `position_ids` broadcast to its shape, made in one
    device-to-host copy and remembered per thread for the mask's elements and version: the mask builders, the varlen
    layout and the hybrid mixers' re-batching of one forward share a single host sync.

    Returns `(ids, positions)`, `positions` `None` without `position_ids`.
    """
    hit = _same_tensor(_host.mask, attention_mask, _host.version)
    if hit and position_ids is not None:
        hit = _same_tensor(_host.positions, position_ids, _host.positions_version)
    if hit:
        return _host.ids, _host.host_positions if position_ids is not None else None
    stacked = attention_mask.detach().long()
    if position_ids is not None:
        stacked = torch.stack([stacked, position_ids.detach().to(stacked.device).long().expand_as(stacked)])
    host = to_host(stacked)
    ids, positions = (host[0], host[1]) if position_ids is not None else (host, None)
    _host.mask, _host.version, _host.ids, _host.spans = attention_mask, attention_mask._version, ids, None
    _host.positions, _host.host_positions = position_ids, positions
    _host.positions_version = None if position_ids is None else position_ids._version
    return ids, positions


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """The one device-to-host copy of [`host_copy`]."""
    return tensor.cpu().numpy()


def document_spans(attention_mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Flat start position and length (int64) of every document of a validated indexed mask, row by row, computed
    once per [`host_copy`]."""
    ids, _ = host_copy(attention_mask)
    if _host.spans is None:
        positions, first = document_runs(ids)
        _host.spans = positions[first], np.diff(np.append(first, len(positions)))
    return _host.spans


def validate_document_ids(ids: np.ndarray) -> None:
    """Raise unless every row numbers its documents 1, 2, 3, ... in order, each as one contiguous run (0 = padding)."""
    if ids.min(initial=0) < 0:
        raise PackingValueError(
            f"`attention_mask` holds negative document ids (min {ids.min()}). Use 1, 2, 3, ... for documents and 0 "
            "for padding, as DataCollatorWithPacking emits."
        )
    previous_max = np.zeros_like(ids)
    previous_max[:, 1:] = np.maximum.accumulate(ids, axis=1)[:, :-1]
    previous_token = np.zeros_like(ids)
    previous_token[:, 1:] = ids[:, :-1]
    real = ids > 0
    # Each real token continues the current document (same id, right after it) or opens the next one (id + 1).
    continues = (ids == previous_max) & (previous_token == ids)
    bad = real & ~continues & (ids != previous_max + 1)
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        raise PackingValueError(
            f"`attention_mask` row {row} has document id {int(ids[row, col])} at position {col} after "
            f"{ids[row, :col].tolist()}: documents must be numbered 1, 2, 3, ... in order, each one contiguous run "
            "(0 for padding, never inside a document). Build masks with DataCollatorWithPacking."
        )


def _is_integer_2d(attention_mask: torch.Tensor | None) -> bool:
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.dtype != torch.bool
        and not attention_mask.dtype.is_floating_point
        and not attention_mask.dtype.is_complex
    )


class _LastResult:
    """Remembers the unpad data of the last mask seen, so that every layer of one forward shares a single host sync."""

    def __init__(self):
        self._mask_ref = None
        self._version = None
        self._result = None

    def get(self, mask: torch.Tensor):
        if self._mask_ref is not None and self._mask_ref() is mask and self._version == mask._version:
            return self._result
        return None

    def set(self, mask: torch.Tensor, result) -> None:
        self._mask_ref, self._version, self._result = weakref.ref(mask), mask._version, result


_last_unpad = _LastResult()
