"""The model hook: `configure_packing(model)` makes an indexed mask (`[1, 1, 2, 2, 2, 0]`) attend per document on
every backend, and `unconfigure_packing()` undoes it.

- `configure`: configure / unconfigure, the mask-builder wrappers and the backend routes;
- `registry`: the one patch registry, and the replacements that run outside compiled graphs;
- `documents`: each forward's document layout, read once from the indexed mask and kept with that forward;
- `builders`: transformers' mask builders and FlashAttention's unpad data, per document;
- `builderless`: packed batches refused by models that call no mask builder (pure SSMs, ...) unless configured;
- `masks`: indexed masks (unpad data for FlashAttention, per-document positions, id checks);
- `shapes`: the attention heads' widths, per layer where the config varies them;
- `attention/`: attention per document where the builders cannot express it alone (sdpa's varlen route, chunked
  attention, image mask functions, ALiBi, sparse key indexers);
- `rotary`: rope types whose frequencies follow the sequence length (`longrope`, `dynamic`) given each document's own;
- `mixers`: hybrid models' conv / SSM / delta-net mixers run per document;
- `media/`: images and videos kept with their documents (the proven types prepared, all other media refused);
- `trainer_columns`: `transformers.Trainer` keeps the packed rows' `seq_lengths` for the collator;
- `guards`: training batches without documents, and kernels measured wrong on packed rows, refused;
- `peft_methods`: PEFT methods that read a packed row as one sequence (prompt learning, activated LoRA), refused;
- `compile_limits`: dynamo's recompile limit, raised so that compiled packed models stay compiled;
- `cache`: the KV cache of a packed forward refused with the fix, an image-text model's top-level `use_cache=False`
  passed on to its text model;
- `verify`: `verify_packing`, the behavioural check (its limits, calibrated on the model's own noise, in
  `verify_limits`; with images: `media.verify_images`);
- `support`: which architectures are proven or refused, as data, and the support matrix.

May import: `llm_packing.core`, `llm_packing.errors`, `llm_packing._compat`, torch and transformers; never `data`,
`batches`, `trainers`, `demo` or `cli`.
"""
