"""Which architectures the hook isolates, as data: `table` (the hand-kept proofs and refusals), `model_types` (the
causal LM types of the installed transformers), `releases` (what an older admitted transformers is too old for),
`mixers` (the mixers of hybrid and recurrent types the hook runs per document, and how each is called),
`architectures` (these combined for the installed release: `supported_model_types`, `require_supported`, the sdpa
route per type), `image_text` (the image-text types packed with their images), `video` (those packed with their
videos, on which backends, and why the others' videos are refused), `sequence_parallel` (the types proven under
sequence parallelism) and `matrix` (docs/support_matrix.md, rendered).

May import: `llm_packing.errors` and `llm_packing._compat`.
"""
