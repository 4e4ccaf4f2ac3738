"""The varlen route: per-document attention on sdpa without an `L x L` mask.

On sdpa the patched mask builders hand every attention layer a [`PackedAttentionMask`] instead of transformers' dense
`(batch, 1, length, length)` packed mask. It holds the document layout of the batch, built once per forward from the
indexed mask: documents grouped into a few length buckets, with the gather indices that pull each bucket's tokens out
of the flattened batch. The sdpa attention function (replaced in `ALL_ATTENTION_FUNCTIONS` while packing is
configured) then runs, per layer:
- on CUDA in float16/bfloat16, torch's own FlashAttention 2 varlen op (`aten._flash_attention_forward`) in one call
  over the whole batch in place, its documents and padding runs as segments (no gather, no scatter), grouped-query
  heads as they are;
- otherwise one `scaled_dot_product_attention` call per bucket (`is_causal=True`, no mask for full attention), so
  attention costs the sum of each document's own `l^2` and memory stays linear in tokens.
Sliding windows are a band mask per bucket (only for buckets longer than the window); chunked attention cuts every
document into chunk-sized pieces, each attended causally. What SDPA cannot express (softcapping, attention sinks,
position biases) keeps the dense route: see `llm_packing.hook.support.architectures.sdpa_route`.
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from ...core.rows import position_ids
from ...errors import UnsupportedSetupError
from .. import registry
from ..documents import bucket_bounds, documents_of
from .flash_op import flash_varlen_attention, flash_varlen_dtype


@dataclass(frozen=True, eq=False)
class PackedAttentionMask:
    """
    Document layout of a packed batch, handed to every attention layer in place of a dense mask.

    Build it with [`PackedAttentionMask.from_indexed_mask`]. Attributes: `batch_size`, `length`, `buckets` (per
    bucket an `(n, bucket_length)` long tensor of flat token positions; positions past a document's end repeat its
    last token and are never attended, as causal attention only looks back), `source` (positions of real tokens in the
    concatenated, flattened bucket outputs), `destination` (their flat positions in the batch; `destination` lists
    each document's tokens together, in the order of `cu_seqlens`), `cu_seqlens` (int32), `max_seqlen`, `window`
    (sliding window in tokens or `None`), and `segments` / `max_segment` (int32 boundaries cutting the whole
    flattened batch, in place, into its documents and its runs of padding, and the longest: a varlen kernel given
    these needs no gather before it and no scatter after it).

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.attention.varlen import PackedAttentionMask
    >>> layout = PackedAttentionMask.from_indexed_mask(torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]))
    >>> [bucket.tolist() for bucket in layout.buckets]
    [[[2, 3, 4], [9, 10, 11], [0, 1, 1], [7, 8, 8], [6, 6, 6]]]
    >>> layout.cu_seqlens
    tensor([ 0,  3,  6,  8, 10, 11], dtype=torch.int32)
    >>> layout.segments  # in place: document, document, padding, then the second row's three documents
    tensor([ 0,  2,  5,  6,  7,  9, 12], dtype=torch.int32)

    ```
    """

    batch_size: int
    length: int
    buckets: tuple[torch.Tensor, ...]
    source: torch.Tensor
    destination: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    segments: torch.Tensor
    max_segment: int
    window: int | None = None
    __iter__ = None  # sliceable (`__getitem__`), not a sequence

    @classmethod
    def from_indexed_mask(cls, attention_mask: torch.Tensor, *, window: int | None = None, chunk: int | None = None):
        """
        The layout of an indexed mask (`[1, 1, 2, 2, 2, 0]`; validated by the caller).

        Args:
            attention_mask (`torch.Tensor`): indexed mask of shape `(batch_size, length)`.
            window (`int`, *optional*): sliding window; a token attends to the `window` latest tokens of its document,
                itself included (transformers' `sliding_window`).
            chunk (`int`, *optional*): attention chunk size; documents are cut into pieces of `chunk` tokens that
                attend only within themselves (transformers' `attention_chunk_size`).
        """
        batch_size, length = attention_mask.shape
        documents = documents_of(attention_mask)
        starts, lengths = documents.starts, documents.lengths
        if chunk is not None:
            starts, lengths = _cut_into_chunks(starts, lengths, chunk)
        segments = np.unique(np.concatenate([[0, batch_size * length], starts, starts + lengths]))
        order = np.argsort(-lengths, kind="stable")
        starts, lengths = starts[order], lengths[order]
        buckets, sources, destinations, offset = [], [], [], 0
        for first, last in bucket_bounds(lengths):
            bucket_length = int(lengths[first])
            steps = np.arange(bucket_length)
            span_lengths = lengths[first:last, None]
            buckets.append(starts[first:last, None] + np.minimum(steps, span_lengths - 1))
            real = steps < span_lengths
            sources.append(offset + np.flatnonzero(real))
            destinations.append(buckets[-1][real])
            offset += real.size
        source = np.concatenate(sources) if sources else np.zeros(0, np.int64)
        destination = np.concatenate(destinations) if destinations else np.zeros(0, np.int64)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        # One host-to-device copy for the whole layout: each copy from pageable memory waits for the device's queue.
        parts = [*buckets, source, destination, cu_seqlens, segments]
        flat = torch.from_numpy(np.concatenate([part.ravel() for part in parts]).astype(np.int64))
        flat = flat.to(attention_mask.device)
        pieces = flat.split([part.size for part in parts])
        *bucket_pieces, source, destination, cu_seqlens, segments_on_device = pieces
        return cls(
            batch_size=batch_size,
            length=length,
            buckets=tuple(piece.view(bucket.shape) for piece, bucket in zip(bucket_pieces, buckets, strict=True)),
            source=source,
            destination=destination,
            cu_seqlens=cu_seqlens.int(),
            max_seqlen=int(lengths.max(initial=0)),
            segments=segments_on_device.int(),
            max_segment=int(np.diff(segments).max(initial=0)),
            window=window,
        )

    def __getitem__(self, key):
        """The layout itself for a slice that keeps the whole `(batch, head, query, key)` mask: Gemma 4 slices each
        mask to the `logits_to_keep` last queries before its KV-shared layers, and in training (`logits_to_keep=0`)
        that slice is every query. A part of the queries has no packed layout: refused.

        Example:
        ```python
        >>> import torch
        >>> from llm_packing.hook.attention.varlen import PackedAttentionMask
        >>> layout = PackedAttentionMask.from_indexed_mask(torch.tensor([[1, 1, 2, 2, 2, 0]]))
        >>> layout[:, :, slice(0, None), :] is layout
        True

        ```
        """
        sizes = (self.batch_size, 1, self.length, self.length)
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) <= len(sizes) and all(
            isinstance(part, slice) and range(*part.indices(size)) == range(size)
            for part, size in zip(keys, sizes, strict=False)
        ):
            return self
        raise UnsupportedSetupError(
            f"The packed varlen layout was sliced with {key!r}, keeping part of its rows' queries (Gemma 4's "
            "KV-shared layers do this for an integer `logits_to_keep` above 0): the layout covers whole rows only. "
            "Pass `logits_to_keep=0` to packed forwards, or configure with `attention_route='dense'`."
        )


def _cut_into_chunks(starts: np.ndarray, lengths: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    pieces = -(-lengths // chunk)
    document = np.repeat(np.arange(len(lengths)), pieces)
    index = position_ids(pieces)  # which piece of its document
    return starts[document] + index * chunk, np.minimum(lengths[document] - index * chunk, chunk)


@registry.outside_graphs
def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: PackedAttentionMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """
    Per-document causal attention of `query` `(batch, heads, length, dim)` against `key`/`value`
    `(batch, kv_heads, length, dim)`; returns `(batch, length, heads, value_dim)`, zeros on padding.
    """
    _refuse_inexpressible(module, kwargs)
    batch_size, heads, length, _ = query.shape
    if key.shape[2] != length:
        raise UnsupportedSetupError(
            f"The varlen route needs keys for exactly the packed tokens, got {key.shape[2]} keys for {length} queries "
            "(a KV cache?). Train packed batches with `use_cache=False`, or `configure_packing(model, "
            "attention_route='dense')`."
        )
    flat = [tensor.transpose(1, 2).reshape(batch_size * length, tensor.shape[1], tensor.shape[3])
            for tensor in (query, key, value)]
    flash_dtype = flash_varlen_dtype(query, key, value, dropout)
    if flash_dtype is not None:
        # The whole batch in place, padding runs as segments of their own: no gather, no scatter. Padding outputs
        # are then attention within the padding run, not zeros; nothing real attends to them.
        output = flash_varlen_attention([tensor.to(flash_dtype) for tensor in flat], mask.segments,
                                        mask.max_segment, mask.window, scaling)
        return output.view(batch_size, length, heads, value.shape[3])
    output = torch.cat([
        _bucket_attention(flat, bucket, mask.window, dropout, scaling).flatten(0, 1) for bucket in mask.buckets
    ]).index_select(0, mask.source)
    result = flat[2].new_zeros(batch_size * length, heads, value.shape[3]).index_copy(0, mask.destination, output)
    return result.view(batch_size, length, heads, value.shape[3])


