"""Tokenized documents as one compact file, for machines that cannot tokenize them.

The benchmarks' real documents are the demo conversations tokenized with the demo tokenizer (the `demo` extra:
`mistral-common`, `chitchat-dataset` and their needs, about 20 MB of wheels, one of which pins numpy below the GPU
image's). A GPU machine without network gets them instead as this file (about 4 MB), written here by
`gpu_wheels.py`: token ids as uint16 (the demo vocabulary has 32,000 tokens), the document lengths, and which labels
are -100 (bit-packed), in `numpy.savez_compressed`.

Example:
```python
>>> import os, tempfile
>>> import datasets
>>> documents = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8]], "labels": [[-100, 6, 7], [8]]})
>>> path = os.path.join(tempfile.mkdtemp(), "documents.npz")
>>> save_documents(documents, path)
>>> load_documents(path).to_dict()
{'input_ids': [[5, 6, 7], [8]], 'labels': [[-100, 6, 7], [8]]}
>>> load_documents(path, max_samples=1).num_rows
1

```
"""

import numpy as np


IGNORE_INDEX = -100


def save_documents(documents, path: str) -> None:
    """Write `documents` (columns `input_ids` and `labels`, labels either the token or -100) to `path`."""
    ids = documents.data.column("input_ids").combine_chunks()
    labels = documents.data.column("labels").combine_chunks()
    flat_ids = ids.values.to_numpy()
    flat_labels = labels.values.to_numpy()
    if flat_ids.max(initial=0) > np.iinfo(np.uint16).max or flat_ids.min(initial=0) < 0:
        raise ValueError(f"token ids must fit uint16 (0 to 65,535), got {flat_ids.min()} to {flat_ids.max()}")
    ignored = flat_labels == IGNORE_INDEX
    if not np.array_equal(flat_labels[~ignored], flat_ids[~ignored]):
        raise ValueError("every label must be its token or -100; other labels cannot be stored in this format")
    np.savez_compressed(path, lengths=np.diff(ids.offsets.to_numpy()).astype(np.int32),
                        input_ids=flat_ids.astype(np.uint16), ignored=np.packbits(ignored), tokens=len(flat_ids))


def load_documents(path: str, max_samples: int | None = None):
    """The documents saved in `path`, as a `datasets.Dataset` of `input_ids` and `labels` (int64 lists); the first
    `max_samples` only if given."""
    import datasets
    import pyarrow as pa

    with np.load(path) as saved:
        lengths = saved["lengths"][:max_samples]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int32)])
        ids = saved["input_ids"][: offsets[-1]].astype(np.int64)
        ignored = np.unpackbits(saved["ignored"], count=int(saved["tokens"]))[: offsets[-1]].astype(bool)
    labels = np.where(ignored, IGNORE_INDEX, ids)
    columns = {name: pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))
               for name, values in (("input_ids", ids), ("labels", labels))}
    return datasets.Dataset(pa.table(columns))
