"""Attention per document, where transformers' own mask builders cannot express it alone:

- `varlen`: sdpa's route without an `L x L` mask (`PackedAttentionMask`; torch's FlashAttention 2 varlen op on CUDA,
  SDPA per length bucket elsewhere);
- `flash_op`: when and how that route calls torch's FlashAttention 2 varlen op;
- `route`: `attention_route` (`"auto"`, `"varlen"`, `"dense"`): which of the two routes a packed batch takes;
- `chunked`: chunked attention per document on transformers < 5.23, whose packed masks chunk along the row;
- `mask_functions`: mask builder calls with image mask functions (bidirectional image blocks) bounded by the document;
- `alibi`: ALiBi biases per document;
- `indexers`: the DeepSeek sparse attention indexers' top-k keys chosen per document;
- `temperature`: Llama 4's query temperature (layers without rope) from each document's positions.

May import: the hook's core modules (`registry`, `documents`, `masks`, `shapes`, `support`), `llm_packing.core`,
`llm_packing.errors`, `llm_packing._compat`, torch and transformers; never `hook.configure` or `hook.media`.
"""
