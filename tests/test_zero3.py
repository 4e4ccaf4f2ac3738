"""DeepSpeed ZeRO-3 with packing, proven on CPU ranks: DeepSpeed's CPU accelerator on 2 gloo processes.

Parameters, gradients and optimizer state partitioned across the ranks, gathered layer by layer by DeepSpeed's own
hooks, with and without transformers' activation checkpointing: one step on packed rows split across the ranks gives
the gradients and the weights of one process on all rows, and of every document trained alone (1e-6, float32), as
`test_fsdp.py` checks for FSDP2 (same models, rows and references, `sharded_training.py`). Negative control: rows
with a 0/1 mask and no positions, without the hook, fail the comparison against the documents alone.
"""

import importlib.util

import pytest
from sharded_training import assert_exact, assert_leak_caught, case_name, cases, run_ranks


MODEL_TYPES = ("llama", "qwen2", "qwen3_next")
CASES = cases("zero3", MODEL_TYPES)

# Only the spawned ranks import DeepSpeed: the test process stays as the other tests find it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("zero3"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="pip install deepspeed (the [test] extra installs it on Linux)"),
]


@pytest.fixture(scope="module")
def differences(tmp_path_factory):
    return run_ranks("zero3", MODEL_TYPES, tmp_path_factory.mktemp("zero3"))


@pytest.mark.parametrize("case", [case for case in CASES if case[-1]], ids=case_name)
def test_zero3_step_equals_one_process_and_documents_alone(differences, case):
    assert_exact(differences[case_name(case)])


@pytest.mark.parametrize("case", [case for case in CASES if not case[-1]], ids=case_name)
def test_zero3_rows_without_the_indexed_mask_fail_the_comparison(differences, case):
    assert_leak_caught(differences[case_name(case)])
