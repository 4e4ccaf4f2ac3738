"""One sharded training step on CPU ranks, and the single-process steps it must equal (`tests/test_fsdp.py`,
`tests/test_zero3.py`).

Each rank of a gloo group builds the same tiny model, shards it (torch's FSDP2: `fully_shard` on every decoder layer,
then the root; or DeepSpeed ZeRO-3 on its CPU accelerator), trains its half of the packed rows for one step and
compares, parameter by parameter, the gradient and the weights after the step with references it computes itself
without any process group:
- `single`: one unsharded process on all rows at once, packed the same way;
- `documents`: every document alone (its own row, positions from 0), no packing at all.

Each rank's loss is summed over the GLOBAL count of trained tokens and multiplied by the number of ranks, as
`transformers.Trainer` does with `average_tokens_across_devices` (its default): the engines' mean over ranks then
gives the gradient of the global loss. Rank 0 writes the largest differences of every case to a JSON file.
"""

import copy
import json
import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
from tiny_models import tiny_model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from llm_packing import DataCollatorWithPacking, configure_packing, unconfigure_packing


WORLD_SIZE = 2
LEARNING_RATE = 0.5
TOLERANCE = 1e-6
# A leak must move some gradient by far more than float32 noise to count as caught.
LEAK = 1e-4
# Packed rows of up to 20 tokens, split two a rank and padded to the longer of the two: 1-3 documents a row,
# one-token documents, documents longer than the 4-token sliding window and SSM chunks, a document filling its row.
ROW_DOCUMENTS = ((7, 1, 9), (20,), (5, 6), (1, 13, 4))
VOCAB = 128
# None; transformers' own (`activation_checkpointing: true` in a recipe); torch's checkpoint wrapper around each
# decoder layer (accelerate's `fsdp_activation_checkpointing: true`).
CHECKPOINTING = ("none", "transformers", "torch")


def cases(engine: str, model_types) -> list[tuple]:
    """`(sharding, model_type, reshard_after_forward, checkpointing, indexed)` of every case of `engine` (`"fsdp2"`
    or `"zero3"`), run in this order: the negative controls (`indexed=False`) last, as they undo the hook.

    FSDP2 is applied two ways: `"fsdp2"`, torch's `fully_shard` called here, resharding after the forward or not;
    `"fsdp2-accelerate"`, accelerate's own preparation as `recipes/accelerate/fsdp.yaml` configures it. ZeRO-3 always
    repartitions after use, and has transformers' checkpointing only (torch's wrapper is FSDP's)."""
    if engine == "fsdp2":
        variants = [("fsdp2", reshard, checkpointing) for reshard in (True, False) for checkpointing in CHECKPOINTING]
        variants += [("fsdp2-accelerate", True, checkpointing) for checkpointing in CHECKPOINTING]
    else:
        variants = [("zero3", True, checkpointing) for checkpointing in CHECKPOINTING[:2]]
    positives = [(sharding, model_type, reshard, checkpointing, True)
                 for model_type in model_types for sharding, reshard, checkpointing in variants]
    return positives + [(variants[0][0], model_type, True, "none", False) for model_type in model_types]


def case_name(case) -> str:
    sharding, model_type, reshard, checkpointing, indexed = case
    parts = [sharding, model_type] + ([f"reshard_{reshard}"] if sharding == "fsdp2" else [])
    return "-".join([*parts, f"checkpointing_{checkpointing}", "indexed" if indexed else "0/1 mask"])


