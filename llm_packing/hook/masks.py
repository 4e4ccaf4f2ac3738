"""Indexed packed attention masks: `[1, 1, 2, 2, 2, 0]` = document 1 (2 tokens), document 2 (3 tokens), one pad.

The rules of the mask, as functions of a tensor or its host copy, vectorised over rows and documents: whether a mask
is indexed, the positions restarting per document, each document's run of tokens, and the check that documents are
numbered 1, 2, 3, ... in order. What one forward derives from its mask, once, is `llm_packing.hook.documents`.
"""

import numpy as np
import torch

from ..errors import PackingValueError


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
    if not is_integer_mask(attention_mask) or attention_mask.numel() == 0:
        return False
    return bool(attention_mask.max() > 1)


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


def document_lengths_per_token(position_ids: torch.Tensor) -> torch.Tensor:
    """
    For each token, the length of its document as rotary embeddings read it, from positions that restart at 0 per
    document: the largest position of the token's run plus one. A run starts at each token at position 0 (with 3-D
    positions `(3, batch_size, length)`, at 0 in all three rows: an image's first patch at a document's start too),
    and the largest position is taken over the three rows. A padding token at position 0 is a run of its own.

    Computed on the positions' device with no host sync. Returns `(batch_size, length)`.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.masks import document_lengths_per_token
    >>> document_lengths_per_token(torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]]))
    tensor([[2, 2, 3, 3, 3, 1],
            [1, 2, 2, 3, 3, 3]])
    >>> document_lengths_per_token(torch.tensor([[[0, 1, 1, 3, 0, 1]], [[0, 1, 2, 3, 0, 1]], [[0, 1, 2, 3, 0, 1]]]))
    tensor([[4, 4, 4, 4, 2, 2]])

    ```
    """
    if position_ids.dim() == 3:
        starts, largest = (position_ids == 0).all(dim=0), position_ids.amax(dim=0)
    else:
        starts, largest = position_ids == 0, position_ids
    rows, length = largest.shape
    runs = starts.cumsum(dim=1) + torch.arange(rows, device=largest.device)[:, None] * (length + 1)
    last_positions = torch.zeros(rows * (length + 1), dtype=largest.dtype, device=largest.device)
    last_positions = last_positions.scatter_reduce(0, runs.flatten(), largest.flatten(), "amax")
    return last_positions[runs] + 1


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


def is_integer_mask(attention_mask: torch.Tensor | None) -> bool:
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.dtype != torch.bool
        and not attention_mask.dtype.is_floating_point
        and not attention_mask.dtype.is_complex
    )
