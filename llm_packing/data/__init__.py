"""Datasets in, packed rows out: `pack_dataset` (`pack`), its streamed form for `IterableDataset` (`streaming`),
image-text conversations planned without pixels (`image_text`) and packed (`pack_image_text`), and what a packed
dataset remembers about its packing (`metadata`). `_io` holds the memory-mapped reads, the gather and the
cache-file writes under `pack_dataset`; nothing outside `data` imports it.

May import: `llm_packing.core`, `llm_packing.errors`, numpy, pyarrow and datasets; never torch or transformers.
"""
