"""Sequence parallelism (Ulysses) on packed rows, proven on gloo CPU ranks: each packed row is cut across 2 or 4
processes, and the per-document logits, the loss and every parameter's gradient must equal one process running each
document alone (float32 within 1e-5, float64 within 1e-12). Every case of a group size runs in one spawn of its ranks
(`sequence_parallel_worker.py`, forked): starting the processes costs a second or two, the cases milliseconds.

Layouts: documents straddling piece boundaries, odd lengths and odd row lengths (padded to a multiple of the group),
one-token documents, trailing padding, a document filling its row. Models: tiny Llama (2 KV heads, and 1: fewer KV
heads than ranks), Qwen3, and Qwen2 with a 4-token sliding window on one layer; then every other type of
`SEQUENCE_PARALLEL_MODEL_TYPES` (MoE, sliding windows, chunked attention, MLA, learned positions, ...) on the fixed
layouts in float64, within `BROAD_TOLERANCE`. The negative control attends each rank's piece alone (no global
boundaries) and must fail the same comparison.
"""

import functools
import itertools
import os
import re
import socket
import subprocess

import pytest
import sequence_parallel_worker as worker
import torch
import torch.multiprocessing as mp
from random_layouts import draw_layout
from test_rotary import length_dependent_rope
from tiny_models import tiny_model
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from llm_packing import UnsupportedSetupError, configure_packing, unconfigure_packing
from llm_packing.hook.support.sequence_parallel import SEQUENCE_PARALLEL_IN_DEPTH, SEQUENCE_PARALLEL_MODEL_TYPES
from llm_packing.parallel import configure_sequence_parallel, shard_packed_batch


# Row 0: documents of 5, 1, 7, 3 and 2 pads (the collator pads it to row 1's 18; the 7 straddles the middle), row 1:
# 9, 2, 1, 6. Then one odd row of 17 (padded by the shard), and a row of one 13-token document.
LAYOUTS = {"straddling": ((5, 1, 7, 3), (9, 2, 1, 6)), "odd": ((7, 1, 9),), "one_document": ((13,),)}
MODELS = {"llama": ("llama", 2), "llama_kv1": ("llama", 1), "qwen3": ("qwen3", 2), "qwen2_sliding": ("qwen2", 2)}
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
# The types beyond SEQUENCE_PARALLEL_IN_DEPTH, in float64: 58 of 89 are within 1e-12, but some compute a norm, the
# rotary angles or the logits in float32 inside a float64 model (gemma, cohere, llama4_text, ...), which leaves
# float32 rounding (1.2e-7 at worst, gemma4_unified_text). The negative control fails by more than 1e-3.
BROAD_TOLERANCE = 1e-6


