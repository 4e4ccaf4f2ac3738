"""One rank of the sequence-parallel parity tests (`test_sequence_parallel.py`), started by
`torch.multiprocessing.spawn` on gloo CPU ranks: runs every case on its piece of each row and, on rank 0, saves the
whole rows' logits, the loss and every parameter's gradient for the test to compare with each document run alone."""

import contextlib
import datetime
import functools

import torch
import torch.distributed as dist
from tiny_models import VOCAB_SIZE, tiny_config, tiny_model

from llm_packing import DataCollatorWithPacking, configure_packing, unconfigure_packing
from llm_packing.hook.masks import document_position_ids
from llm_packing.parallel import configure_sequence_parallel, shard_packed_batch, sum_gradients


DTYPES = {"float32": torch.float32, "float64": torch.float64}


@functools.cache
def _model(model_type: str, kv_heads: int | None, dtype: str):
    overrides = _no_dropout(model_type)
    if kv_heads is not None:
        overrides["num_key_value_heads"] = kv_heads
    model = tiny_model(model_type, "sdpa", **overrides).to(DTYPES[dtype]).train()
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    return model


def _no_dropout(model_type: str) -> dict:
    """Every dropout probability and router jitter of the tiny config (gpt2, opt, seed_oss set dropout 0.1; phimoe
    jitters its router in training), at 0: the ranks' random draws could not equal one process's."""
    config = tiny_config(model_type)
    return {name: 0.0 for name, value in config.to_dict().items()
            if isinstance(value, float) and any(word in name for word in ("dropout", "pdrop", "jitter"))}


def build_model(model_type: str, kv_heads: int | None, dtype: str):
    """The tiny model of a case in training mode (no dropout), without gradients; built once per process (the layouts
    of a model share it). `kv_heads`: the key/value heads, or None for the tiny config's."""
    model = _model(model_type, kv_heads, dtype)
    model.zero_grad(set_to_none=True)
    return model


def packed_rows(layout, seed: int = 0):
    """`DataCollatorWithPacking`'s batch of packed rows, one per tuple of document lengths in `layout`."""
    generator = torch.Generator().manual_seed(seed)
    features = [
        {"input_ids": torch.randint(3, VOCAB_SIZE, (sum(lengths),), generator=generator).tolist(),
         "seq_lengths": list(lengths)}
        for lengths in layout
    ]
    return DataCollatorWithPacking(check_model_configured=False)(features)


def run(rank: int, world: int, port: int, cases: list[dict], path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for case in cases:
            model = build_model(case["model_type"], case["kv_heads"], case["dtype"])
            batch = packed_rows(case["layout"])
            piece = (local_piece if case.get("local") else shard_packed_batch)(batch, rank, world)
            if case.get("local"):
                configure_packing(model)
            else:
                configure_sequence_parallel(model, world)
            try:
                output = model(**piece)
            finally:
                unconfigure_packing()
            loss = output.loss
            if case["dtype"] == "float64":
                # transformers' causal LM loss computes in float32 (`logits.float()`): in float64 the same sum of
                # token losses over the batch's targets, in float64 (of float32 logits too: dory and beam's).
                loss = torch.nn.functional.cross_entropy(
                    output.logits.double().flatten(0, 1), piece["shift_labels"].flatten(), reduction="sum"
                ) / piece["num_items_in_batch"]
            loss.backward()
            group = dist.group.WORLD
            sum_gradients(model, group)
            logits = [torch.empty_like(output.logits) for _ in range(world)]
            dist.all_gather(logits, output.logits.detach().contiguous())
            loss, model_loss = loss.detach().clone(), output.loss.detach().clone()
            dist.all_reduce(loss)
            dist.all_reduce(model_loss)
            results[case["name"]] = {
                "logits": torch.cat(logits, dim=1)[:, : batch["input_ids"].shape[1]],
                "loss": loss,
                "model_loss": model_loss,
                "grads": {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
            }
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, path)


def local_piece(batch, rank: int, world: int) -> dict:
    """The negative control: each rank's piece attended alone, its documents renumbered from 1 and positions
    restarting in the piece (as a shard knowing no global boundaries would), the loss still over global targets."""
    piece = shard_packed_batch(batch, rank, world)
    width = piece["input_ids"].shape[1]
    ids = piece.pop("attention_mask")[:, rank * width : (rank + 1) * width]
    first = ids[:, :1].clamp(min=1)
    local = torch.where(ids > 0, ids - first + 1, 0)
    piece["attention_mask"] = local
    piece["position_ids"] = document_position_ids(local)
    return piece


# One SGD step of PackedSFTTrainer (learning rate 1, no clipping), so that each parameter's change is its gradient.
TRAINER_DOCUMENT_LENGTHS = (5, 1, 7, 3, 9, 2, 1, 6, 8, 4, 11, 2, 3)
TRAINER_ROW_LENGTH = 18


def packed_dataset(document_lengths=TRAINER_DOCUMENT_LENGTHS):
    from datasets import Dataset

    from llm_packing import pack_dataset

    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()
                 for length in document_lengths]
    return pack_dataset(Dataset.from_dict({"input_ids": documents}), TRAINER_ROW_LENGTH)


