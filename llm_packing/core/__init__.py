"""The packing engine: which documents go into which row, and the rules of a packed row.

- `binpack`: `pack_sequences`, best-fit decreasing (and its siblings) on the length histogram;
- `bin_groups`: the decreasing strategies' bins grouped by contents while packing, then bound to document ids;
- `plan`: `plan_rows`, the rows `pack_dataset` writes (the same bins, in their final order), ~10 bytes a document;
- `buffered`: `buffered_bins`, the bins of a stream packed a bounded buffer at a time (streamed `pack_dataset`);
- `templates`: a plan as bin templates, and documents handed to their slots a chunk of rows at a time;
- `length_sort`: document ids sorted by length in 4 bytes each, a streamed counting sort;
- `overflow`: over-long and empty documents cut into pieces before packing, per the `overflow` policy;
- `stats`: `PackingStats`, how tight a packing is and what was cut;
- `rows`: the layout of one packed row (positions restarting per document, -100 on each first label, token checks);
- `locality`: an order of the rows that reads the input in about one pass;
- `checks`: one wording for bad arguments (counts, seeds, flags, processors);
- `image_text`: image references as datasets hold them (header sizes, decoding as `datasets` decodes) and images
  placed in messages as TRL places them.

May import: `llm_packing.errors` and numpy only (no torch, transformers, datasets or pyarrow), so that planning a
corpus needs nothing else; Pillow, on first use, for images.
"""
