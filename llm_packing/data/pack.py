"""`pack_dataset`: tokenized `datasets` in, packed rows out, with one global `pack_sequences` call per split.

Lengths come from the Arrow list offsets; tokens are read where they lie (a memory-mapped dataset is never copied
whole, see `token_columns.py`) and gathered with numpy, a bounded chunk of packed rows at a time under a progress
bar, each chunk written to the `datasets` cache as it is done (see `packed_cache.py`). No Python loop over rows or
documents, and no Python list of tokens. Over-long and empty sequences follow `overflow` (see `overflow.py`) and what
was cut is counted in the stats.
"""

import logging
import os

import datasets

from ..core.binpack import check_options, seed_from_components
from ..core.checks import check_bool, check_integer
from ..core.overflow import OverflowPolicy, check_max_length, check_overflow_policy, no_rows_message
from ..core.rows import already_packed_error
from ..errors import PackingError, PackingTypeError, PackingValueError
from ._io.packed_cache import destination, load_cached
from ._io.split_documents import SplitDocuments
from .metadata import record_packing
from .pack_image_text import is_image_text, pack_image_text_split


__all__ = ["PackedDatasetEpochs", "pack_dataset"]

logger = logging.getLogger(__name__)



def pack_dataset(
    dataset,
    max_length: int,
    *,
    strategy: str = "bfd",
    seed: int | None = None,
    overflow: OverflowPolicy = "error",
    max_docs_per_bin: int | None = None,
    return_position_ids: bool = False,
    keep_in_memory: bool = False,
    cache_file_name: str | None = None,
    load_from_cache_file: bool | None = None,
    buffer_size: int = 10_000,
    num_proc: int | None = None,
    return_stats: bool = False,
    processor=None,
    chat_template: str | None = None,
):
    """
    Pack a tokenized dataset into rows of at most `max_length` tokens, each document kept whole and separate.

    Every split is packed at once (one `pack_sequences` call over all its documents, not per `map` batch). Columns
    other than `input_ids`, `labels`, `completion_mask` and `assistant_masks` are dropped: a packed row has no single
    value for a per-example column. Rows come out roughly in input order (see `locality.py`; with a `seed`, in a
    random order); the Trainer's sampler shuffles them.
    Like `Dataset.map`, the rows are written to an Arrow file beside the input's cache files and memory-mapped, and
    a second call with the same input and options loads that file instead of packing again; an in-memory input keeps
    its packed rows in memory.
    Collate them with [`~llm_packing.batches.collator.DataCollatorWithPacking`] (after `configure_packing(model)`) or
    TRL's `padding_free=True` collator; TRL's default padding collator ignores `seq_lengths` and lets documents attend
    to
    each other.

    Args:
        dataset ([`~datasets.Dataset`], [`~datasets.DatasetDict`], [`~datasets.IterableDataset`] or
        [`~datasets.IterableDatasetDict`]):
            Tokenized examples with an `input_ids` column (lists of non-negative integers) and optionally `labels`
            (same lengths; -100 = not trained on) and TRL's `completion_mask` / `assistant_masks` (same lengths; the
            labels of tokens where they are 0 become -100). Without `labels`, the labels are the `input_ids`.
            Refused: an `attention_mask` holding a 0 (tokenized with padding, whose pad tokens packing would keep)
            and rows packed already (a `seq_lengths` column).
        max_length (`int`):
            Tokens per packed row.
        strategy (`str`, *optional*, defaults to `"bfd"`):
            Packing strategy of [`~llm_packing.core.binpack.pack_sequences`].
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
        return_position_ids (`bool`, *optional*, defaults to `False`):
            Also store `position_ids` (restarting at 0 per document), for a collator that does not derive them from
            `seq_lengths` as ours and TRL's `padding_free=True` one do.
        keep_in_memory (`bool`, *optional*, defaults to `False`):
            Keep the packed rows in memory instead of writing them to a cache file.
        cache_file_name (`str` or `os.PathLike`, *optional*):
            The cache file to write (and to load if it exists), as in `Dataset.map`; a `Dataset` only, and not with
            `keep_in_memory=True`.
        load_from_cache_file (`bool`, *optional*):
            Load an existing cache file instead of packing again; defaults to `datasets.is_caching_enabled()`.
        buffer_size (`int`, *optional*, defaults to `10000`):
            Streaming only: sequences packed together; see [`~llm_packing.data.streaming.pack_iterable_dataset`]
            (and [`~llm_packing.data.streaming_image_text.pack_image_text_stream`] for image-text conversations).
        num_proc (`int`, *optional*):
            Processes that gather and write the packed rows of a split written to a cache file, each a contiguous
            share of the rows into a shard file named as `Dataset.map(num_proc=...)` names them; the plan is made
            once, and the shards hold the same rows as one process would write (a later call loads them whatever
            its `num_proc`). Rows kept in memory are gathered in this process. Needs the `fork` start method.
        return_stats (`bool`, *optional*, defaults to `False`):
            Also return the [`~llm_packing.core.stats.PackingStats`] (a `dict` of them, by split, for a `DatasetDict`).
            The stats are logged on the `llm_packing` logger either way.
        processor (`ProcessorMixin`, *optional*):
            Required for image-text conversations (TRL's vision format: `messages` with `images` or `image`): the
            processor training will use. Each conversation is packed by its true token count, its image placeholders
            expanded as this processor expands them, planned from the text and each image's file header without
            decoding pixels; tokenizing and pixel processing happen in the collator (see `pack_image_text.py`).
        chat_template (`str`, *optional*):
            Image-text only: a chat template other than the processor's.

    Image-text conversations come out as rows of `messages` (the row's conversations), `images` (each one's images,
    as the dataset holds them: never decoded here), `seq_lengths`, `seq_starts` (where each document starts in its
    conversation: 0 unless `overflow` cut it) and `conversation_lengths` (the planned tokens of each whole
    conversation). `overflow` never cuts inside an image's tokens: see `pack_image_text.py`. A streamed one is
    planned as it is read and packed a buffer at a time, into the same columns (see `streaming_image_text.py`).

    Returns:
        The packed dataset (same container type), or `(packed, stats)` with `return_stats=True`. Columns, all
        `int32` lists: `input_ids`, `labels` only where they say more than the collator derives (a `labels` or mask
        column that leaves out some token other than a document's first), `position_ids` only when asked, and
        `seq_lengths`. Without `labels`, a collator takes the `input_ids` with -100 on each document's first token
        (so that no document is trained to predict the next one's start); streamed rows always carry `labels`.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from llm_packing.data.pack import pack_dataset
    >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]]})
    >>> pack_dataset(ds, 4)[:]
    {'input_ids': [[1, 2, 3, 6], [4, 5]], 'seq_lengths': [[3, 1], [2]]}
    >>> pack_dataset(ds, 4, return_position_ids=True)[:]["position_ids"]
    [[0, 1, 2, 0], [0, 1]]

    ```
    """
    check_max_length(max_length)
    check_overflow_policy(overflow)
    for name, value in (("return_position_ids", return_position_ids), ("keep_in_memory", keep_in_memory),
                        ("return_stats", return_stats)):
        check_bool(name, value)
    check_bool("load_from_cache_file", load_from_cache_file, optional=True)
    check_integer("num_proc", num_proc, optional=True, meaning="processes that write the packed rows")
    check_options(max_length, strategy, seed, max_docs_per_bin)
    _check_cache_file_name(cache_file_name, keep_in_memory)
    options = {"strategy": strategy, "seed": seed, "max_docs_per_bin": max_docs_per_bin}
    if isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        if return_stats:
            raise PackingValueError(
                "`return_stats=True` needs a map-style dataset, got a streaming one: its stats are only known once it "
                "has been iterated, and are logged on the `llm_packing` logger then. Drop `return_stats`."
            )
        options.update(overflow=overflow, buffer_size=buffer_size)
        return _pack_streams(dataset, max_length, options, return_position_ids, processor, chat_template)
    # Unused without a stream, but checked alike: a bad value would fail once the same call is given a stream.
    check_integer("buffer_size", buffer_size, minimum=2, meaning="sequences per buffer, for streams",
                  fix="Leave it out for a map-style dataset (the default is 10_000).")
    options["return_position_ids"] = return_position_ids
    image_text = {"processor": processor, "chat_template": chat_template}
    storage = {"keep_in_memory": keep_in_memory,
               "cache_file_name": None if cache_file_name is None else os.fspath(cache_file_name),
               "load_from_cache_file": load_from_cache_file}
    if isinstance(dataset, datasets.DatasetDict):
        if cache_file_name is not None:
            raise PackingValueError(
                f"`cache_file_name`={cache_file_name!r} names one file, but a DatasetDict has a packed dataset per "
                "split. Pack each split on its own (`pack_dataset(splits['train'], ..., cache_file_name=...)`), or "
                "leave the names to the datasets cache."
            )
        packed = {}
        for split, ds in dataset.items():
            try:
                packed[split] = _pack_split(ds, max_length, overflow, options, storage, num_proc=num_proc,
                                            image_text=image_text)
            except PackingError as error:  # same type, so `except SequenceTooLongError` still works
                raise type(error)(f"Split {split!r}: {error}") from error
        result = datasets.DatasetDict({split: ds for split, (ds, _) in packed.items()})
        stats = {split: split_stats for split, (_, split_stats) in packed.items()}
    elif isinstance(dataset, datasets.Dataset):
        result, stats = _pack_split(dataset, max_length, overflow, options, storage, num_proc=num_proc,
                                    image_text=image_text)
    else:
        raise PackingTypeError(
            f"`dataset` must be a datasets Dataset, DatasetDict, IterableDataset or IterableDatasetDict, got "
            f"{type(dataset).__name__}. Wrap your examples with `datasets.Dataset.from_dict` or `from_list`."
        )
    return (result, stats) if return_stats else result