def train_one_step(rank: int, world: int, port: int, sequence_parallel_size: int, path: str,
                   checkpointing: bool = False, bf16: bool = False, document_lengths=TRAINER_DOCUMENT_LENGTHS,
                   **overrides) -> None:
    """One SGD step of `PackedSFTTrainer` (or what `overrides` of its SFTConfig make it train) on the documents of
    `document_lengths`, packed; rank 0 saves the parameters, the logged token counts and whether the trainer's
    isolation check ran under autocast."""
    import os
    import tempfile

    from accelerate.state import AcceleratorState, PartialState
    from trl import SFTConfig

    from llm_packing import PackedSFTTrainer
    from llm_packing.demo.chitchat import load_demo_tokenizer

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The forked rank inherits the parent's accelerate state (one process): start from none.
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    model = tiny_model("llama", "sdpa").train()
    from llm_packing.trainers import sequence_parallel as trainer_sequence_parallel

    check, under_autocast = trainer_sequence_parallel.verify_sequence_parallel, []

    def recording_check(model, group, **options):  # whether the trainer's check runs under autocast
        with options.get("autocast", contextlib.nullcontext)():
            under_autocast.append(torch.is_autocast_enabled("cpu"))
        return check(model, group, **options)

    trainer_sequence_parallel.verify_sequence_parallel = recording_check
    args = SFTConfig(**{
        "output_dir": tempfile.mkdtemp(), "max_steps": 1, "per_device_train_batch_size": 2, "learning_rate": 1.0,
        "optim": "sgd", "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "train_sampling_strategy": "sequential",
        "use_cpu": True, "bf16": bf16, "activation_checkpointing": checkpointing, "report_to": "none",
        "save_strategy": "no", "logging_strategy": "steps", "logging_steps": 1,
        "include_num_input_tokens_seen": "non_padding", "max_length": TRAINER_ROW_LENGTH,
        "ddp_find_unused_parameters": False, "disable_tqdm": True, **overrides,
    })
    try:
        trainer = PackedSFTTrainer(
            model=model, args=args, train_dataset=packed_dataset(document_lengths),
            processing_class=load_demo_tokenizer(),
            data_collator=DataCollatorWithPacking(pad_token_id=0, max_length=TRAINER_ROW_LENGTH),
            sequence_parallel_size=sequence_parallel_size,
        )
        trainer.train()
        if rank == 0:
            logged = [entry for entry in trainer.state.log_history if "loss" in entry]
            torch.save({"parameters": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
                        "counts": [(entry["num_tokens"], entry["num_input_tokens_seen"]) for entry in logged],
                        "check under autocast": under_autocast}, path)
    finally:
        trainer_sequence_parallel.verify_sequence_parallel = check
        unconfigure_packing()
        if dist.is_initialized():
            dist.destroy_process_group()


