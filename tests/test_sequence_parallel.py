"""Sequence parallelism (Ulysses) on packed rows, proven on gloo CPU ranks: each packed row is cut across 2 or 4
processes, and the per-document logits, the loss and every parameter's gradient must equal one process running each
document alone (float32 within 1e-5, float64 within 1e-12). Every case of a group size runs in one spawn of its ranks
(`sequence_parallel_worker.py`, forked): starting the processes costs a second or two, the cases milliseconds.

Layouts: documents straddling piece boundaries, odd lengths and odd row lengths (padded to a multiple of the group),
one-token documents, trailing padding, a document filling its row. Models: tiny Llama (2 KV heads, and 1: fewer KV
heads than ranks), Qwen3, and Qwen2 with a 4-token sliding window on one layer. The negative control attends each
rank's piece alone (no global boundaries) and must fail the same comparison.
"""

import itertools
import socket

import pytest
import sequence_parallel_worker as worker
import torch
import torch.multiprocessing as mp
from tiny_models import tiny_model

from llm_packing import UnsupportedSetupError
from llm_packing.parallel import configure_sequence_parallel, shard_packed_batch


# Row 0: documents of 5, 1, 7, 3 and 2 pads (the collator pads it to row 1's 18; the 7 straddles the middle), row 1:
# 9, 2, 1, 6. Then one odd row of 17 (padded by the shard), and a row of one 13-token document.
LAYOUTS = {"straddling": ((5, 1, 7, 3), (9, 2, 1, 6)), "odd": ((7, 1, 9),), "one_document": ((13,),)}
MODELS = {"llama": ("llama", 2), "llama_kv1": ("llama", 1), "qwen3": ("qwen3", 2), "qwen2_sliding": ("qwen2", 2)}
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


def _cases():
    cases = [
        {"name": f"{model}-{dtype}-{layout}", "model_type": MODELS[model][0], "kv_heads": MODELS[model][1],
         "dtype": dtype, "layout": LAYOUTS[layout]}
        for model, dtype, layout in itertools.product(MODELS, TOLERANCE, LAYOUTS)
    ]
    cases.append({"name": "local-pieces", "model_type": "llama", "kv_heads": 2, "dtype": "float64",
                  "layout": LAYOUTS["straddling"], "local": True})
    return cases


CASES = {case["name"]: case for case in _cases()}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"{world}ranks")
def sharded(request, tmp_path_factory):
    """The results of every case on `world` gloo ranks."""
    world = request.param
    path = tmp_path_factory.mktemp(f"sp{world}") / "results.pt"
    # Forked, the ranks start with torch and transformers imported (spawned, each imports them: 20-30 s here).
    mp.start_processes(worker.run, args=(world, _free_port(), list(CASES.values()), str(path)), nprocs=world,
                       join=True, start_method="fork")
    return torch.load(path)


def _documents_alone(case):
    """One process, each document run alone (no packing, no hook): its logits, and the mean token loss and its
    gradients over every document of the batch."""
    model = worker.build_model(case["model_type"], case["kv_heads"], case["dtype"])
    batch = worker.packed_rows(case["layout"])
    logits, losses, targets = [], 0.0, 0
    for row, lengths in enumerate(case["layout"]):
        start = 0
        for length in (length for length in lengths if length):
            ids = batch["input_ids"][row : row + 1, start : start + length]
            output = model(input_ids=ids)
            logits.append((row, start, length, output.logits.detach()))
            token_losses = torch.nn.functional.cross_entropy(output.logits[0, :-1], ids[0, 1:], reduction="sum")
            losses = losses + token_losses
            targets += length - 1
            start += length
    loss = losses / targets
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits, loss.detach(), grads


def _largest_difference(case, result) -> dict[str, float]:
    logits, loss, grads = _documents_alone(case)
    logit_error = max(
        (result["logits"][row, start : start + length] - alone[0]).abs().max().item()
        for row, start, length, alone in logits
    )
    assert grads.keys() == result["grads"].keys()
    grad_error = max((result["grads"][name] - grad).abs().max().item() for name, grad in grads.items())
    return {"logits": logit_error, "loss": abs(result["loss"] - loss).item(), "grads": grad_error,
            "model_loss": abs(result["model_loss"].double() - loss.double()).item()}


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.get("local")])
def test_sharded_rows_equal_documents_alone(sharded, name):
    case = CASES[name]
    differences = _largest_difference(case, sharded[name])
    # The model's own loss (transformers' `ForCausalLMLoss` with `shift_labels`) is computed in float32.
    assert differences.pop("model_loss") <= TOLERANCE["float32"], differences
    assert max(differences.values()) <= TOLERANCE[case["dtype"]], differences


def test_pieces_without_global_boundaries_fail(sharded):
    """Negative control: the same comparison catches shards that attend only their own piece."""
    differences = _largest_difference(CASES["local-pieces"], sharded["local-pieces"])
    assert differences["logits"] > 1e-3 and differences["grads"] > 1e-6, differences


def test_heads_not_divisible_refused():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(UnsupportedSetupError, match=r"`num_attention_heads` \(4\) must be a multiple of "
                                                    r"`sequence_parallel_size`, got 3.*\[1, 2, 4\]"):
        configure_sequence_parallel(model, 3)


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2"])
def test_hybrid_refused(model_type):
    model = tiny_model(model_type, "sdpa")
    with pytest.raises(UnsupportedSetupError, match="mixers carry a state along the row"):
        configure_sequence_parallel(model, 2)


def test_image_text_rows_refused():
    batch = worker.packed_rows(((3, 3),))
    batch["pixel_values"] = torch.zeros(1, 3, 4, 4)
    with pytest.raises(UnsupportedSetupError, match=r"also holds \['pixel_values'\]"):
        shard_packed_batch(batch, 0, 2)


def test_labels_shifted_over_the_whole_row():
    """Each piece keeps its last target (the next piece's first token), and no target crosses a document."""
    batch = worker.packed_rows(((3, 3),))
    ids = batch["input_ids"][0].tolist()
    pieces = [shard_packed_batch(batch, rank, 2) for rank in range(2)]
    assert [piece["labels"][0].tolist() for piece in pieces] == [[ids[1], ids[2], -100], [ids[4], ids[5], -100]]
    assert [piece["position_ids"][0].tolist() for piece in pieces] == [[0, 1, 2], [0, 1, 2]]
    assert all(int(piece["num_items_in_batch"]) == 4 for piece in pieces)
