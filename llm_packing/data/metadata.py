"""What a `pack_dataset` output remembers about its packing: the `max_length` its rows were packed to.

Kept in the dataset's `info.description`, as a sentence a person can read and a key this module parses. `datasets`
carries `info` through `save_to_disk` / `load_from_disk`, `select`, `shuffle`, `filter`, `map`, `with_format` and
`select_columns`, so [`~llm_packing.trainers.sft.PackedSFTTrainer`] can compare it with `SFTConfig.max_length` and the
collator's. Columns are not relied on: which ones a packed row carries may change.
"""

import re

import datasets


_DESCRIPTION = "Packed by llm_packing.pack_dataset into rows of at most max_length={} tokens."
_PATTERN = re.compile(r"Packed by llm_packing\.pack_dataset into rows of at most max_length=(\d+) tokens\.")


def record_packing(packed, max_length: int):
    """
    Record `max_length` in `packed` (a dataset, or every split of a dataset dict); returns `packed`.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> packed = record_packing(Dataset.from_dict({"input_ids": [[1, 2]], "seq_lengths": [[2]]}), 4)
    >>> packed_max_length(packed.shuffle(seed=0).select([0]))
    4

    ```
    """
    if isinstance(packed, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        for split in packed.values():
            record_packing(split, max_length)
    else:
        packed.info.description = _DESCRIPTION.format(int(max_length))
    return packed


def packed_max_length(dataset) -> int | None:
    """The `max_length` that `pack_dataset` packed `dataset` to, or `None` if it was not recorded."""
    info = getattr(dataset, "info", None)
    match = _PATTERN.search(getattr(info, "description", None) or "")
    return int(match.group(1)) if match else None