def _leaking_attention(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
    """The varlen route's signature, attending each whole row causally: every document sees those before it."""
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2)


def verify_checks(rank: int, world: int, port: int, path: str, model_name: str) -> None:
    """`verify_sequence_parallel` on `model_name` ("tiny": tiny Llama; "smollm2": the bundled SmolLM2-135M) in float32
    and under bfloat16 autocast, each also with attention leaking across documents, then cast to bfloat16. Rank 0
    saves per check the difference returned or the error raised, and how often autocast was entered."""
    from unittest import mock

    from llm_packing.errors import ContaminationError
    from llm_packing.hook.attention import varlen
    from llm_packing.parallel import verify_sequence_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    entered = []

    def bf16_autocast():
        entered.append(True)
        return torch.autocast("cpu", dtype=torch.bfloat16)

    if model_name == "smollm2":
        from llm_packing.demo.pretrained import load_bundled_model

        model = load_bundled_model(dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = tiny_model("llama", "sdpa")
    # (name, autocast, leaking); the last check runs the model cast to bfloat16.
    checks = (("float32", None, False), ("bf16 autocast", bf16_autocast, False), ("float32 leaking", None, True),
              ("bf16 autocast leaking", bf16_autocast, True), ("bfloat16", None, False))
    results = {}
    try:
        configure_sequence_parallel(model, world)
        for name, autocast, leaking in checks:
            if name == "bfloat16":
                model.to(torch.bfloat16)
            options = {} if autocast is None else {"autocast": autocast}
            leak = mock.patch.object(varlen, "packed_sdpa_attention", _leaking_attention)
            with leak if leaking else contextlib.nullcontext():
                try:
                    results[name] = verify_sequence_parallel(model, dist.group.WORLD, **options)
                except ContaminationError as error:
                    results[name] = str(error)
        results["autocast entered"] = len(entered)
    finally:
        unconfigure_packing()
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, path)



def mistakes(rank: int, world: int, port: int, path: str) -> None:
    """Sequence parallelism's plain API misused on 2 ranks; rank 0 saves per mistake the error raised (type, message)
    or None where nothing was raised."""
    from llm_packing.errors import PackingError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    model = tiny_model("llama", "sdpa", num_key_value_heads=2)
    straddling = ((5, 1, 7, 3), (9, 2, 1, 6))
    batches = {
        "same batch": (packed_rows(straddling), rank),
        "another batch, same layout": (packed_rows(straddling, seed=rank), rank),
        "another row length": (packed_rows(straddling if rank == 0 else ((5, 1, 7, 3, 2), (9, 2, 1, 6))), rank),
        "rank 0 on every rank": (packed_rows(straddling), 0),
    }
    results = {}
    try:
        configure_sequence_parallel(model, world)
        for name, (batch, claimed_rank) in batches.items():
            try:
                piece = shard_packed_batch(batch, claimed_rank, world)
                model(**piece)
                results[name] = None
            except PackingError as error:
                results[name] = (type(error).__name__, str(error))
        # A DataLoader worker (forked) cuts the batch: in no group, it checks nothing (it waited forever).
        loader = torch.utils.data.DataLoader([packed_rows(straddling)], batch_size=None, num_workers=1,
                                             collate_fn=lambda batch: shard_packed_batch(batch, rank, world))
        results["cut in a DataLoader worker"] = tuple(next(iter(loader))["input_ids"].shape)
        unconfigure_packing()
        only_rank_0 = dist.new_group([0])  # collective: every rank creates it
        try:
            configure_sequence_parallel(model, 1 if rank == 0 else world, group=only_rank_0)
            results["a group without this rank"] = None
        except PackingError as error:
            results["a group without this rank"] = (type(error).__name__, str(error))
    finally:
        unconfigure_packing()
        dist.destroy_process_group()
    if rank == 1:
        torch.save(results, path)