def packed_rows(seed: int = 0) -> list[dict]:
    """`pack_dataset`-style rows: `input_ids` and `seq_lengths`."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, VOCAB, (sum(lengths),), generator=generator).tolist(), "seq_lengths": lengths}
        for lengths in ROW_DOCUMENTS
    ]


def collate(rows, indexed: bool) -> dict:
    """Rows as `DataCollatorWithPacking` collates them; without `indexed`, as a collator that knows nothing of packing
    would: a 0/1 mask and no `position_ids` (the labels keep each document's first token untrained)."""
    batch = DataCollatorWithPacking(pad_token_id=0, check_model_configured=False)(rows)
    if not indexed:
        batch["attention_mask"] = (batch["attention_mask"] > 0).long()
        del batch["position_ids"]
    return batch


def trained_tokens(batch) -> int:
    """Targets the model's shifted loss scores: labels after the first position that are not -100."""
    return int((batch["labels"][:, 1:] != -100).sum())


def run_ranks(engine: str, model_types, folder) -> dict:
    """Largest differences of every case of `engine`, per reference: one spawn of `WORLD_SIZE` gloo ranks on
    127.0.0.1 runs them all."""
    path = os.path.join(folder, f"{engine}.json")
    with socket.socket() as probe:  # a free port; released for the ranks to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(worker, args=(port, engine, model_types, path), nprocs=WORLD_SIZE, start_method="spawn")
    with open(path) as file:
        return json.load(file)


def assert_exact(measured: dict) -> None:
    """The sharded step equals one process on all rows and every document alone, gradients and weights."""
    for reference in ("single", "documents"):
        assert measured[reference]["gradients"] <= TOLERANCE, (reference, measured)
        assert measured[reference]["weights"] <= TOLERANCE, (reference, measured)
    assert measured["documents"]["largest_gradient"] > 1e-2  # the comparison has something to compare


def assert_leak_caught(measured: dict) -> None:
    """The same comparison against every document alone fails, by far more than float32 noise."""
    assert measured["documents"]["gradients"] > LEAK, measured
    assert measured["documents"]["weights"] > LEAK * LEARNING_RATE, measured


def worker(rank: int, port: int, engine: str, model_types, result_path: str) -> None:
    """One rank: every case of `engine` (`"fsdp2"` or `"zero3"`), then rank 0 writes the differences to
    `result_path`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {case_name(case): run_case(rank, *case) for case in cases(engine, model_types)}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w") as file:
            json.dump(results, file)


def run_case(rank, sharding, model_type, reshard, checkpointing, indexed) -> dict:
    """One case on this rank: the two references first (unsharded copies), then the sharded step on its two rows."""
    rows = packed_rows()
    model = tiny_model(model_type).train()  # seeded: the same weights on every rank
    if indexed:
        configure_packing(model)
    else:
        unconfigure_packing()
    single = _reference_step(copy.deepcopy(model), rows, per_document=False)
    documents = _reference_step(copy.deepcopy(model), rows, per_document=True)

    global_tokens = trained_tokens(collate(rows, indexed=True))
    batch = collate(rows[rank * 2 : rank * 2 + 2], indexed)
    if sharding == "zero3":
        gradients, weights = _zero3_step(model, batch, global_tokens, checkpointing)
    else:
        gradients, weights = _fsdp2_step(model, batch, global_tokens, sharding, reshard, checkpointing)
    return {
        reference: {
            "gradients": _max_difference(gradients, expected["gradients"]),
            "weights": _max_difference(weights, expected["weights"]),
            "largest_gradient": max(g.abs().max().item() for g in expected["gradients"].values()),
        }
        for reference, expected in (("single", single), ("documents", documents))
    }


def _fsdp2_step(model, batch, global_tokens, sharding, reshard, checkpointing) -> tuple[dict, dict]:
    """Full gradients and weights after one SGD step of `model` sharded by FSDP2, by hand or by accelerate."""
    if sharding == "fsdp2":
        _shard(model, reshard, checkpointing)
    else:
        model = _shard_as_accelerate(model, checkpointing)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    calls = _count_layer_calls(model)
    loss = model(**batch, num_items_in_batch=global_tokens).loss * WORLD_SIZE
    loss.backward()
    # Sharded for real, and recomputed in the backward where checkpointed: the layers ran twice.
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert sum(p.to_local().numel() for p in model.parameters()) < sum(p.numel() for p in model.parameters())
    assert calls == [1 if checkpointing == "none" else 2] * len(calls), (checkpointing, calls)
    gradients = {_unwrapped(name): p.grad.full_tensor() for name, p in model.named_parameters()}
    optimizer.step()
    weights = {_unwrapped(name): p.full_tensor().detach() for name, p in model.named_parameters()}
    return gradients, weights


def _zero3_step(model, batch, global_tokens, checkpointing) -> tuple[dict, dict]:
    """Full gradients and weights after one SGD step of `model` under DeepSpeed ZeRO-3 on its CPU accelerator."""
    import deepspeed  # only installed where the ZeRO-3 tests run
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce on first use (85 s here, a C++ toolchain):
    # a CPU-only fast path that GPU runs never take. Without it, its collectives are torch.distributed's on gloo.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    if checkpointing == "transformers":
        model.activation_checkpointing_enable()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        # Every parameter partitioned: by default those under 100k elements (all of a tiny model's) stay whole.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,  # plain SGD, so that the step is the reference's
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told; the reference does not clip
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    calls = _count_layer_calls(engine.module)
    loss = engine(**batch, num_items_in_batch=global_tokens).loss * WORLD_SIZE
    engine.backward(loss)
    # Partitioned for real: outside a forward each rank holds only its part of each parameter.
    parameters = list(engine.module.named_parameters())
    assert all(p.numel() == 0 for _, p in parameters)
    assert sum(p.ds_tensor.numel() for _, p in parameters) < sum(p.ds_numel for _, p in parameters)
    assert calls == [1 if checkpointing == "none" else 2] * len(calls), (checkpointing, calls)
    gradients = {name: safe_get_full_grad(p) for name, p in parameters}
    engine.step()
    weights = {name: safe_get_full_fp32_param(p) for name, p in parameters}
    return gradients, weights


def _shard(model, reshard: bool, checkpointing: str) -> None:
    """FSDP2 by hand: each decoder layer, then the root; activation checkpointing either by transformers (the recipes'
    `activation_checkpointing: true`) or by torch's wrapper around each decoder layer."""
    layers = model.model.layers
    if checkpointing == "transformers":
        model.activation_checkpointing_enable()
    elif checkpointing == "torch":
        layer_type = type(layers[0])
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, layer_type))
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)