def _check_cache_file_name(cache_file_name, keep_in_memory: bool) -> None:
    if cache_file_name is not None and not isinstance(cache_file_name, (str, os.PathLike)):
        raise PackingTypeError(
            f"`cache_file_name` must be a path (str or os.PathLike) or None, got {cache_file_name!r} of type "
            f"{type(cache_file_name).__name__}. Name the Arrow file to write, e.g. `cache_file_name='packed.arrow'`, "
            "or leave it out for the datasets cache to name it."
        )
    if cache_file_name is not None and keep_in_memory:
        raise PackingValueError(
            f"`cache_file_name`={cache_file_name!r} with `keep_in_memory=True`: rows kept in memory are never written "
            "to that file. Leave out `keep_in_memory` to write the rows there, or `cache_file_name` to keep them in "
            "memory (`Dataset.map` refuses the pair too)."
        )


def _pack_streams(dataset, max_length, options, return_position_ids, processor, chat_template):
    """A stream (or each split of a stream dict) packed lazily: image-text conversations or tokenized text."""
    from .streaming import pack_iterable_dataset
    from .streaming_image_text import is_image_text_stream, pack_image_text_stream

    def pack_stream(stream):
        if stream.features is not None and "seq_lengths" in stream.features:
            raise already_packed_error("`dataset`")
        if is_image_text_stream(stream, processor):
            return pack_image_text_stream(stream, max_length, processor=processor, chat_template=chat_template,
                                          **options)
        return pack_iterable_dataset(stream, max_length, return_position_ids=return_position_ids, **options)

    if isinstance(dataset, datasets.IterableDatasetDict):
        return record_packing(datasets.IterableDatasetDict(
            {split: pack_stream(stream) for split, stream in dataset.items()}), max_length)
    return record_packing(pack_stream(dataset), max_length)