def _bucket_attention(flat, bucket: torch.Tensor, window: int | None, dropout: float, scaling: float | None):
    """SDPA over one bucket's documents side by side: `(n, bucket_length, heads, value_dim)`."""
    documents, bucket_length = bucket.shape
    # index_select, not `tensor[bucket]`: its backward is a dense index_add instead of an accumulating index_put
    # (1-3% of the attention call on CPU).
    query, key, value = (
        tensor.index_select(0, bucket.flatten()).view(documents, bucket_length, *tensor.shape[1:]).transpose(1, 2)
        for tensor in flat
    )
    mask = None
    if window is not None and bucket_length > window:
        steps = torch.arange(bucket_length, device=bucket.device)
        distance = steps[:, None] - steps[None, :]
        mask = (distance >= 0) & (distance < window)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.transpose(1, 2)


def _refuse_inexpressible(module, kwargs) -> None:
    """Per-layer features SDPA cannot add to a per-document call: fail closed instead of dropping them."""
    present = [name for name in ("softcap", "s_aux", "sinks", "position_bias") if kwargs.get(name) is not None]
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        present.append("is_causal=False")
    if present:
        raise UnsupportedSetupError(
            f"{type(module).__name__} passes {', '.join(present)} to sdpa, which the varlen route cannot express. "
            "Use `configure_packing(model, attention_route='dense')` (or `attention_route: dense` in the recipe)."
        )