def _cases():
    cases = [
        {"name": f"{model}-{dtype}-{layout}", "model_type": MODELS[model][0], "kv_heads": MODELS[model][1],
         "dtype": dtype, "layout": LAYOUTS[layout]}
        for model, dtype, layout in itertools.product(MODELS, TOLERANCE, LAYOUTS)
    ]
    # Drawn layouts (tests/random_layouts.py, reproduced by `draw_layout(seed)`): long, filled, tiny and one-token
    # rows, and (seed 2) rows of one document each.
    cases += [
        {"name": f"{model}-float64-draw_layout({seed})", "model_type": MODELS[model][0], "kv_heads": MODELS[model][1],
         "dtype": "float64", "layout": draw_layout(seed).rows}
        for model, seed in itertools.product(("llama_kv1", "qwen2_sliding"), range(3))
    ]
    # Every other proven type: the fixed layouts in float64, within BROAD_TOLERANCE.
    cases += [
        {"name": f"{model_type}-float64-{layout}", "model_type": model_type, "kv_heads": None, "dtype": "float64",
         "layout": LAYOUTS[layout], "tolerance": BROAD_TOLERANCE}
        for model_type in SEQUENCE_PARALLEL_MODEL_TYPES if model_type not in SEQUENCE_PARALLEL_IN_DEPTH
        if model_type in CONFIG_MAPPING_NAMES  # the installed transformers has it
        for layout in ("straddling", "odd")
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
            token_losses = torch.nn.functional.cross_entropy(output.logits[0, :-1].double(), ids[0, 1:],
                                                           reduction="sum")
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
    assert max(differences.values()) <= case.get("tolerance", TOLERANCE[case["dtype"]]), differences


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


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic"])
def test_length_dependent_rope_refused(rope_type):
    """A rank's piece of a document does not show the document's length, from which these rope types take their
    frequencies (`hook.rotary`)."""
    model = tiny_model("llama", "sdpa", **length_dependent_rope("llama", rope_type))
    with pytest.raises(UnsupportedSetupError, match=rf"rope type \['{rope_type}'\]: the rotary frequencies follow"):
        configure_sequence_parallel(model, 2)


def test_moe_load_balancing_loss_refused():
    """The load-balancing loss is a statistic over every token of the batch; a rank routes only its piece of each row
    (transformers failed on the shapes: 18 router rows against a mask of 36)."""
    model = tiny_model("qwen2_moe", "sdpa", output_router_logits=True)
    with pytest.raises(UnsupportedSetupError, match=r"sets `output_router_logits=True`.*output_router_logits = False"):
        configure_sequence_parallel(model, 2)
    # Asked for in a forward's arguments instead: the loss refuses a piece's router logits against the whole row.
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    model.config.output_router_logits = False
    configure_packing(model)
    try:
        mask = worker.packed_rows(((5, 1, 7, 3), (9, 2, 1, 6)))["attention_mask"]
        piece_router_logits = (torch.randn(mask.numel() // 2, model.config.num_experts),)
        with pytest.raises(UnsupportedSetupError, match="router logits for 18 tokens and a packed mask of 36"):
            modeling_qwen2_moe.load_balancing_loss_func(piece_router_logits, model.config.num_experts, 2, mask)
    finally:
        unconfigure_packing()


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


def _verify_checks(tmp_path, world: int, model_name: str) -> dict:
    path = tmp_path / "verify.pt"
    mp.start_processes(worker.verify_checks, args=(world, _free_port(), str(path), model_name), nprocs=world,
                       join=True, start_method="fork")
    return torch.load(path)


def _assert_verify_checks(results: dict) -> None:
    """Each check passes without a leak, in float32, under bfloat16 autocast (entered once per check) and in
    bfloat16, and raises with one, naming the limit it was held to."""
    for name in ("float32", "bf16 autocast", "bfloat16"):
        assert isinstance(results[name], float), f"{name}: {results[name]}"
    assert results["autocast entered"] == 2
    for name, dtype in (("float32 leaking", "float32"), ("bf16 autocast leaking", "bfloat16")):
        assert isinstance(results[name], str), f"{name}: a leak passed the check ({results[name]})"
        assert "x the noise floor" in results[name] and f"of {dtype})" in results[name], results[name]


def test_verify_sequence_parallel_passes_exact_rows_and_catches_a_leak(tmp_path):
    """`verify_sequence_parallel` (what `PackedSFTTrainer` runs first) on tiny Llama over 2 ranks."""
    _assert_verify_checks(_verify_checks(tmp_path, 2, "tiny"))


def test_ranks_holding_other_batches_or_pieces_are_refused(tmp_path):
    """The plain API: ranks of a group given different batches (same shape, or another row length, where the
    all-to-all would abort the process), or all asking for piece 0, trained on the wrong tokens without an error;
    `shard_packed_batch` now checks the group (one small all-gather). The same batch with each rank's piece passes."""
    path = tmp_path / "mistakes.pt"
    mp.start_processes(worker.mistakes, args=(2, _free_port(), str(path)), nprocs=2, join=True, start_method="fork")
    results = torch.load(path)
    assert results["same batch"] is None
    assert results["cut in a DataLoader worker"] == (2, 9)
    for name in ("another batch, same layout", "another row length"):
        assert results[name][0] == "ContaminationError" and "hold different batches" in results[name][1], name
    assert results["rank 0 on every rank"][0] == "PackingValueError"
    assert "`shard_packed_batch(..., rank=0, world_size=2)` was called on rank 1" in results["rank 0 on every rank"][1]
    assert results["a group without this rank"][0] == "UnsupportedSetupError"
    assert "is not a rank of `group`" in results["a group without this rank"][1]


@pytest.mark.slow
def test_verify_sequence_parallel_on_a_real_model(tmp_path):
    """On SmolLM2-135M over 3 ranks (9 heads), whose rounding noise the fixed limits it had (1e-4 in float32, 1e-2 in
    half precision) refused as contamination: it differed by 2.6e-4 in float32 and 1.0 in bfloat16, exactly as a
    document followed by other tokens differs from itself alone."""
    _assert_verify_checks(_verify_checks(tmp_path, 3, "smollm2"))


@pytest.mark.parametrize(("world", "sequence_parallel_size", "checkpointing", "bf16"),
                         [(2, 2, False, False), (4, 2, False, False), (2, 2, True, False), (2, 2, False, True)],
                         ids=["2ranks", "2x2ranks", "2ranks-activation_checkpointing", "2ranks-bf16"])
def test_trainer_step_equals_documents_alone(tmp_path, world, sequence_parallel_size, checkpointing, bf16):
    """PackedSFTTrainer with `sequence_parallel_size` under DDP (one group, and two groups data-parallel; with
    SFTConfig's default activation checkpointing, whose recompute repeats the all-to-alls in the backward): one SGD
    step of learning rate 1 moves each parameter by the gradient of the mean token loss over the rows the groups
    read (rows 0-1, and 0-3), each document alone. TRL's `num_tokens` and transformers' `num_input_tokens_seen` count
    those rows' tokens once (every rank of a group holds the whole batch: they were counted once per rank). With
    `bf16=True` the trainer's isolation check runs under the training's autocast, and the step's gradients are the
    float32 ones to bfloat16's precision."""
    path = tmp_path / "parameters.pt"
    mp.start_processes(worker.train_one_step,
                       args=(world, _free_port(), sequence_parallel_size, str(path), checkpointing, bf16),
                       nprocs=world, join=True, start_method="fork")
    saved = torch.load(path)
    assert saved["check under autocast"] == [bf16]
    trained = saved["parameters"]
    rows = worker.packed_dataset().select(range(2 * world // sequence_parallel_size))
    tokens = sum(sum(row["seq_lengths"]) for row in rows)
    assert saved["counts"] == [(tokens, tokens)], (saved["counts"], tokens)
    model = tiny_model("llama", "sdpa").train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses, targets = 0.0, 0
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            ids = torch.tensor(row["input_ids"][start : start + length])[None]
            logits = model(input_ids=ids).logits
            losses = losses + torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            targets += length - 1
            start += length
    (losses / targets).backward()
    difference = max((trained[name] - (before[name] - p.grad)).abs().max().item()
                     for name, p in model.named_parameters())
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    assert difference <= (5e-2 * largest if bf16 else 1e-5), difference


@pytest.mark.parametrize(("documents", "batch_size", "drop_last"), [
    ("packed", 3, False), ("packed", 3, True), ("one a row", 1, False)])
def test_an_epoch_logs_the_tokens_of_the_rows_it_trains(tmp_path, documents, batch_size, drop_last):
    """One epoch on a group of 2 ranks: 4 packed rows in batches of 3, the last completed with the epoch's first
    rows, or with `dataloader_drop_last=True` dropped, as the trainer's warning says (it was completed anyway); and 3
    rows of one document filling each. TRL's `num_tokens` counts the tokens of the rows trained, as
    `num_input_tokens_seen` does (it counted the shard's padding, and halved the epoch's last batch)."""
    path = tmp_path / "epoch.pt"
    lengths = worker.TRAINER_DOCUMENT_LENGTHS if documents == "packed" else (worker.TRAINER_ROW_LENGTH,) * 3
    train = functools.partial(worker.train_one_step, document_lengths=lengths, max_steps=-1, num_train_epochs=1,
                              per_device_train_batch_size=batch_size, dataloader_drop_last=drop_last)
    mp.start_processes(train, args=(2, _free_port(), 2, str(path)), nprocs=2, join=True, start_method="fork")
    rows = [sum(row["seq_lengths"]) for row in worker.packed_dataset(lengths)]
    indices = list(range(len(rows)))
    indices += [] if drop_last else indices[: -len(rows) % batch_size]
    batches = [indices[first : first + batch_size] for first in range(0, len(indices) // batch_size * batch_size,
                                                                         batch_size)]
    tokens = list(itertools.accumulate(sum(rows[index] for index in batch) for batch in batches))
    assert torch.load(path)["counts"] == [(total, total) for total in tokens]


@pytest.mark.slow
def test_recipe_trains_under_accelerate_launch(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = ["accelerate", "launch", "--config_file", os.path.join(root, "recipes", "accelerate", "cpu-ddp.yaml"),
               "-m", "llm_packing.train", "--config", os.path.join(root, "recipes", "tiny-cpu-sp2.yaml"),
               "--max_samples", "8", "--max_steps", "4", "--logging_steps", "1", "--output_dir", str(tmp_path / "out")]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert len(re.findall(r"\[rank 0/2\] isolation verified across 2 ranks", output)) == 1, output[-4000:]
    losses = [float(loss) for loss in re.findall(r"'loss': '([\d.]+)'", output)]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert "on [4, 4] batches (per rank)" in output


def test_other_trainers_refuse_sequence_parallelism(tmp_path):
    from llm_packing.cli.train import main

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny-cpu-dpo.yaml")
    with pytest.raises(UnsupportedSetupError, match="`sequence_parallel_size: 2` is supported by text SFT"):
        main(["--config", recipe, "--sequence_parallel_size", "2", "--output_dir", str(tmp_path)])


@pytest.mark.slow
def test_plain_loop_example_runs(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["python", os.path.join(root, "examples", "sequence_parallel_loop.py"), "--steps", "3"],
                            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "isolation verified across 2 processes" in output
    losses = [float(loss) for loss in re.findall(r"step \d+: loss ([\d.]+)", output)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