def _pack_split(dataset, max_length, overflow, options, storage, documents=None, num_proc=None, image_text=None):
    """One split packed (or loaded from the cache), formatted like its input; `documents` if already read."""
    if "seq_lengths" in dataset.column_names:
        raise already_packed_error("`dataset`")
    if is_image_text(dataset):
        packed, stats = pack_image_text_split(dataset, max_length, overflow, options, storage, num_proc=num_proc,
                                              **(image_text or {}))
    else:
        if (image_text or {}).get("processor") is not None and "input_ids" not in dataset.column_names:
            raise PackingValueError(
                f"`processor` was given, but `dataset` has no image or video column (columns: {dataset.column_names})"
                ": image-text packing takes TRL's vision format, conversations in `messages` with their `images` (or "
                "`image`, `videos`). Add an `images` column (an empty list for a conversation without one), or "
                "tokenize text-only data (`input_ids`) and leave `processor` out."
            )
        target = destination(dataset, dict(max_length=max_length, overflow=overflow, **options), **storage)
        cached = load_cached(target, dataset.split)
        if cached is None:
            documents = documents or SplitDocuments(dataset, max_length, overflow)
            packed, stats = documents.pack(target, dataset.split, num_proc=num_proc, **options)
        else:
            packed, stats = cached
    split = dataset.split
    logger.info("pack_dataset%s:\n%s", f" ({split})" if split else "", stats)
    if len(dataset) and not len(packed):
        where = f" ({split})" if split else ""
        logger.warning(no_rows_message(f"pack_dataset{where} made no rows from {len(dataset)} examples",
                                       stats.empty_sequences, stats.dropped_sequences, overflow))
    return record_packing(packed.with_format(dataset.format["type"]), max_length), stats


