"""Which model types sequence parallelism (`llm_packing.parallel`, Ulysses) is proven for, as data.

`tests/test_sequence_parallel.py` proves each on 2 and 4 gloo ranks, float32 and float64: per-document logits, the
loss and every parameter's gradient of packed rows cut across the ranks equal each document run alone (qwen2's tiny
config slides a 4-token window on one layer; llama runs with 2 key/value heads and with 1, fewer than the ranks).
Every other type is refused under `sequence_parallel_size > 1`: hybrids (their mixers' state runs along the row) and
image-text models by design, the rest until the test covers them.
"""

SEQUENCE_PARALLEL_MODEL_TYPES = ("llama", "qwen2", "qwen3")

SEQUENCE_PARALLEL_PROOF = (
    "sdpa (varlen route) under `sequence_parallel_size` 2 and 4: per-document logits, loss and every gradient equal "
    "each document alone (float32 1e-5, float64 1e-12)"
)