def packed_attention_mask(attention_mask: torch.Tensor, *, window=None, chunk=None) -> PackedAttentionMask:
    """The [`PackedAttentionMask`] of a validated indexed mask for one mask type (full, sliding `window`, `chunk`)."""
    layout = documents_of(attention_mask).derived(
        ("varlen", chunk), lambda: PackedAttentionMask.from_indexed_mask(attention_mask, chunk=chunk)
    )
    return layout if window is None else replace(layout, window=window)


# Sequence parallelism (`llm_packing.parallel`) sets this, through the registry, to the attention of a layer holding a
# piece of each row's queries and the layout of the whole row; None while it is not configured.
sharded_attention = None


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' `sdpa_attention_forward`, except that a [`PackedAttentionMask`] takes the varlen route (and a
    layout longer than the queries, a sequence-parallel shard's, takes [`sharded_attention`])."""
    if isinstance(attention_mask, PackedAttentionMask):
        attend = packed_sdpa_attention
        if attention_mask.length != query.shape[2]:
            attend = _sharded_attention(attention_mask, query)
        return attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs), None
    from transformers.integrations import sdpa_attention

    return sdpa_attention.sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _sharded_attention(mask: PackedAttentionMask, query: torch.Tensor):
    if sharded_attention is None:
        raise UnsupportedSetupError(
            f"A packed row of {mask.length} tokens reached attention with {query.shape[2]} queries a row: a piece of "
            "each row, without sequence parallelism configured. Call "
            "`llm_packing.parallel.configure_sequence_parallel(model, sequence_parallel_size)` on every rank, or pass "
            "the whole row's `input_ids`."
        )
    return sharded_attention


def install() -> None:
    """Route sdpa attention through [`sdpa_attention_forward`] (`ALL_ATTENTION_FUNCTIONS`, where every model looks
    its backend up at each forward), unless a kernel of someone else's is registered there."""
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    if mapping.get("sdpa") is sdpa_attention.sdpa_attention_forward:
        registry.replace_item(mapping, "sdpa", sdpa_attention_forward)
