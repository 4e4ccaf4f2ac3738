"""The datasets `trl.SFTTrainer` takes, turned into packed rows for
[`~llm_packing.trainers.sft.PackedSFTTrainer`].

TRL's own preparation does the formats (`SFTTrainer._prepare_dataset`: ShareGPT to ChatML, EOS, chat template, tools,
`assistant_masks` / `completion_mask` turned into `labels`), so behaviour tracks TRL's release; it runs without
`max_length`, then documents longer than `max_length` follow the `overflow` policy (see [`pack_documents`]) and the
whole split is packed at once by [`~llm_packing.data.pack.pack_dataset`].

The formats, by their columns (TRL's names):

| format            | columns                                                                           |
|-------------------|-----------------------------------------------------------------------------------|
| language modeling | `text` (or `SFTConfig.dataset_text_field`); any columns with `formatting_func`    |
| conversational    | `messages` (or ShareGPT `conversations`), optional `tools`, `chat_template_kwargs` |
| prompt-completion | `prompt` and `completion`, plain text or messages                                 |
| tokenized         | `input_ids`, optional `labels`, `completion_mask`, `assistant_masks`              |
| image-text        | `messages` and `images` (or `image`), a processor as `processing_class`: `image_text` |
| packed            | `input_ids` (or image-text `messages`) and `seq_lengths` (made by `pack_dataset`) |
"""

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from ..core.overflow import check_overflow_policy
from ..core.rows import IGNORE_INDEX
from ..data.pack import pack_dataset
from ..errors import PackingTypeError, PackingValueError


logger = logging.getLogger(__name__)

RAW_COLUMNS = ("messages", "conversations", "prompt", "input_ids")  # with `dataset_text_field`: what TRL prepares


def column_names(name: str, dataset) -> list[str]:
    """The columns of a `Dataset` or `IterableDataset` (a stream without known features shows its first example's)."""
    if isinstance(dataset, Dataset):
        return dataset.column_names
    if isinstance(dataset, IterableDataset):
        return dataset.column_names or list(next(iter(dataset), {}))
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        split = "train" if "train" in dataset else next(iter(dataset), "train")
        raise PackingTypeError(
            f"`{name}` must be a datasets Dataset or IterableDataset, got a {type(dataset).__name__} of the splits "
            f"{list(dataset)}. Pass one split, e.g. `{name}=dataset[{split!r}]`."
        )
    raise PackingTypeError(
        f"`{name}` must be a datasets Dataset or IterableDataset, got {type(dataset).__name__}. Wrap your examples "
        "with `datasets.Dataset.from_list`."
    )


def is_packed(name: str, dataset) -> bool:
    """Whether `dataset` holds rows `pack_dataset` made (`seq_lengths`, with `input_ids`, or with `messages` for
    image-text rows), which are trained as they are."""
    columns = column_names(name, dataset)
    return "seq_lengths" in columns and ("input_ids" in columns or "messages" in columns)


def check_format(name: str, dataset, *, text_field: str, formatting_func: Callable | None = None) -> None:
    """
    Refuse a dataset in none of the formats above, naming its columns and the ones each format needs.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> check_format("train_dataset", Dataset.from_dict({"messages": [[{"role": "user", "content": "Hi"}]]}),
    ...              text_field="text")
    >>> check_format("train_dataset", Dataset.from_dict({"question": ["Hi?"]}), text_field="text")
    Traceback (most recent call last):
        ...
    llm_packing.errors.PackingValueError: `train_dataset` has columns ['question'], in none of the formats ...

    ```
    """
    columns = column_names(name, dataset)
    if formatting_func is not None or any(column in columns for column in (*RAW_COLUMNS, text_field)):
        if "prompt" in columns and "completion" not in columns:
            raise PackingValueError(
                f"`{name}` has a `prompt` column but no `completion` (columns {columns}). Prompt-completion data "
                "needs both; for plain text, rename the column to `text` (or set `dataset_text_field`)."
            )
        return
    raise PackingValueError(
        f"`{name}` has columns {columns}, in none of the formats trl.SFTTrainer prepares: `{text_field}` "
        "(`dataset_text_field`), `messages` or `conversations`, `prompt` + `completion`, tokenized `input_ids`, or "
        "rows packed by `pack_dataset` (`input_ids` + `seq_lengths`). Rename a column, set `dataset_text_field`, or "
        "pass a `formatting_func`."
    )


