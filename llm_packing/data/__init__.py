"""Datasets in, packed rows out: `pack_dataset` (`pack`), its streamed form for `IterableDataset` (`streaming`), the
same on a Ray cluster (`on_ray`: `pack_dataset_on_ray`, Ray imported when called), image-text conversations planned
without pixels (`image_text`) and packed (`pack_image_text`; streamed: `streaming_image_text`), and what a packed
dataset remembers about its packing (`metadata`). `_io` holds the memory-mapped reads, the gather and the cache-file
writes under `pack_dataset`; nothing outside `data` imports it.

May import: `llm_packing.core`, `llm_packing.errors`, numpy, pyarrow, datasets and (inside functions) ray and
Pillow; never torch or transformers.
"""