class PackedDatasetEpochs:
    """
    One packing per epoch of the same documents: lengths and token buffers are read once, `repack(epoch)` pairs the
    documents anew (seed derived from `seed` and `epoch`).

    The bins' shapes (the multiset of `seq_lengths` per row) depend on the lengths only, so every epoch has the same
    rows up to which documents of equal length fill them.

    With a `Trainer`, train one epoch over [`concatenated`] epochs: `train_dataset=epochs.concatenated(3)` with
    `num_train_epochs=1` is one learning-rate schedule over the three packings, one series of checkpoints, and
    `resume_from_checkpoint` resumes inside it (the Trainer shuffles the rows of all three together). Calling
    `trainer.train()` once per `repack(epoch)` instead restarts the schedule each time, overwrites the earlier
    epochs' checkpoints, and a resumed run loads the last epoch's final checkpoint and trains none of the next.

    Args:
        dataset ([`~datasets.Dataset`]):
            As for [`pack_dataset`].
        max_length (`int`):
            Tokens per packed row.
        seed (`int`, *optional*, defaults to `0`):
            Base seed; epoch `e` packs with `seed_from_components(seed, e)`.
        strategy, overflow, max_docs_per_bin, return_position_ids, keep_in_memory, load_from_cache_file:
            As for [`pack_dataset`]; each epoch has its own cache file.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> from llm_packing.data.pack import PackedDatasetEpochs
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
        return_position_ids: bool = False,
        keep_in_memory: bool = False,
        load_from_cache_file: bool | None = None,
    ):
        check_max_length(max_length)
        check_overflow_policy(overflow)
        check_bool("return_position_ids", return_position_ids)
        check_bool("keep_in_memory", keep_in_memory)
        check_bool("load_from_cache_file", load_from_cache_file, optional=True)
        check_integer("seed", seed, minimum=0, meaning="epoch `e` packs with `seed_from_components(seed, e)`",
                      fix="Pass e.g. `seed=0`.")
        check_options(max_length, strategy, seed, max_docs_per_bin)
        if not isinstance(dataset, datasets.Dataset):
            raise _not_a_dataset_to_repack(dataset)
        if "seq_lengths" in dataset.column_names:
            raise already_packed_error("`dataset`")
        if is_image_text(dataset):
            raise PackingValueError(
                "PackedDatasetEpochs packs tokenized text; image-text conversations are not repacked per epoch yet. "
                "Call `pack_dataset(dataset, max_length, processor=processor, seed=epoch)` for each epoch instead."
            )
        self._dataset, self._max_length, self._overflow = dataset, max_length, overflow
        self._documents = SplitDocuments(dataset, max_length, overflow)
        self._options = {"strategy": strategy, "max_docs_per_bin": max_docs_per_bin,
                             "return_position_ids": return_position_ids}
        self._storage = {"keep_in_memory": keep_in_memory, "cache_file_name": None,
                             "load_from_cache_file": load_from_cache_file}
        self._seed = seed
        self.stats = None  # PackingStats of the last `repack`

    def repack(self, epoch: int) -> datasets.Dataset:
        """The packed dataset for `epoch`; its stats are in `self.stats` afterwards."""
        options = dict(seed=seed_from_components(self._seed, epoch), **self._options)
        packed, self.stats = _pack_split(self._dataset, self._max_length, self._overflow, options, self._storage,
                                         documents=self._documents)
        return packed

    def concatenated(self, num_epochs: int, first_epoch: int = 0) -> datasets.Dataset:
        """
        The packings of `num_epochs` epochs from `first_epoch` on, one after the other: what one `Trainer` epoch
        trains as that many epochs. `self.stats` holds the last epoch's stats afterwards.

        Example:
        ```python
        >>> from datasets import Dataset
        >>> from llm_packing.data.pack import PackedDatasetEpochs
        >>> epochs = PackedDatasetEpochs(Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5]]}), 3)
        >>> [row["seq_lengths"] for row in epochs.concatenated(2)]
        [[2, 1], [2], [2, 1], [2]]

        ```
        """
        check_integer("num_epochs", num_epochs, minimum=1, meaning="epochs to concatenate")
        check_integer("first_epoch", first_epoch, minimum=0, meaning="the epoch of the first packing")
        return datasets.concatenate_datasets([self.repack(epoch) for epoch in range(first_epoch,
                                                                                    first_epoch + num_epochs)])


def _not_a_dataset_to_repack(dataset) -> PackingTypeError:
    if isinstance(dataset, datasets.DatasetDict):
        split = "train" if "train" in dataset else next(iter(dataset), "train")
        fix = f"Repack each split on its own, e.g. `PackedDatasetEpochs(dataset[{split!r}], max_length)`."
    elif isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        fix = ("A stream is packed as it is read, a buffer at a time: pack it once with `pack_dataset(dataset, "
               "max_length)`, whose rows follow the stream's order in each epoch (shuffle the stream with "
               "`dataset.shuffle(seed, buffer_size)` for a new order each epoch), or load it map-style "
               "(`load_dataset(..., streaming=False)`) to repack it globally per epoch.")
    else:
        fix = "Wrap your examples with `datasets.Dataset.from_dict` or `from_list`."
    return PackingTypeError(f"`dataset` must be a datasets.Dataset, got {type(dataset).__name__}. {fix}")