def pack_documents(
    dataset,
    prepare: Callable,
    *,
    max_length: int,
    overflow: str,
    truncation_mode: str,
    max_docs_per_bin: int | None = None,
    num_proc: int | None = None,
    name: str = "train",
    main_process_first: Callable = contextlib.nullcontext,
):
    """
    Prepare `dataset` with TRL's code and pack it globally into rows of at most `max_length` tokens.

    Args:
        dataset ([`~datasets.Dataset`] or [`~datasets.IterableDataset`]):
            A dataset in one of the formats of this module, other than packed.
        prepare (`Callable`):
            `prepare(dataset, max_length)`: `SFTTrainer._prepare_dataset` without packing, truncating to `max_length`
            as `SFTConfig.truncation_mode` says (not at all for `None`) and, when it truncates, dropping the examples
            left without a trained token.
        max_length (`int`):
            Tokens per packed row.
        overflow (`str`):
            Documents longer than `max_length`: `"truncate"` cuts them as `trl.SFTTrainer` does (its
            `truncation_mode`; examples left without a trained token are dropped, as TRL drops them), `"split"` cuts
            them into `max_length` pieces packed as separate documents (no token lost), `"drop"` leaves them out,
            `"error"` refuses them. What was cut is logged as a warning, and is in the returned stats.
        truncation_mode (`str`):
            `SFTConfig.truncation_mode`: `"keep_start"` or `"keep_end"`.
        max_docs_per_bin (`int`, *optional*), num_proc (`int`, *optional*):
            As for [`~llm_packing.data.pack.pack_dataset`].
        name (`str`, *optional*, defaults to `"train"`):
            The split's name in messages.
        main_process_first (`Callable`, *optional*):
            A context manager under which the packing runs: with several processes, one that lets the main process
            write the packed rows to the cache before the others load them.

    Returns:
        `tuple`: the packed dataset and its [`~llm_packing.core.stats.PackingStats`] (`None` for a stream, whose
        stats are logged once it has been read).
    """
    check_overflow_policy(overflow)
    # TRL's `labels` apply the masks it means to apply; a mask column it leaves (`completion_mask` with
    # `completion_only_loss=False`) must not be applied again by `pack_dataset`.
    documents = prepare(dataset, None).select_columns(["input_ids", "labels"])
    if isinstance(documents, IterableDataset):
        if overflow == "truncate" and truncation_mode != "keep_start":
            raise PackingValueError(
                f"`truncation_mode`={truncation_mode!r} needs a map-style dataset to truncate over-long documents, "
                f"got a stream for `{name}`. Set `truncation_mode='keep_start'`, or pass `overflow='split'` (keeps "
                "every token) or `'drop'` to the trainer."
            )
        return pack_dataset(documents, max_length, overflow=overflow, max_docs_per_bin=max_docs_per_bin), None
    cut, prepared = {}, documents
    if overflow == "truncate":
        documents, cut = _truncate_as_trl(documents, prepare, max_length, truncation_mode, name)
    with main_process_first():
        packed, stats = pack_dataset(documents, max_length, overflow=overflow, max_docs_per_bin=max_docs_per_bin,
                                     num_proc=num_proc, return_stats=True)
    if name == "train" and not len(packed):  # else TRL stops on a bare StopIteration, or the sampler on no rows
        raise _nothing_to_train(prepared, max_length, overflow)
    if stats.split_sequences or stats.dropped_sequences:
        logger.warning(
            "%s: %d of %d documents are longer than max_length=%d: %s. Raise `max_length` to keep them whole.", name,
            stats.split_sequences + stats.dropped_sequences, len(documents), max_length,
            f"split into max_length pieces trained as separate documents (overflow={overflow!r})"
            if overflow == "split" else f"{stats.dropped_tokens} tokens left out (overflow={overflow!r})",
        )
    return packed, dataclasses.replace(stats, **cut)


