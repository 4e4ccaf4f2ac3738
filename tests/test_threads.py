"""Concurrent forwards on one configured model, as `nn.DataParallel` runs them (one replica per thread; HF `Trainer`
uses it on a machine with several GPUs and no launcher): every thread gets exactly the logits its own packed batch
gives when run alone, on every route the hook has.

Each case runs three different packed batches (other document layouts, other tokens) on three threads at once, each
thread many times over, the threads released together at every round so that their forwards interleave; each output
must equal the batch's single-threaded output. State that one forward keeps for its layers (the document layout, the
unpad data, the varlen buckets, the mixers' document batches, the mask a recurrent model records) must belong to that
forward: with it kept process-wide, gemma3_text on sdpa differed by up to 1.1 (issue 25).
"""

import copy
import sys
import threading

import pytest
import torch
from test_flash_path import flash_model  # noqa: F401  (the fixture: transformers' FlashAttention code, reference kernel)
from tiny_models import PACKED_ROW_LENGTH, packed_batch, tiny_model

from llm_packing import packing_configured


THREADS = 3
ROUNDS = 8
TOLERANCE = 1e-6  # the same batch through the same kernels: only a leak from another thread's forward moves it
# Different layouts per thread: rows of different document counts and lengths, trailing padding in some.
LAYOUTS = (
    ((5, 1, 7, 3), (9, 2, 1, 6)),
    ((18,), (2, 2, 2, 2, 10)),
    ((1, 1, 1, 4, 8), (11, 5)),
)
# (model_type, backend, attention_route): a plain model, sliding windows (gemma3_text alternates sliding and full
# layers), hybrids (qwen3_5_text's gated delta nets read the mask; RWKV's blocks read the mask their model was called
# with) and ALiBi (bloom) on each route they take, one model shared by the threads.
CASES = [
    ("llama", "sdpa", "varlen"),
    ("llama", "sdpa", "dense"),
    ("llama", "eager", "auto"),
    ("gemma3_text", "sdpa", "varlen"),
    ("gemma3_text", "sdpa", "dense"),
    ("gemma3_text", "eager", "auto"),
    ("qwen3_5_text", "sdpa", "varlen"),
    ("qwen3_5_text", "eager", "auto"),
    ("rwkv", "eager", "auto"),
    ("bloom", "eager", "auto"),
]
FLASH_CASES = [(model_type, "flash_attention_2") for model_type in ("llama", "gemma3_text", "qwen3_5_text")]


def _batches():
    return [packed_batch(document_lengths=layout, row_length=PACKED_ROW_LENGTH, seed=seed)
            for seed, layout in enumerate(LAYOUTS)]


def _logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False).logits


def _hammer(models, batches) -> list[float]:
    """Per batch, the largest difference between its outputs on the threads (thread `i` runs `models[i]`) and its
    output run alone."""
    expected = [_logits(model, batch) for model, batch in zip(models, batches, strict=True)]
    differences = [0.0] * len(batches)
    errors = []
    start = threading.Barrier(len(batches))

    def run(index):
        try:
            for _ in range(ROUNDS):
                start.wait()
                output = _logits(models[index], batches[index])
                differences[index] = max(differences[index], (output - expected[index]).abs().max().item())
        except BaseException as error:  # reported below: a thread's exception would otherwise vanish
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(batches))]
    # Hand the interpreter from thread to thread every few microseconds (5 ms by default), so that the Python parts of
    # concurrent forwards interleave as finely as a replica per GPU makes them.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    if errors:
        raise errors[0]
    return differences


@pytest.mark.parametrize(("model_type", "backend", "route"), CASES)
def test_concurrent_forwards_each_get_their_own_documents(model_type, backend, route):
    model = tiny_model(model_type, backend)
    with packing_configured(model, attention_route=route):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences


def test_concurrent_forwards_on_replicas_of_a_model_that_keeps_state_on_its_modules():
    """recurrent_gemma's blocks read the mask's documents from `position_ids`. Its RG-LRU keeps its recurrent state on
    the module (`self.recurrent_states`, even with `use_cache=False`), so two threads sharing one model race inside
    transformers, packed or not; `nn.DataParallel` gives each thread a replica of its own, as here. The hook's state is
    still shared by the replicas (the same classes, the same patched functions)."""
    model = tiny_model("recurrent_gemma", "eager")
    with packing_configured(model):
        differences = _hammer([copy.deepcopy(model) for _ in range(THREADS)], _batches())
    assert max(differences) <= TOLERANCE, differences


def test_concurrent_forwards_on_flex_attention():
    model = tiny_model("llama", "flex_attention")
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), packing_configured(model):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences


@pytest.mark.parametrize(("model_type", "backend"), FLASH_CASES)
def test_concurrent_forwards_on_the_flash_attention_path(flash_model, model_type, backend):  # noqa: F811
    model = flash_model(model_type, backend)
    with packing_configured(model):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences
