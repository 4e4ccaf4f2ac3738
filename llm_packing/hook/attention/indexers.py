"""Per-document key selection for the DeepSeek sparse attention (DSA) indexers of deepseek_v32, glm_moe_dsa, hy_v4,
dots3_note (and its text model) and axk2.

An indexer scores every key for each query and keeps the `index_topk` best with `torch.topk`; attention then sees
only those keys. The packed mask reaches its scores (keys of other documents score -inf), but the scores hold exact
ties: `relu(q . k)` is 0.0 wherever every index head scores a key below zero, and which of several tied keys `topk`
keeps depends on the whole row it ranks, so on the document's offset in the packed row and on the row's length.
Unwrapped, a packed document kept other keys than alone: logits off by up to 0.29 on random layouts (issue 25).

The hook runs the original indexer once per group of documents of exactly the same length, on exactly the rows each
document alone gives it: its hidden states, query residuals, rotary angles and its own `(length, length)` mask; the
chosen keys go back to the packed layout, shifted to the document's start. A document shorter than `index_topk` keeps
all its keys alone, and fills the slots left over with its token's own position: the eager and sdpa attentions scatter
the indices into a mask, where a repeat selects nothing new (the backends that would read the indices themselves are
not offered for these types). One-token documents and padding tokens select themselves, as alone.

Groups are of one exact length, not the buckets of `documents.bucket_bounds` that varlen attention and the mixers use:
right-padding a document to its bucket's width hands `topk` a longer row, which changes which tied key it keeps.

The documents come from the forward's state (`hook.documents`): the mask builders record the dense masks they make
from it, so an indexer handed one of them needs no host copy. A mask they did not make on this thread (the recompute
of a checkpointed layer, which autograd may run on another thread; a prepared mask passed in while evaluating) is read
itself, once per mask and thread: a document starts at every token that cannot see the token before it. A mask in
which some token cannot see itself is transformers' padded mask (it hides padding from itself, where the hook's make
each padding token a one-token document), one document a row: with padding, each row's document is ranked alone too
(`topk` over the padded row kept other tied keys: glm_moe_dsa off by 0.2, issue 35), and the padding tokens keep what
the indexer picks for them over the whole batch.

`INDEXERS` is the one table of indexer classes the hook wraps.
"""

import functools
import importlib
import inspect
import threading
import weakref

import numpy as np
import torch

from ... import _compat
from ...errors import IncompatibleTransformersError, UnsupportedSetupError
from .. import documents as forward_documents, registry
from ..documents import ForwardDocuments


# model_type -> (modeling module, indexer class). Each `forward(hidden_states, q_resid, position_embeddings,
# attention_mask, position_ids, cache)` returns the int32 indices of the keys it keeps, shaped
# `(batch_size, length, min(index_topk, length))`.
INDEXERS: dict[str, tuple[str, str]] = {
    "deepseek_v32": ("deepseek_v32", "DeepseekV32Indexer"),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaIndexer"),
    "hy_v4": ("hy_v4", "HYV4Indexer"),
    "axk2": ("axk2", "AXK2Indexer"),
    **dict.fromkeys(("dots3_note", "dots3_note_text"), ("dots3_note", "Dots3NoteTextIndexer")),
}
_PER_TOKEN_ARGUMENTS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")


def indexer_class(model_type: str) -> type | None:
    """The indexer class of `model_type` that the hook wraps (imports the modeling module), or None if it has none."""
    if model_type not in INDEXERS:
        return None
    module_name, class_name = INDEXERS[model_type]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    if not hasattr(module, class_name):
        raise _incompatible(f"`{module.__name__}` has no `{class_name}`")
    return getattr(module, class_name)


def patch_indexers(model_type: str) -> None:
    """Wrap the `forward` of `model_type`'s indexer class (idempotent; `unconfigure_packing` restores it)."""
    cls = indexer_class(model_type)
    if cls is not None and not registry.is_ours(cls.forward):
        registry.replace_attribute(cls, "forward", registry.ours(_select_per_document(cls.forward)))


