"""Chunked attention per document on transformers before 5.23 (`_compat.FACTS["packed_mask_remaps_positions"]`).

The hook hands `create_chunked_causal_mask` per-document `position_ids` and no `attention_mask`, from which
transformers builds a packed mask. Since 5.23 it remaps each token to its position in its document before calling
the mask functions, so chunks start at each document's start. Before, the packed mask ANDs a same-document rule onto
chunks counted along the row: a document starting mid-chunk has its first chunk cut short, unlike the document run
alone. There the causal builder is called instead, with the chunk rule of the per-document positions ANDed in (what
5.23's remap gives). Builder calls with mask functions (images) never get here: `hook.attention.mask_functions`
refuses those on chunked builders.
"""

import inspect

from ... import _compat
from .. import registry


def per_document_builder(original):
    """The builder that makes the packed mask of `original` from per-document `position_ids`: `original` itself,
    except `create_chunked_causal_mask` on transformers < 5.23, for which [`chunked_causal_mask`]."""
    if original.__name__ == "create_chunked_causal_mask" and not _compat.packed_mask_remaps_positions():
        return chunked_causal_mask
    return original


def chunked_causal_mask(*args, **kwargs):
    """`create_chunked_causal_mask(*args, **kwargs)` for per-document `position_ids` with chunks counted from each
    document's start: `create_causal_mask` with a same-chunk `and_mask_function` over those positions."""
    from transformers import masking_utils

    causal = masking_utils.create_causal_mask
    causal = causal.__wrapped__ if registry.is_ours(causal) else causal  # transformers' own, not the hook's
    chunked_signature = inspect.signature(masking_utils.create_chunked_causal_mask)
    arguments = chunked_signature.bind(*args, **kwargs).arguments
    positions = arguments["position_ids"]
    chunk_size = arguments["config"].attention_chunk_size

    def same_document_chunk(batch_idx, head_idx, q_idx, kv_idx):
        return positions[batch_idx, q_idx] // chunk_size == positions[batch_idx, kv_idx] // chunk_size

    parameters = inspect.signature(causal).parameters
    causal_arguments = {name: value for name, value in arguments.items() if name in parameters}
    causal_arguments["and_mask_function"] = same_document_chunk
    return causal(**causal_arguments)
