"""`pack_dataset`: tokenized `datasets` in, packed rows out, with one global `pack_sequences` call per split.

Lengths come from the Arrow list offsets and the packed columns are built with numpy gathers over the flat token
buffers, chunk by chunk under a progress bar: no Python loop over rows or documents, and no Python list of tokens.
Over-long and empty sequences follow `overflow` (see `overflow.py`) and what was cut is counted in the stats.
"""

import dataclasses
import logging

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from datasets.utils.tqdm import tqdm

from .binpack import pack_sequences, seed_from_components
from .errors import PackingError, PackingTypeError, PackingValueError
from .overflow import OverflowPolicy, check_max_length, check_overflow_policy, cut_pieces
from .packed_metadata import record_packing


logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
MASK_COLUMNS = ("completion_mask", "assistant_masks")  # TRL's: 0 marks a token that is not trained on
_TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")
_GATHER_CHUNK = 1 << 24  # tokens per gather step: bounds the temporary index arrays to ~128 MiB
_INT32_MAX = np.iinfo(np.int32).max
_MAX_LIST_OFFSET = _INT32_MAX  # past this many tokens, a column needs 64-bit (large_list) offsets


def pack_dataset(
    dataset,
    max_length: int,
    *,
    strategy: str = "bfd",
    seed: int | None = None,
    overflow: OverflowPolicy = "error",
    max_docs_per_bin: int | None = None,
    buffer_size: int = 10_000,
    return_stats: bool = False,
):
    """
    Pack a tokenized dataset into rows of at most `max_length` tokens, each document kept whole and separate.

    Every split is packed at once (one `pack_sequences` call over all its documents, not per `map` batch). Columns
    other than `input_ids`, `labels`, `completion_mask` and `assistant_masks` are dropped: a packed row has no single
    value for a per-example column. Rows come out in the engine's bin order; the Trainer's sampler shuffles them.
    Collate them with [`~llm_packing.collator.DataCollatorWithPacking`] (after `configure_packing(model)`) or TRL's
    `padding_free=True` collator; TRL's default padding collator ignores `seq_lengths` and lets documents attend to
    each other.

    Args:
        dataset ([`~datasets.Dataset`], [`~datasets.DatasetDict`], [`~datasets.IterableDataset`] or [`~datasets.IterableDatasetDict`]):
            Tokenized examples with an `input_ids` column (lists of non-negative integers) and optionally `labels`
            (same lengths; -100 = not trained on) and TRL's `completion_mask` / `assistant_masks` (same lengths; the
            labels of tokens where they are 0 become -100). Without `labels`, the labels are the `input_ids`.
        max_length (`int`):
            Tokens per packed row.
        strategy (`str`, *optional*, defaults to `"bfd"`):
            Packing strategy of [`~llm_packing.binpack.pack_sequences`].
        seed (`int`, *optional*):
            Shuffles the pairing of documents among bins of the same shape; see [`PackedDatasetEpochs`] for one
            packing per epoch.
        overflow (`str`, *optional*, defaults to `"error"`):
            Sequences longer than `max_length`: `"error"` raises [`~llm_packing.errors.SequenceTooLongError`],
            `"truncate"` keeps their first `max_length` tokens, `"split"` cuts them into `max_length` chunks packed as
            separate documents (each chunk restarts its positions), `"drop"` leaves them out. Empty sequences are
            always dropped. The counts are in the stats.
        max_docs_per_bin (`int`, *optional*):
            Cap on documents per row (e.g. to bound FlashAttention's `cu_seqlens`).
        buffer_size (`int`, *optional*, defaults to `10000`):
            Streaming only: sequences packed together; see [`~llm_packing.streaming.pack_iterable_dataset`].
        return_stats (`bool`, *optional*, defaults to `False`):
            Also return the [`~llm_packing.stats.PackingStats`] (a `dict` of them, by split, for a `DatasetDict`).
            The stats are logged on the `llm_packing` logger either way.

    Returns:
        The packed dataset (same container type), or `(packed, stats)` with `return_stats=True`. Columns, all
        `int32` lists: `input_ids`, `labels` (-100 on each document's first token, so that no document is trained to
        predict the next one's start), `position_ids` (restarting at 0 per document) and `seq_lengths`.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from llm_packing.dataset import pack_dataset
    >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]]})
    >>> pack_dataset(ds, 4)[:]
    {'input_ids': [[1, 2, 3, 6], [4, 5]], 'labels': [[-100, 2, 3, -100], [-100, 5]], 'position_ids': [[0, 1, 2, 0], [0, 1]], 'seq_lengths': [[3, 1], [2]]}

    ```
    """
    check_max_length(max_length)
    check_overflow_policy(overflow)
    options = dict(strategy=strategy, seed=seed, max_docs_per_bin=max_docs_per_bin)
    if isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        if return_stats:
            raise PackingValueError(
                "`return_stats=True` needs a map-style dataset, got a streaming one: its stats are only known once it "
                "has been iterated, and are logged on the `llm_packing` logger then. Drop `return_stats`."
            )
        from .streaming import pack_iterable_dataset

        if isinstance(dataset, datasets.IterableDatasetDict):
            return record_packing(datasets.IterableDatasetDict(
                {split: pack_iterable_dataset(ds, max_length, overflow=overflow, buffer_size=buffer_size, **options)
                 for split, ds in dataset.items()}
            ), max_length)
        return record_packing(
            pack_iterable_dataset(dataset, max_length, overflow=overflow, buffer_size=buffer_size, **options), max_length
        )
    if isinstance(dataset, datasets.DatasetDict):
        packed = {}
        for split, ds in dataset.items():
            try:
                packed[split] = _Documents(ds, max_length, overflow).pack(**options)
            except PackingError as error:  # same type, so `except SequenceTooLongError` still works
                raise type(error)(f"Split {split!r}: {error}") from error
        result = datasets.DatasetDict({split: ds for split, (ds, _) in packed.items()})
        record_packing(result, max_length)
        return (result, {split: stats for split, (_, stats) in packed.items()}) if return_stats else result
    if not isinstance(dataset, datasets.Dataset):
        raise PackingTypeError(
            f"`dataset` must be a datasets Dataset, DatasetDict, IterableDataset or IterableDatasetDict, got "
            f"{type(dataset).__name__}. Wrap your examples with `datasets.Dataset.from_dict` or `from_list`."
        )
    packed, stats = _Documents(dataset, max_length, overflow).pack(**options)
    record_packing(packed, max_length)
    return (packed, stats) if return_stats else packed