def check_indexers_covered(model: torch.nn.Module) -> None:
    """Refuse a model holding a sparse key indexer (a module with `index_topk`) that the table does not wrap for its
    type (a new indexer class in a newer transformers, a custom model): it would rank keys across the packed row."""
    model_type = model.config.model_type
    wrapped = indexer_class(model_type)
    for name, module in model.named_modules():
        if hasattr(module, "index_topk") and type(module) is not wrapped:
            raise UnsupportedSetupError(
                f"Module {name!r} of model_type {model_type!r} is a {type(module).__name__}, a sparse key indexer "
                f"that llm_packing does not run per document (wrapped for this type: "
                f"{wrapped.__name__ if wrapped else 'none'}). Train this model without packing, or add the class to "
                "`llm_packing.hook.attention.indexers.INDEXERS` with a parity test."
            )


def _incompatible(what: str) -> IncompatibleTransformersError:
    return IncompatibleTransformersError(
        f"Cannot isolate the documents in a sparse key indexer: {what} (installed transformers "
        f"{_compat.TRANSFORMERS_VERSION}; llm_packing is tested with {_compat.MIN_TRANSFORMERS_VERSION} to "
        f"{_compat.MAX_TESTED_TRANSFORMERS_VERSION}). Install a tested version, e.g. "
        f"`pip install transformers=={_compat.MAX_TESTED_TRANSFORMERS_VERSION}`."
    )


def _select_per_document(forward):
    signature = inspect.signature(forward)
    cache_name = _compat.cache_parameter(forward)
    missing = [name for name in _PER_TOKEN_ARGUMENTS if name not in signature.parameters]
    if missing or cache_name is None:
        raise _incompatible(f"`{forward.__qualname__}` takes no {missing or 'cache'} argument(s)")

    @functools.wraps(forward)
    def select_per_document(*args, **kwargs):
        kwargs = _compat.rename_legacy_cache_argument(kwargs, signature)
        arguments = signature.bind(*args, **kwargs).arguments
        batch_size, length = arguments["hidden_states"].shape[:2]
        mask = arguments["attention_mask"]
        documents = None
        if arguments.get(cache_name) is None and isinstance(mask, torch.Tensor):
            if tuple(mask.shape) == (batch_size, length, length):
                documents = documents_of_prepared_mask(mask)
        if documents is None or not (documents.is_packed or _one_padded_document_per_row(documents.ids)):
            return forward(*args, **kwargs)
        groups = documents.derived("indexer groups", lambda: SameLengthGroups(documents, mask.device))
        with torch.no_grad():
            # transformers' padded mask hides each padding token from itself: those tokens keep what the indexer
            # picks for them in the whole batch (a token of the hook's masks sees itself, and picks itself).
            padding = None if documents.is_packed else forward(*args, **kwargs)
            return groups.select(forward, arguments, cache_name, padding)

    return select_per_document