def _shard_as_accelerate(model, checkpointing: str):
    """FSDP2 by accelerate's own code, as `Accelerator.prepare` runs it for `recipes/accelerate/fsdp.yaml`: decoder
    layers wrapped by `_no_split_modules`, the embedding and the final norm and LM head in units of their own, weights
    loaded from rank 0 (`fsdp_cpu_ram_efficient_loading`), and `fsdp_activation_checkpointing` as its checkpoint
    wrapper ("torch"). accelerate 1.15 turns FSDP settings into FSDP on accelerators only (see docs/trainers.md), so a
    stand-in gives these functions what they read from an `Accelerator`."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        cpu_ram_efficient_loading=True, state_dict_type="FULL_STATE_DICT",
        activation_checkpointing=checkpointing == "torch",
    )
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  device=torch.device("cpu"), is_main_process=dist.get_rank() == 0)
    if checkpointing == "transformers":
        model.activation_checkpointing_enable()
    plugin.set_auto_wrap_policy(model)
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(accelerator, model)
    return fsdp2_prepare_model(accelerator, model)


def _count_layer_calls(model) -> list[int]:
    """A list that counts, per decoder layer, the calls of its feed-forward block (inside any checkpoint wrapper), on
    entry: a non-reentrant recompute stops once it has the tensors it needs, before the block returns."""
    calls = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):
        inner = getattr(layer, _CHECKPOINT_WRAPPED_MODULE, layer)
        inner.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    return calls


def _reference_step(model, rows, per_document: bool) -> dict:
    """Gradients and weights after one SGD step of one process on all rows: packed as `DataCollatorWithPacking`
    collates them, or each document alone in a row of its own."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    batch = collate(rows, indexed=True)
    global_tokens = trained_tokens(batch)
    if per_document:
        for row in rows:
            start = 0
            for length in row["seq_lengths"]:
                alone = collate([{"input_ids": row["input_ids"][start : start + length], "seq_lengths": [length]}],
                                indexed=True)
                model(**alone, num_items_in_batch=global_tokens).loss.backward()
                start += length
    else:
        model(**batch, num_items_in_batch=global_tokens).loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer.step()
    return {"gradients": gradients, "weights": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _unwrapped(name: str) -> str:
    """The parameter's name in the model before torch's checkpoint wrapper went around its layer."""
    return name.replace(f"{_CHECKPOINT_WRAPPED_MODULE}.", "")


def _max_difference(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys(), actual.keys() ^ expected.keys()
    return max((actual[name] - expected[name]).abs().max().item() for name in expected)
