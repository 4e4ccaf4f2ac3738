"""What a compiled packed model is checked on, shared by tests/test_compile.py and benchmarks/gpu_compile_check.py:
batches of new document layouts and lengths, and dynamo's count of compiled frames."""

import random

from torch._dynamo import convert_frame
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from llm_packing import DataCollatorWithPacking


def packed_batches(count: int, seed: int = 0, flash: bool = False) -> list[dict]:
    """`count` collated batches of 2 packed rows, 2-5 documents of 1-20 tokens each: every batch a new layout, most a
    new length (`flash`: the collator's FlashAttention keyword arguments too)."""
    collator, rng, batches = DataCollatorWithPacking(return_flash_attn_kwargs=flash), random.Random(seed), []
    for _ in range(count):
        rows = []
        for _ in range(2):
            lengths = [rng.randint(1, 20) for _ in range(rng.randint(2, 5))]
            rows.append({"input_ids": [rng.randint(3, 127) for _ in range(sum(lengths))], "seq_lengths": lengths})
        batches.append(collator(rows))
    return batches


def compiled_frames() -> int:
    """How many compiled entries dynamo holds, over every frame it has seen: each compile of a frame adds one."""
    codes = [reference() for reference in convert_frame.input_codes.seen]
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes if code is not None)