class SameLengthGroups:
    """
    The documents of a packed batch longer than one token, grouped by exact length: per group, the batch row of each
    document and the columns of its tokens.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.documents import documents_of
    >>> from llm_packing.hook.attention.indexers import SameLengthGroups
    >>> groups = SameLengthGroups(documents_of(torch.tensor([[1, 1, 2, 3, 3, 0], [1, 1, 1, 2, 2, 0]])), "cpu")
    >>> [(rows.tolist(), columns.tolist()) for rows, columns in groups.groups]
    [([0, 0, 1], [[0, 1], [3, 4], [3, 4]]), ([1], [[0, 1, 2]])]

    ```
    """

    def __init__(self, documents: ForwardDocuments, device):
        self.shape = documents.ids.shape
        length = self.shape[1]
        starts, lengths = documents.starts, documents.lengths
        self.groups = []  # (rows `(documents,)`, columns `(documents, length)`)
        for group_length in np.unique(lengths[lengths > 1]):
            chosen = starts[lengths == group_length]
            columns = (chosen % length)[:, None] + np.arange(group_length)
            self.groups.append((torch.from_numpy(chosen // length).to(device), torch.from_numpy(columns).to(device)))

    def select(self, forward, arguments: dict, cache_name: str, padding: torch.Tensor | None = None) -> torch.Tensor:
        """The indices `forward` (the original indexer) keeps for every document alone, in the packed layout; tokens
        of no document keep their own position, or their indices in `padding` where given."""
        module, mask = arguments["self"], arguments["attention_mask"]
        batch_size, length = self.shape
        width = min(module.index_topk, length)
        if padding is None:
            own_position = torch.arange(length, device=mask.device, dtype=torch.int32)
            selected = own_position.view(1, length, 1).expand(batch_size, length, width).contiguous()
        else:
            selected = padding.to(torch.int32).clone()
        cos, sin = arguments["position_embeddings"]
        position_ids = arguments["position_ids"]
        for rows, columns in self.groups:
            take = functools.partial(_take, rows=rows, columns=columns, batch_size=batch_size)
            kept = forward(
                module,
                hidden_states=take(arguments["hidden_states"]),
                q_resid=take(arguments["q_resid"]),
                position_embeddings=(take(cos), take(sin)),
                attention_mask=mask[rows[:, None, None], columns[:, :, None], columns[:, None, :]],
                position_ids=take(position_ids) if _is_per_token(position_ids, length) else position_ids,
                **{cache_name: None},
            )
            selected[rows[:, None], columns, : kept.shape[-1]] = (kept + columns[:, :1, None]).to(selected.dtype)
        return selected


def _take(tensor: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The `(documents, length, ...)` tokens of a group from a `(batch_size or 1, length, ...)` tensor."""
    return tensor[rows[:, None], columns] if tensor.shape[0] == batch_size else tensor[0, columns]


def _one_padded_document_per_row(ids: np.ndarray) -> bool:
    """Whether document ids read from an unpacked mask (`[[1, 1, 1, 0], [0, 1, 1, 1]]`: one document a row) have
    padding, each row's tokens in one run: the indexer must then rank each row's document alone, not its padded row,
    whose length changes which of several tied keys `topk` keeps."""
    real = ids > 0
    runs = real[:, :1].sum(axis=1) + (real[:, 1:] & ~real[:, :-1]).sum(axis=1)
    return not real.all() and bool((runs <= 1).all())


def _is_per_token(tensor, length: int) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[-1] == length


class _MaskRead(threading.local):
    held = None  # (weak reference to the tensor the mask views, the mask's geometry and version, its documents)


_mask_read = _MaskRead()


def documents_of_prepared_mask(mask: torch.Tensor) -> ForwardDocuments | None:
    """The documents that a prepared `(batch_size, length, length)` mask (bool, or additive float) isolates: the
    forward's state if a builder of this thread made the mask from it, else [`read_documents`] of the mask, once per
    mask and thread."""
    documents = forward_documents.documents_that_prepared(mask)
    if documents is not None:
        return documents
    root = mask if mask._base is None else mask._base
    geometry = (tuple(mask.shape), mask.stride(), mask.storage_offset(), forward_documents.version_of(mask))
    held = _mask_read.held
    if held is None or held[0]() is not root or held[1] != geometry:
        held = _mask_read.held = (weakref.ref(root), geometry, read_documents(mask))
    return held[2]


def read_documents(mask: torch.Tensor) -> ForwardDocuments | None:
    """
    The documents that a prepared mask isolates, read from it (one host copy): a document starts at every token that
    cannot see the token before it, so each padding token of a packed mask is a document of its own. A mask in which
    some token cannot see itself is transformers' padded mask, not packed: those tokens are padding (id 0) and the
    others one document per row. A mask of a dtype other than bool or float gives None.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.attention.indexers import read_documents
    >>> packed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    >>> read_documents(packed[None]).ids  # documents of 2 and 1 tokens, one padding token
    array([[1, 1, 2, 3]])
    >>> padded = torch.ones(4, 4, dtype=torch.bool).tril() & torch.tensor([True, True, True, False])
    >>> read_documents(padded[None]).ids  # transformers' mask of 3 tokens and one padding token
    array([[1, 1, 1, 0]])

    ```
    """
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return None
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    length = mask.shape[-1]
    diagonals = torch.cat([visible.diagonal(dim1=-2, dim2=-1), visible.diagonal(-1, dim1=-2, dim2=-1)], dim=-1)
    host = forward_documents._to_host(diagonals)
    sees_itself, sees_previous = host[:, :length], host[:, length:]
    if not sees_itself.all():
        ids = sees_itself.astype(np.int64)
        return ForwardDocuments(torch.from_numpy(ids), ids)
    ids = np.ones(mask.shape[:2], dtype=np.int64)
    ids[:, 1:] += np.cumsum(~sees_previous, axis=1)
    return ForwardDocuments(torch.from_numpy(ids), ids)
