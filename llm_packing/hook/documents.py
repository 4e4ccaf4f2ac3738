"""The documents of one packed forward: derived once from its indexed mask, and shared by every part of the hook.

A forward's mask builders, FlashAttention's unpad helper, sdpa's varlen route, the hybrid mixers, ALiBi and the sparse
key indexers all need the same facts about the mask `[1, 1, 2, 2, 2, 0]`: which tokens belong to which document. The
first of them to see the mask calls [`documents_of`], which copies it to the host once (the forward's one device
sync), checks the document ids once, and keeps a [`ForwardDocuments`] for the others; what each reader derives from
it (unpad data, attention buckets, mixer batches) is built once and kept on it too.

The mask builders also record the dense masks they make from a forward's documents (weakly), so that a reader of a
prepared mask (the sparse key indexers, `hook.attention.indexers`) finds the documents it isolates without another
host copy.

The state is per thread: `nn.DataParallel` (and so `Trainer` on a machine with several GPUs and no launcher) runs a
replica's forward on each of several threads at once, each with its own mask. A thread finds its own forward's state
by the mask tensor itself: the same elements (the tensor, or a view of its storage such as the
`attention_mask[:, -length:]` transformers hands hybrid mixers) unmodified since ([`version_of`]).

And it lives for one forward: a configured model's outermost forward on a thread forgets what earlier forwards read
([`enter_forward`]). Some writes leave a tensor's version as it was (a collate function refilling one numpy buffer
behind `torch.from_numpy`, writes through `.numpy()` or `.data`), so a mask rewritten that way between two forwards
looked unmodified, and the second forward ran on the first one's documents (0.25 off alone on a tiny Llama).
"""

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import PackingTypeError
from .masks import document_position_ids, document_runs, is_integer_mask, validate_document_ids


# Per-document work (varlen attention calls, mixer calls) runs documents of similar lengths side by side, each padded
# to the longest of its bucket. A bucket takes documents down to 1/BUCKET_RATIO of that length, so padding costs at
# most 20% of a bucket's tokens (36% of causal attention FLOPs), while lengths from 32 to 32,768 tokens fall into at
# most 32 buckets (calls per layer).
BUCKET_RATIO = 1.25
# Documents this short share one bucket whatever their lengths: per-call overhead outweighs their padding.
SMALLEST_BUCKET = 32


def bucket_bounds(descending_lengths: np.ndarray) -> list[tuple[int, int]]:
    """
    `(first, last)` index ranges of the buckets over document lengths sorted longest first: the one rule that groups
    per-document work.

    Example:
    ```python
    >>> import numpy as np
    >>> bucket_bounds(np.array([100, 90, 70, 40, 33, 20, 1]))
    [(0, 2), (2, 3), (3, 5), (5, 7)]

    ```
    """
    bounds, first = [], 0
    while first < len(descending_lengths):
        longest = descending_lengths[first]
        floor = 0 if longest <= SMALLEST_BUCKET else longest / BUCKET_RATIO
        # Lengths are descending: count those strictly above the floor.
        last = first + int(np.searchsorted(-descending_lengths[first:], -floor, side="left"))
        bounds.append((first, max(last, first + 1)))
        first = bounds[-1][1]
    return bounds


