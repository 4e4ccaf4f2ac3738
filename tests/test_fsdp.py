"""Sharded training with packing, proven on CPU ranks: torch's FSDP2 (`fully_shard`) on 2 gloo processes, applied by
hand and by accelerate's own FSDP2 preparation (as `recipes/accelerate/fsdp.yaml` configures it).

The hook meets sharded (DTensor) parameters, per-layer all-gathers, resharding after the forward or not, and
activation checkpointing's recompute in the backward. One step on packed rows split across the ranks must give the
gradients and the weights of one process on all rows, and of every document trained alone (1e-6, float32), for a
Llama, a sliding-window model (qwen2, 4-token window) and a hybrid (qwen3_next, gated delta net). Negative control:
the same sharded step on rows collated with a 0/1 mask and no positions, without the hook, is caught by the same
comparison against the documents alone. The two processes start once for all cases (`sharded_training.worker`).
"""

import pytest
from sharded_training import assert_exact, assert_leak_caught, case_name, cases, run_ranks


MODEL_TYPES = ("llama", "qwen2", "qwen3_next")
CASES = cases("fsdp2", MODEL_TYPES)

# One xdist worker runs the module, so its 2 ranks start once (about 30-50 s on 2 busy cores, all cases together).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp2")]


@pytest.fixture(scope="module")
def differences(tmp_path_factory):
    return run_ranks("fsdp2", MODEL_TYPES, tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.parametrize("case", [case for case in CASES if case[-1]], ids=case_name)
def test_sharded_step_equals_one_process_and_documents_alone(differences, case):
    assert_exact(differences[case_name(case)])


@pytest.mark.parametrize("case", [case for case in CASES if not case[-1]], ids=case_name)
def test_rows_without_the_indexed_mask_fail_the_comparison(differences, case):
    assert_leak_caught(differences[case_name(case)])
