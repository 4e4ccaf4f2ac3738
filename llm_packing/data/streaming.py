"""Packing for `datasets.IterableDataset`: best-fit over a bounded buffer instead of the whole dataset.

Sequences are read `buffer_size` at a time and packed by `core/buffered.py`: full-enough bins are emitted, the
documents of emptier ones wait in the buffer for the next sequences, and only the last round emits whatever is left.
Memory is bounded by the buffer. The trade-off: a document only meets partners within its buffer, so rows are a little
less full than with the global packing of a map-style dataset (measured in tests/test_dataset.py), and the rows' order
follows the stream.
"""

import dataclasses
import logging
from collections.abc import Iterator

import datasets
import numpy as np

from ..core.binpack import pack_sequences
from ..core.buffered import buffered_bins
from ..core.checks import check_integer
from ..core.overflow import OverflowPolicy, check_max_length, check_overflow_policy, cut_pieces, no_rows_message
from ..core.rows import (
    MASK_COLUMNS,
    already_packed_error,
    check_tokens,
    flat_integers,
    ignore_document_starts,
    ignore_masked,
    length_error,
    padding_error,
    position_ids,
)
from ..core.stats import PackingStats
from ..errors import PackingValueError
from .pack_image_text import IMAGE_COLUMNS
from .stream_epochs import epoch_following_stream


logger = logging.getLogger(__name__)

_TOKENS = datasets.List(datasets.Value("int32"))


def pack_iterable_dataset(
    dataset: datasets.IterableDataset,
    max_length: int,
    *,
    buffer_size: int = 10_000,
    strategy: str = "bfd",
    seed: int | None = None,
    overflow: OverflowPolicy = "error",
    max_docs_per_bin: int | None = None,
    return_position_ids: bool = False,
) -> datasets.IterableDataset:
    """
    Pack a streamed dataset lazily: the same rows as [`~llm_packing.data.pack.pack_dataset`], produced while
    iterating, from a buffer of `buffer_size` sequences. The rows carry `labels` when the stream's features name a
    `labels` or mask column (or are unknown): whether those say more than the collator derives is only known once the
    stream has been read.

    Args:
        dataset ([`~datasets.IterableDataset`]):
            Examples with `input_ids` and optionally `labels`, `completion_mask`, `assistant_masks`.
        max_length (`int`):
            Tokens per packed row.
        buffer_size (`int`, *optional*, defaults to `10000`):
            Sequences packed together. Larger buffers pack tighter and hold more examples in memory.
        strategy, seed, overflow, max_docs_per_bin, return_position_ids:
            As for [`~llm_packing.data.pack.pack_dataset`]; `overflow="error"` raises when the stream reaches the
            first over-long sequence.

    Returns:
        [`~datasets.IterableDataset`]: packed rows; the stats are logged on the `llm_packing` logger once the stream
        has been consumed. Its `set_epoch(epoch)` (which `Trainer` calls each epoch) reaches `dataset`: a shuffled
        stream is reshuffled per epoch as it would be unpacked.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> stream = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]]}).to_iterable_dataset()
    >>> [row["seq_lengths"] for row in pack_iterable_dataset(stream, 4)]
    [[3, 1], [2]]

    ```
    """
    check_max_length(max_length)
    check_overflow_policy(overflow)
    check_integer("buffer_size", buffer_size, minimum=2, meaning="sequences per buffer")
    # Packing nothing checks `strategy` and `max_docs_per_bin` now rather than once the stream is iterated.
    pack_sequences(np.zeros(0, np.int64), max_length, strategy=strategy, seed=seed, max_docs_per_bin=max_docs_per_bin)
    options = {"max_length": max_length, "buffer_size": buffer_size, "strategy": strategy, "seed": seed,
               "overflow": overflow,
                   "max_docs_per_bin": max_docs_per_bin, "return_position_ids": return_position_ids}
    features = dataset.features
    keeps_labels = features is None or any(name in features for name in ("labels", *MASK_COLUMNS))
    options["keeps_labels"] = keeps_labels
    names = ["input_ids", *(["labels"] if keeps_labels else []), *(["position_ids"] if return_position_ids else []),
             "seq_lengths"]
    return epoch_following_stream(_packed_rows, dataset, datasets.Features(dict.fromkeys(names, _TOKENS)),
                                  options=options)