def _nothing_to_train(documents: Dataset, max_length: int, overflow: str) -> PackingValueError:
    """The error for a `train_dataset` whose prepared documents all left the packed rows, saying why they left."""
    lengths, _ = _lengths_and_trained(documents) if len(documents) else (np.zeros(0, np.int64), None)
    empty = int((lengths == 0).sum())
    if empty == len(documents):
        return PackingValueError(
            "`train_dataset` leaves nothing to train on: "
            f"{f'all {empty} of its documents are empty' if empty else 'it has no documents'} once prepared (empty "
            "`input_ids`, or an empty text field). Check the column trl.SFTTrainer tokenizes (`dataset_text_field`, "
            "`messages`, ...) or the `input_ids`, and filter the empty examples out."
        )
    dropped = (f"longer than max_length={max_length}, and overflow='drop' leaves them out" if overflow == "drop" else
               f"left without a trained token within max_length={max_length} (every label -100), and trl.SFTTrainer "
               "drops such examples")
    return PackingValueError(
        f"`train_dataset` leaves nothing to train on: of its {len(documents)} documents, {empty} are empty and the "
        f"other {len(documents) - empty} were {dropped}. Check the labels (`completion_only_loss`, "
        "`assistant_only_loss`, -100 in `labels`), raise `max_length`, or pass `overflow='split'` to the trainer."
    )


def _truncate_as_trl(documents: Dataset, prepare: Callable, max_length: int, truncation_mode: str, name: str):
    """TRL's truncation, applied only when it changes something, and what it cut."""
    lengths, trained = _lengths_and_trained(documents)
    too_long = lengths > max_length
    if not too_long.any() and trained.all():
        return documents, {}
    truncated = prepare(documents, max_length)
    lengths_after, trained_after = _lengths_and_trained(truncated)
    cut = {
        "truncated_sequences": int(too_long.sum()),
        "truncated_tokens": int((lengths[too_long] - max_length).sum()),
        "dropped_sequences": len(documents) - len(truncated),
        "dropped_tokens": int(np.minimum(lengths, max_length).sum() - lengths_after.sum()),
    }
    # Each warning only when it happened: an example without a trained token is dropped whatever its length.
    if cut["truncated_sequences"]:
        logger.warning(
            "%s: %d of %d documents are longer than max_length=%d and were truncated as trl.SFTTrainer truncates them "
            "(truncation_mode=%r): %d tokens cut, %d of them trained on. Keep every token with `overflow='split'` "
            "(pieces trained as separate documents), refuse them with `overflow='error'`, or raise `max_length`.",
            name, cut["truncated_sequences"], len(documents), max_length, truncation_mode, cut["truncated_tokens"],
            int(trained.sum() - trained_after.sum()),
        )
    if cut["dropped_sequences"]:
        logger.warning(
            "%s: %d of %d examples have no trained token%s (empty, or every label -100) and were dropped, as "
            "trl.SFTTrainer drops them.", name, cut["dropped_sequences"], len(documents),
            f" within max_length={max_length}" if cut["truncated_sequences"] else "",
        )
    return truncated, cut


def _lengths_and_trained(documents: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Per document, from Arrow: its token count and how many of its labels are trained (not -100)."""
    table = documents.with_format("arrow")[:]
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    labels = table.column("labels")
    flat = pc.list_flatten(labels)
    # Every list empty: Arrow types the labels `list<null>`, and no null scalar holds -100.
    ignore_index = pa.scalar(IGNORE_INDEX, pa.int64() if pa.types.is_null(flat.type) else flat.type)
    is_trained = pc.cast(pc.not_equal(flat, ignore_index), pa.int64()).to_numpy(zero_copy_only=False)
    label_lengths = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
    trained_so_far = np.concatenate([[0], np.cumsum(is_trained)])
    ends = np.cumsum(label_lengths)
    return lengths, trained_so_far[ends] - trained_so_far[ends - label_lengths]