class ForwardDocuments:
    """
    The documents of one indexed mask, and what the hook derives from them, each computed once.

    Attributes: `mask` (the tensor, held so that no other tensor can reuse its memory and pass for it), `ids` (int64
    host copy, `(batch_size, length)`), `is_packed` (some document id above 1: a 0/1 mask is not packed).

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.documents import documents_of
    >>> documents = documents_of(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    >>> documents.starts.tolist(), documents.lengths.tolist()
    ([0, 2, 6, 7, 9], [2, 3, 1, 2, 3])

    ```
    """

    def __init__(self, mask: torch.Tensor, ids: np.ndarray):
        self.mask = mask
        self.version = version_of(mask)
        self.ids = ids
        self.is_packed = bool(ids.max(initial=0) > 1)
        if self.is_packed:
            validate_document_ids(ids)
        # (position_ids held, its version, host copy, checked)
        self._positions: tuple[torch.Tensor, int, np.ndarray, bool] | None = None
        self._derived: dict[Any, Any] = {}

    def describes(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is this state's mask, or a view of the same elements, unmodified since."""
        return same_elements(self.mask, self.version, tensor)

    def complete_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        """
        This forward's `position_ids` as `DataCollatorWithPacking` writes them: each document's own where none were
        given, else the given ones with 0 on padding. Recorded as the forward's positions, with a host copy derived
        from the ones held (the builders' position check copies nothing more).

        Example:
        ```python
        >>> import torch
        >>> from llm_packing.hook.documents import documents_of
        >>> mask = torch.tensor([[1, 1, 2, 2, 2, 0]])
        >>> documents_of(mask).complete_positions(None)
        tensor([[0, 1, 0, 1, 2, 0]])
        >>> documents_of(mask).complete_positions(torch.tensor([[0, 1, 0, 1, 2, 5]]))
        tensor([[0, 1, 0, 1, 2, 0]])

        ```
        """
        if position_ids is None:
            completed, host = document_position_ids(self.mask), document_position_ids(torch.from_numpy(self.ids))
            self._positions = (completed, version_of(completed), host.numpy(), False)
            return completed
        completed = position_ids.masked_fill(self.mask == 0, 0)
        held = self._positions
        if held is not None and same_elements(held[0], held[1], position_ids):
            self._positions = (completed, version_of(completed), np.where(self.ids == 0, 0, held[2]), False)
        return completed

    def derived(self, key, build: Callable[[], Any]):
        """`build()`, computed on the first call with `key` and kept for this forward: how each part of the hook
        attaches its own form of the layout (the varlen buckets, the mixers' document batches) without a second
        copy of the mask."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @property
    def starts(self) -> np.ndarray:
        """Flat start position (in the `(batch_size * length)` layout) of every document, row by row."""
        return self._spans[0]

    @property
    def lengths(self) -> np.ndarray:
        """Length of every document, in the order of `starts`."""
        return self._spans[1]

    @property
    def _spans(self) -> tuple[np.ndarray, np.ndarray]:
        def spans():
            tokens, first = document_runs(self.ids)
            return tokens[first], np.diff(np.append(first, len(tokens)))

        return self.derived("spans", spans)

    def add_prepared_mask(self, mask: torch.Tensor) -> None:
        """Record `mask`, which a builder made from these documents. Weakly: an `L x L` mask must not outlive its
        forward for this state's sake (and while it lives, no other tensor can take its memory)."""
        root = _root(mask)
        self.derived("prepared masks", list).append((weakref.ref(root), version_of(root)))

    def prepared(self, mask: torch.Tensor) -> bool:
        """Whether `mask` is a recorded mask or a view of one (the `[:, 0]` slice a layer takes), unmodified since."""
        root = _root(mask)
        return any(held() is root and version_of(root) == version for held, version in self._derived.get(
            "prepared masks", ()))

    def check_positions(self, position_ids: torch.Tensor, check: Callable[[np.ndarray], None]) -> None:
        """`check(positions)` on the int64 host copy of `position_ids` (broadcast to the mask's shape), once per
        positions tensor: the builders of one forward (full, sliding, chunked) share it."""
        held = self._positions
        if held is not None and same_elements(held[0], held[1], position_ids):
            if held[3]:
                return
            positions = held[2]
        else:
            positions = _to_host(position_ids.detach().long().expand(self.ids.shape))
        self._positions = (position_ids, version_of(position_ids), positions, False)
        check(positions)
        self._positions = (position_ids, version_of(position_ids), positions, True)


class _PerThread(threading.local):
    states: dict[str, ForwardDocuments]
    depth: int  # configured models' forwards running on this thread, nested
    outermost: Any  # the module whose forward began at depth 0
    generation: int  # `_generation` when it began
    positions_given: bool  # whether the latest configured module entered was given `position_ids`
    unchecked_positions: Any  # those `position_ids`, until a mask builder given none checks them (or None)

    def __init__(self):
        self.states, self.depth, self.outermost, self.generation = {}, 0, None, 0
        self.positions_given = True
        self.unchecked_positions = None


_per_thread = _PerThread()


_running: set[int] = set()  # the threads running a configured model's forward (`threading.get_ident()`)
_generation = 0  # counts `unconfigure_packing` calls: a forward begun before one has lost the hooks that end it


def enter_forward(module, *, positions_given: bool = True, position_ids: torch.Tensor | None = None) -> None:
    """`module`, a configured model's causal LM or base model, starts a forward on this thread (its pre-hook): the
    outermost one forgets the documents earlier forwards read, so that none can pass for this forward's. The outermost
    module entered again counts as a new forward: an interrupted one (`KeyboardInterrupt`, or an error in a compiled
    model) never ran the hook that ends it; so does any forward after `unconfigure_packing`, which removed that hook
    from forwards it interrupted ([`end_all_forwards`])."""
    if _per_thread.depth == 0 or module is _per_thread.outermost or _per_thread.generation != _generation:
        _per_thread.states.clear()
        _per_thread.depth, _per_thread.outermost, _per_thread.generation = 0, module, _generation
        _running.add(threading.get_ident())
    _per_thread.depth += 1
    _per_thread.positions_given = positions_given
    _per_thread.unchecked_positions = position_ids


def leave_forward() -> None:
    """The forward [`enter_forward`] counted has ended, normally or by an exception."""
    _per_thread.depth = max(_per_thread.depth - 1, 0)
    if _per_thread.depth == 0:
        _per_thread.outermost = None
        _per_thread.unchecked_positions = None
        _running.discard(threading.get_ident())


def end_all_forwards() -> None:
    """`unconfigure_packing` removed the hooks that end forwards: every forward begun before counts as ended (on
    every thread, at its next forward)."""
    global _generation
    _generation += 1
    _running.clear()
    _per_thread.states.clear()
    _per_thread.depth, _per_thread.outermost = 0, None


def positions_were_given() -> bool:
    """Whether this thread's configured forward was given `position_ids` (else the model numbered its tokens itself,
    `0..length`); True outside one, where it cannot be told."""
    return _per_thread.positions_given or not _in_forward()


def take_unchecked_positions() -> torch.Tensor | None:
    """The `position_ids` this thread's configured forward was given, once: for the first mask builder that is handed
    none (afmoe, gpt_oss, opt, biogpt, bloom, mpt build their masks without them), to check that they do not restart
    within a row; None outside a forward, or after the first call."""
    positions, _per_thread.unchecked_positions = _per_thread.unchecked_positions, None
    return positions if _in_forward() else None


def _in_forward() -> bool:
    """Whether a configured model's forward runs on this thread (begun since the last `unconfigure_packing`)."""
    return _per_thread.depth > 0 and _per_thread.generation == _generation


def forwards_running_elsewhere() -> list[int]:
    """The other live threads running a configured model's forward now."""
    alive = {thread.ident for thread in threading.enumerate()}
    return sorted(ident for ident in set(_running) if ident != threading.get_ident() and ident in alive)


def version_of(tensor: torch.Tensor) -> int | None:
    """`tensor._version`, which counts its in-place writes; None for an inference tensor (made under
    `torch.inference_mode()`), which keeps no count (reading it raises): one is recognised by its storage alone,
    within its forward."""
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def documents_of(attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> ForwardDocuments:
    """
    The [`ForwardDocuments`] of an integer 2-D mask: this thread's current one if it describes the mask, else a new
    one (the forward's device-to-host copy, together with `position_ids` when they are 2-D positions of the same
    tokens, and the id checks).

    Raises [`~llm_packing.errors.PackingValueError`] for malformed document ids (see `masks.validate_document_ids`).
    """
    return _documents(attention_mask, position_ids, "mask")


def documents_that_prepared(mask: torch.Tensor) -> ForwardDocuments | None:
    """The documents of this thread's current forward if its mask builders made `mask` (or the tensor it views) from
    them, else None."""
    current = _per_thread.states.get("mask")
    return current if current is not None and current.prepared(mask) else None


def current_documents() -> ForwardDocuments | None:
    """This thread's latest [`ForwardDocuments`] of an indexed mask (those of the forward running on this thread), for
    parts of the hook handed another tensor than the mask, which check that what they kept on it belongs to that
    tensor (Mllama's cross-attention mask); None if this thread has read no mask."""
    return _per_thread.states.get("mask")


def documents_from_positions(position_ids: torch.Tensor) -> ForwardDocuments:
    """The documents that `position_ids` (`(batch_size, length)`) delimit: a new one starts at every 0 (padding too
    becomes one-token documents). For mixers handed only the prepared 4-D mask, after the mask builder of the same
    forward checked these positions against the indexed mask."""
    current = _per_thread.states.get("positions")
    if current is not None and current.describes(position_ids):
        return current
    ids = np.cumsum(_to_host(position_ids.detach().long()) == 0, axis=1)
    state = _per_thread.states["positions"] = ForwardDocuments(position_ids, ids)
    return state


def _documents(attention_mask, position_ids, kind) -> ForwardDocuments:
    current = _per_thread.states.get(kind)
    if current is not None and current.describes(attention_mask):
        return current
    mask = attention_mask.detach().long()
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != mask.shape[-1]):
        position_ids = None  # 3-D (mRoPE) positions, or those of the new tokens while decoding: checked elsewhere
    if position_ids is None:
        host, positions = _to_host(mask), None
    else:  # one device-to-host copy for both
        host, positions = _to_host(torch.stack([mask, position_ids.detach().to(mask.device).long().expand_as(mask)]))
    # Drop the previous forward's state before validating (a malformed mask must not leave a stale one behind).
    _per_thread.states.pop(kind, None)
    state = ForwardDocuments(attention_mask, host)
    if positions is not None:
        state._positions = (position_ids, version_of(position_ids), positions, False)
    _per_thread.states[kind] = state
    return state


def _to_host(tensor: torch.Tensor) -> np.ndarray:
    """The device-to-host copy of a forward (`tests/test_varlen.py` counts these)."""
    return tensor.cpu().numpy()


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that `tensor` views (itself if it is no view)."""
    return tensor if tensor._base is None else tensor._base


def same_elements(held: torch.Tensor, version, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is `held` (or a view of the same elements) and unmodified since its version was `version`:
    how per-forward state recognises the tensor it was derived from."""
    if tensor.numel() == 0:
        return False
    if version is None and not _in_forward():
        return False  # an inference tensor outside a configured model's forward: its storage may hold another mask
    same = held is tensor or (
        held.device == tensor.device and held.dtype == tensor.dtype and held.shape == tensor.shape
        and held.stride() == tensor.stride() and held.storage_offset() == tensor.storage_offset()
        and held.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    )
    return same and version_of(tensor) == version


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
    >>> from llm_packing.hook.documents import get_unpad_data
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
    if is_integer_mask(attention_mask):
        documents = documents_of(attention_mask)
    else:  # a user's bool or float 0/1 mask: read once, not kept as a forward's state
        _refuse_rounded_ids(attention_mask)
        documents = ForwardDocuments(attention_mask, _to_host(attention_mask.detach().long()))
    return documents.derived("unpad", lambda: _unpad_data(documents, attention_mask.device))


def _refuse_rounded_ids(attention_mask: torch.Tensor) -> None:
    if attention_mask.is_floating_point() and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise PackingTypeError(
            f"`attention_mask` is {attention_mask.dtype} with values other than 0 and 1 (max "
            f"{attention_mask.max().item():g}): document ids would be rounded. Pass the indexed mask as integers "
            "(`attention_mask.long()`)."
        )


def _unpad_data(documents: ForwardDocuments, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    ids = documents.ids
    if documents.is_packed:
        indices, first = document_runs(ids)
        cu_seqlens = np.append(first, len(indices))
    else:
        # One segment per row, rows without tokens included, as transformers' own `_get_unpad_data` does.
        indices = np.flatnonzero(ids.reshape(-1))
        cu_seqlens = np.concatenate([[0], np.cumsum((ids != 0).sum(axis=1))])
    max_seqlen = int(np.diff(cu_seqlens).max(initial=0))
    return (
        torch.from_numpy(indices).to(device),
        torch.from_numpy(cu_seqlens.astype(np.int32)).to(device),
        max_seqlen,
    )


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
    >>> from llm_packing.hook.documents import get_seqlens_in_batch
    >>> get_seqlens_in_batch(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    tensor([2, 3, 1, 2, 3], dtype=torch.int32)

    ```
    """
    _, cu_seqlens, _ = get_unpad_data(attention_mask)
    return cu_seqlens.diff()
