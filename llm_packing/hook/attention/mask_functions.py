"""Mask builder calls that carry mask functions: image tokens attending both ways within their image, bounded by the
document.

Gemma 3/4 and PaliGemma build their text masks with an `or_mask_function` (a bidirectional overlay over image
tokens), an `and_mask_function` (sliding windows) or `block_sequence_ids` (tokens of one block attend both ways).
Those functions index row-level tensors (`block_sequence_ids[batch_idx, q_idx]`). The hook's usual packed route gives
the builder per-document `position_ids`, from which transformers remaps every mask function to *document* coordinates:
a function indexing the row by that position reads the first document's tokens for every document (packed Gemma 3
with images differed from its documents run alone by 0.44, Gemma 4 by 0.87). Instead, such a call is given:
- `attention_mask=None` and `position_ids=None`, so every mask function sees row coordinates;
- the same-document rule as an extra `and_mask_function` (a query sees a key only of its own document). Causal and
  sliding-window functions depend only on `q_idx - kv_idx`, the same in row and document coordinates;
- `block_sequence_ids` unique per document. transformers ORs the block overlay in after the `and_mask_function`, and
  numbers runs of image tokens along the row: a document ending with an image and the next one starting with one
  would make one block across the boundary (32 leaked query-key pairs, 0.27 on Gemma 3), and PaliGemma's prefix is
  block 0 in every document.
The mask is dense (sdpa, eager) or a BlockMask (flex_attention); the varlen route cannot express it. Chunked attention
counts chunks from the row start in these coordinates, so a chunked builder call with mask functions is refused.
"""

import torch

from ...errors import UnsupportedSetupError


MASK_FUNCTION_ARGUMENTS = ("or_mask_function", "and_mask_function", "block_sequence_ids")


def carries_mask_functions(arguments: dict) -> bool:
    """Whether a builder call has an `or_mask_function`, `and_mask_function` or `block_sequence_ids`."""
    return any(arguments.get(name) is not None for name in MASK_FUNCTION_ARGUMENTS)


def document_block_ids(block_sequence_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """
    Image block ids made unique per document: blocks of different documents never share an id, so the bidirectional
    block overlay stays inside each document. `-1` (no block) stays `-1`.

    Example:
    ```python
    >>> import torch
    >>> document_block_ids(torch.tensor([[-1, 0, 0, 0, 0, -1]]), torch.tensor([[1, 1, 1, 2, 2, 2]]))
    tensor([[-1,  1,  1,  2,  2, -1]])

    ```
    """
    span = int(block_sequence_ids.max().clamp(min=0)) + 1
    offsets = document_ids.to(block_sequence_ids) * span
    return torch.where(block_sequence_ids >= 0, block_sequence_ids + offsets, -1)


def same_document(document_ids: torch.Tensor):
    """The mask function letting a query see only keys of its own document (padding only padding)."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return document_ids[batch_idx, q_idx] == document_ids[batch_idx, kv_idx]

    return inner_mask


def build_with_mask_functions(original, bound, attention_mask: torch.Tensor):
    """Call the mask builder `original` with its bound arguments (`bound`, an `inspect.BoundArguments` of a call
    holding mask functions and the indexed `attention_mask`, already validated) rewritten as the module docstring
    says."""
    from transformers import masking_utils

    arguments = bound.arguments
    if original.__name__ == "create_chunked_causal_mask":
        raise UnsupportedSetupError(
            "A chunked-attention mask builder received mask functions "
            f"({', '.join(name for name in MASK_FUNCTION_ARGUMENTS if arguments.get(name) is not None)}) for a "
            "packed batch: its chunks count from the document start, which these row-level functions cannot be "
            "combined with. Train this model unpacked, or without the inputs that add the mask functions (images)."
        )
    document_ids = attention_mask.to(device=arguments["inputs_embeds"].device, dtype=torch.long)
    given = arguments.get("and_mask_function")
    bounded = same_document(document_ids)
    arguments["and_mask_function"] = masking_utils.and_masks(given, bounded) if given is not None else bounded
    if arguments.get("block_sequence_ids") is not None:
        arguments["block_sequence_ids"] = document_block_ids(arguments["block_sequence_ids"], document_ids)
    arguments["attention_mask"] = None
    arguments["position_ids"] = None
    return original(*bound.args, **bound.kwargs)