def _packed_rows(dataset, options) -> Iterator[dict[str, list[int]]]:
    max_length, buffer_size = options["max_length"], options["buffer_size"]
    counts: dict[str, int] = {}
    bin_tokens: list[int] = []
    for documents in buffered_bins(_pieces(dataset, options, counts), max_length, buffer_size=buffer_size,
                                   strategy=options["strategy"], seed=options["seed"],
                                   max_docs_per_bin=options["max_docs_per_bin"]):
        bin_tokens.append(sum(length for length, _ in documents))
        yield _row([document for _, document in documents], options)
    stats = PackingStats.from_bin_token_counts(bin_tokens, num_sequences=counts.pop("pieces", 0),
                                               capacity=max_length)
    logger.info("pack_dataset (streaming, buffer_size=%d):\n%s", buffer_size, dataclasses.replace(stats, **counts))
    if counts and not bin_tokens:
        examples = counts["empty_sequences"] + counts["dropped_sequences"]
        logger.warning(no_rows_message(f"pack_dataset (streaming) made no rows from {examples} examples",
                                       counts["empty_sequences"], counts["dropped_sequences"], options["overflow"]))


def _pieces(dataset, options, counts: dict[str, int]) -> Iterator[list[tuple[int, tuple[np.ndarray, np.ndarray]]]]:
    """Each example's pieces (cut per `overflow`) as `(length, (input_ids, labels))`, counting what was cut."""
    for row, example in enumerate(dataset):
        input_ids, labels = _document(example, row)
        pieces = cut_pieces(np.array([len(input_ids)]), options["max_length"], options["overflow"], first_row=row)
        for name, value in {**pieces.counts(), "pieces": len(pieces.length)}.items():
            counts[name] = counts.get(name, 0) + value
        yield [(int(n), (input_ids[s : s + n], labels[s : s + n]))
               for s, n in zip(pieces.start, pieces.length, strict=True)]


def _row(documents: list[tuple[np.ndarray, np.ndarray]], options: dict) -> dict[str, list[int]]:
    seq_lengths = np.array([len(ids) for ids, _ in documents], dtype=np.int32)
    # Plain lists: `from_generator` hands rows on as they are, and users expect what a map-style dataset yields.
    row = {"input_ids": np.concatenate([ids for ids, _ in documents]).tolist()}
    if options["keeps_labels"]:
        labels = np.concatenate([labels for _, labels in documents])
        row["labels"] = ignore_document_starts(labels, seq_lengths).tolist()
    if options["return_position_ids"]:
        row["position_ids"] = position_ids(seq_lengths).tolist()
    return {**row, "seq_lengths": seq_lengths.tolist()}


def _document(example: dict, row: int) -> tuple[np.ndarray, np.ndarray]:
    images = next((name for name in IMAGE_COLUMNS if name in example), None)
    if "input_ids" not in example and images is not None:
        raise PackingValueError(
            f"Example {row} of the stream holds images (key {images!r}) and no 'input_ids', so packing it needs the "
            "token count of each conversation once the processor has expanded its image placeholders, and `processor` "
            "is None. Pass the processor you train with: `pack_dataset(dataset, max_length, processor=processor)`."
        )
    if "input_ids" not in example:
        raise PackingValueError(
            f"Example {row} has no 'input_ids' (keys: {sorted(example)}). Tokenize the stream first, e.g. "
            "`dataset.map(lambda ex: tokenizer(ex['text']))`."
        )
    if "seq_lengths" in example:
        raise already_packed_error(f"Example {row} of the stream")
    for name in ("input_ids", "labels", *MASK_COLUMNS):  # as map-style packing refuses a null row
        if name in example and example[name] is None:
            raise PackingValueError(
                f"{name!r} of example {row} of the stream is null. Fill or filter that example before packing."
            )
    input_ids = _integers(example["input_ids"], "input_ids", row)
    if example.get("attention_mask") is not None and not np.all(example["attention_mask"]):
        raise padding_error(f"'attention_mask' of example {row}")
    labels = _integers(example["labels"], "labels", row, len(input_ids)) if "labels" in example else input_ids.copy()
    for name in MASK_COLUMNS:
        if name in example:
            ignore_masked(labels, _integers(example[name], name, row, len(input_ids)))
    return input_ids, labels


def _integers(values, name: str, row: int, expected_length: int | None = None) -> np.ndarray:
    where = f"{name!r} of example {row}"
    array = flat_integers(values, where, booleans=name in MASK_COLUMNS)
    if expected_length is not None and len(array) != expected_length:
        raise length_error(name, where, len(array), expected_length)
    if name not in MASK_COLUMNS:
        # The packed columns are int32, as in map-style packing: a value outside would wrap silently.
        check_tokens(array, name, where)
    return array.astype(np.int32)
