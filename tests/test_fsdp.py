"""Sharded training with packing, proven on CPU ranks: torch's FSDP2 (`fully_shard`) on 2 gloo processes.

The hook meets sharded (DTensor) parameters, per-layer all-gathers, resharding after the forward or not, and
activation checkpointing's recompute in the backward. One step on packed rows split across the ranks must give the
gradients and the weights of one process on all rows, and of every document trained alone (1e-6, float32), for a
Llama, a sliding-window model (qwen2, 4-token window) and a hybrid (qwen3_next, gated delta net). Negative control:
the same sharded step on rows collated with a 0/1 mask and no positions, without the hook, is caught by the same
comparison against the documents alone. The two processes start once for all cases (`sharded_training.worker`).
"""

import json
import socket

import pytest
import torch.multiprocessing as mp
from sharded_training import LEARNING_RATE, WORLD_SIZE, case_name, cases, worker


MODEL_TYPES = ("llama", "qwen2", "qwen3_next")
TOLERANCE = 1e-6
# A leak must move some gradient by far more than float32 noise to count as caught.
LEAK = 1e-4

# One xdist worker runs the module, so its 2 ranks start once (about 30-50 s on 2 busy cores, all cases together).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]


@pytest.fixture(scope="module")
def differences(tmp_path_factory):
    """Largest differences of every case, per reference: one spawn of `WORLD_SIZE` gloo ranks runs them all."""
    path = tmp_path_factory.mktemp("fsdp") / "differences.json"
    mp.start_processes(worker, args=(_free_port(), MODEL_TYPES, str(path)), nprocs=WORLD_SIZE, start_method="spawn")
    return json.loads(path.read_text())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


POSITIVES = [case for case in cases(MODEL_TYPES) if case[3]]
NEGATIVES = [case for case in cases(MODEL_TYPES) if not case[3]]


@pytest.mark.parametrize("case", POSITIVES, ids=case_name)
def test_sharded_step_equals_one_process_and_documents_alone(differences, case):
    measured = differences[case_name(case)]
    for reference in ("single", "documents"):
        assert measured[reference]["gradients"] <= TOLERANCE, (reference, measured)
        assert measured[reference]["weights"] <= TOLERANCE, (reference, measured)
    assert measured["documents"]["largest_gradient"] > 1e-2  # the comparison has something to compare


@pytest.mark.parametrize("case", NEGATIVES, ids=case_name)
def test_rows_without_the_indexed_mask_fail_the_comparison(differences, case):
    measured = differences[case_name(case)]
    assert measured["documents"]["gradients"] > LEAK, measured
    assert measured["documents"]["weights"] > LEAK * LEARNING_RATE, measured
