"""The packing engine: which documents go into which row, and the rules of a packed row.

- `binpack`: `pack_sequences`, best-fit decreasing (and its siblings) on the length histogram;
- `overflow`: over-long and empty documents cut into pieces before packing, per the `overflow` policy;
- `stats`: `PackingStats`, how tight a packing is and what was cut;
- `rows`: the layout of one packed row (positions restarting per document, -100 on each first label, token checks);
- `locality`: an order of the rows that reads the input in about one pass;
- `checks`: one wording for bad scalar arguments;
- `image_text`: image references as datasets hold them (header sizes, decoding as `datasets` decodes) and images
  placed in messages as TRL places them.

May import: `llm_packing.errors` and numpy only (no torch, transformers, datasets or pyarrow), so that planning a
corpus needs nothing else; Pillow, on first use, for images.
"""