class PackedDatasetEpochs:
    """
    One packing per epoch of the same documents: lengths and token buffers are read once, `repack(epoch)` pairs the
    documents anew (seed derived from `seed` and `epoch`).

    The bins' shapes (the multiset of `seq_lengths` per row) depend on the lengths only, so every epoch has the same
    rows up to which documents of equal length fill them. Hand each epoch's dataset to its own `trainer.train()` (or
    concatenate several epochs and train one epoch over them): a Trainer builds its dataloader once per `train()`.

    Args:
        dataset ([`~datasets.Dataset`]):
            As for [`pack_dataset`].
        max_length (`int`):
            Tokens per packed row.
        seed (`int`, *optional*, defaults to `0`):
            Base seed; epoch `e` packs with `seed_from_components(seed, e)`.
        strategy, overflow, max_docs_per_bin:
            As for [`pack_dataset`].

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from llm_packing.dataset import PackedDatasetEpochs
    >>> epochs = PackedDatasetEpochs(Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5]]}), 3)
    >>> sorted(epochs.repack(0)["seq_lengths"]) == sorted(epochs.repack(1)["seq_lengths"])
    True

    ```
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        max_length: int,
        *,
        seed: int = 0,
        strategy: str = "bfd",
        overflow: OverflowPolicy = "error",
        max_docs_per_bin: int | None = None,
    ):
        check_max_length(max_length)
        check_overflow_policy(overflow)
        if not isinstance(dataset, datasets.Dataset):
            raise PackingTypeError(f"`dataset` must be a datasets.Dataset, got {type(dataset).__name__}.")
        self._documents = _Documents(dataset, max_length, overflow)
        self._options = dict(strategy=strategy, max_docs_per_bin=max_docs_per_bin)
        self._seed = seed
        self.stats = None  # PackingStats of the last `repack`

    def repack(self, epoch: int) -> datasets.Dataset:
        """The packed dataset for `epoch`; its stats are in `self.stats` afterwards."""
        packed, self.stats = self._documents.pack(seed=seed_from_components(self._seed, epoch), **self._options)
        return record_packing(packed, self._documents.max_length)


class _Documents:
    """The flat token and label buffers of one split, and the pieces of them that get packed."""

    def __init__(self, dataset: datasets.Dataset, max_length: int, overflow: OverflowPolicy):
        # With no rows, `data.table` may still hold every row behind an indices mapping (`filter`, `select([])`).
        table = dataset.with_format("arrow")[:] if len(dataset) else dataset.data.table.slice(0, 0)
        if "input_ids" not in table.column_names:
            raise PackingValueError(
                f"`dataset` has no 'input_ids' column (columns: {table.column_names}). Tokenize it first, e.g. "
                "`dataset.map(lambda ex: tokenizer(ex['text']))`."
            )
        lengths, self.input_ids = _flat_column(table, "input_ids", lengths=None)
        self.labels = _labels(table, lengths, self.input_ids)
        self.pieces = cut_pieces(lengths, max_length, overflow)
        row_start = np.cumsum(lengths) - lengths
        self.flat_start = row_start[self.pieces.source] + self.pieces.start
        self.max_length = max_length
        self.key = (max_length, overflow)
        self.format_type = dataset.format["type"]  # e.g. "torch": the packed dataset is formatted the same way
        self.source = (dataset._fingerprint, dataset.split)

    def pack(self, *, strategy, seed, max_docs_per_bin):
        result = pack_sequences(self.pieces.length, self.max_length, strategy=strategy, seed=seed,
                                max_docs_per_bin=max_docs_per_bin)
        table = self._build(result.order, result.bin_offsets)
        info = datasets.DatasetInfo(features=datasets.Features.from_arrow_schema(table.schema))
        # An explicit fingerprint: datasets would otherwise hash every packed token to make one.
        fingerprint = Hasher.hash((self.source, self.key, strategy, seed, max_docs_per_bin))
        split = self.source[1]
        packed = datasets.Dataset(datasets.table.InMemoryTable(table), info=info, split=split, fingerprint=fingerprint)
        packed = packed.with_format(self.format_type)
        stats = dataclasses.replace(result.stats, **self.pieces.counts())
        logger.info("pack_dataset%s:\n%s", f" ({split})" if split else "", stats)
        return packed, stats

    def _build(self, order: np.ndarray, bin_offsets: np.ndarray) -> pa.Table:
        lengths = self.pieces.length[order]
        sources = self.flat_start[order]
        doc_start = np.concatenate([[0], np.cumsum(lengths)])
        num_tokens = int(doc_start[-1])
        columns = {name: np.empty(num_tokens, dtype=np.int32) for name in _TOKEN_COLUMNS}
        chunks = np.searchsorted(doc_start, [*range(0, num_tokens, _GATHER_CHUNK), num_tokens])
        # One gather buffer for every chunk: fresh ~128 MiB arrays per chunk would cost as much in page faults.
        gather = np.empty(int(np.diff(doc_start[chunks]).max(initial=0)), dtype=np.int64)
        with tqdm(total=num_tokens, unit="tok", desc="Packing", disable=num_tokens < _GATHER_CHUNK) as progress:
            for first, last in zip(chunks[:-1], chunks[1:]):
                tokens = slice(doc_start[first], doc_start[last])
                size = tokens.stop - tokens.start
                segment_aranges(sources[first:last], lengths[first:last], out=gather[:size])
                # The indices are in range by construction: "clip" skips the per-index check "raise" makes (~30%).
                np.take(self.input_ids, gather[:size], out=columns["input_ids"][tokens], mode="clip")
                # Without a labels or mask column the labels are the tokens: a copy is cheaper than a second gather.
                if self.labels is None:
                    columns["labels"][tokens] = columns["input_ids"][tokens]
                else:
                    np.take(self.labels, gather[:size], out=columns["labels"][tokens], mode="clip")
                segment_aranges(np.zeros(1, np.int32), lengths[first:last], out=columns["position_ids"][tokens])
                progress.update(size)
        columns["labels"][doc_start[:-1]] = IGNORE_INDEX
        row_offsets = doc_start[bin_offsets]
        arrays = {name: _list_array(row_offsets, values) for name, values in columns.items()}
        arrays["seq_lengths"] = _list_array(bin_offsets, lengths.astype(np.int32))
        return pa.table(arrays)


def segment_aranges(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """
    `concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])` without a Python loop; `lengths` must be > 0.
    `starts` of size 1 starts every segment there. Written into `out` when given (its dtype must hold the values).

    Example:
    ```python
    >>> import numpy as np
    >>> segment_aranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    >>> segment_aranges(np.zeros(1, np.int32), np.array([2, 3])).tolist()
    [0, 1, 0, 1, 2]

    ```
    """
    steps = np.empty(int(lengths.sum()), dtype=np.int64) if out is None else out
    if len(steps) == 0:
        return steps
    steps.fill(1)
    ends = np.cumsum(lengths)[:-1]
    starts = np.broadcast_to(starts, lengths.shape)
    steps[0] = starts[0]
    steps[ends] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps, out=steps)


def _flat_column(table: pa.Table, name: str, lengths: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Row lengths and flat values of a list-of-integers column, checked against `lengths` when given."""
    column = table.column(name)
    if len(column) == 0 and pa.types.is_null(column.type):  # `Dataset.from_dict({"input_ids": []})` has no type
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    value_type = getattr(column.type, "value_type", None)
    is_mask = name in MASK_COLUMNS
    allowed = (pa.types.is_integer, pa.types.is_null, *((pa.types.is_boolean,) if is_mask else ()))  # null: all empty
    if value_type is None or not any(is_type(value_type) for is_type in allowed):
        raise PackingTypeError(
            f"Column {name!r} must hold lists of integers, got Arrow type {column.type}. Tokenize the text and cast "
            "the ids to integers first."
        )
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise PackingValueError(f"Column {name!r} is null in row {row}. Fill or filter that row before packing.")
    column_lengths = pc.list_value_length(column).to_numpy().astype(np.int64)
    if lengths is not None and not np.array_equal(column_lengths, lengths):
        row = int(np.flatnonzero(column_lengths != lengths)[0])
        raise PackingValueError(
            f"Column {name!r} has {column_lengths[row]} values in row {row}, but 'input_ids' has {lengths[row]}. "
            f"Every token needs exactly one {name!r} entry; fix that row's preprocessing."
        )
    values = pc.list_flatten(column)
    # combine_chunks copies even a single chunk: 1.6 GB more to allocate and write at 400M tokens.
    values = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
    if values.null_count:
        raise PackingValueError(
            f"Column {name!r} holds {values.null_count} null values inside its lists. Every token needs an integer."
        )
    values = values.to_numpy(zero_copy_only=False)
    if is_mask:
        return column_lengths, values
    low = 0 if name == "input_ids" else IGNORE_INDEX
    if len(values) and (values.min() < low or values.max() > _INT32_MAX):
        bad = values.min() if values.min() < low else values.max()
        raise PackingValueError(
            f"Column {name!r} must hold values in [{low}, {_INT32_MAX}], found {bad!r}. Token ids are non-negative; "
            "-100 (not trained on) belongs in 'labels' only."
        )
    if low < 0 and len(values) and values.min() < 0 and (wrong := (values < 0) & (values != IGNORE_INDEX)).any():
        first = int(np.argmax(wrong))
        row = int(np.searchsorted(np.cumsum(column_lengths), first, side="right"))
        raise invalid_label_error(f"Column {name!r} in row {row}", int(values[first]))
    return column_lengths, values.astype(np.int32, copy=False)


def _labels(table: pa.Table, lengths: np.ndarray, input_ids: np.ndarray) -> np.ndarray | None:
    """The flat labels, or `None` when they are the `input_ids` (no labels or mask column)."""
    names = [name for name in ("labels", *MASK_COLUMNS) if name in table.column_names]
    if not names:
        return None
    labels = _flat_column(table, "labels", lengths)[1].copy() if "labels" in names else input_ids.copy()
    for name in MASK_COLUMNS:
        if name in names:
            labels[_flat_column(table, name, lengths)[1] == 0] = IGNORE_INDEX
    return labels


def invalid_label_error(where: str, value: int) -> PackingValueError:
    """The error for a label that is neither a token id nor `IGNORE_INDEX`; `where` names the example."""
    return PackingValueError(
        f"{where} holds {value}: a label is a token id (>= 0) or {IGNORE_INDEX} (not trained on); the loss would "
        f"fail on anything else. Mask tokens with {IGNORE_INDEX}."
    )


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    if offsets[-1] > _MAX_LIST_OFFSET:
        return pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), pa.array(values))
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))

