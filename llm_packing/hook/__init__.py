"""The model hook: `configure_packing(model)` makes an indexed mask (`[1, 1, 2, 2, 2, 0]`) attend per document on
every backend, and `unconfigure_packing()` undoes it.

- `configure`: configure / unconfigure, the mask-builder wrappers and the backend routes;
- `chunked`: chunked attention per document on transformers < 5.23, whose packed masks chunk along the row;
- `masks`: indexed masks (unpad data for FlashAttention, per-document positions, id checks);
- `varlen`: sdpa's per-document route without an `L x L` mask (the heads' width read by `shapes`);
- `mixers`: hybrid models' conv / SSM / delta-net mixers run per document;
- `indexers`: the DeepSeek sparse attention indexers' top-k keys chosen per document;
- `alibi`: ALiBi biases per document;
- `guards`: training batches without documents, and kernels measured wrong on packed rows, refused;
- `cache`: the KV cache of a packed forward refused with the fix, an image-text model's top-level `use_cache=False`
  passed on to its text model;
- `multimodal`: media inputs in packed batches: images of the proven image-text types prepared by `image_text`
  (per-document mRoPE positions in `mrope`, each image's document checked in `placeholders`, videos of the proven
  video types in `video`, Mllama's cross-attention bounded in `cross_attention`), all other media refused;
- `mask_functions`: mask builder calls with image mask functions (bidirectional image blocks) bounded by the document;
- `verify`: `verify_packing`, the behavioural check (its limits, calibrated on the model's own noise, in
  `verify_limits`; with images: `verify_images`);
- `support`: which architectures are proven or refused, as data, and the support matrix.

May import: `llm_packing.core`, `llm_packing.errors`, `llm_packing._compat`, torch and transformers; never `data`,
`batches`, `trainers`, `demo` or `cli`.
"""
