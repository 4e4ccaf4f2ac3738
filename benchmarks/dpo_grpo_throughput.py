"""DPO- and GRPO-style log-prob steps: TRL's padded forward against the packed forward, on demo-conversation lengths.

    python benchmarks/dpo_grpo_throughput.py                       # small Llama, CPU, float32
    python benchmarks/dpo_grpo_throughput.py --model tiny --steps 2 --repeats 1
    python benchmarks/dpo_grpo_throughput.py --device cuda --dtype bf16 --model 0.5b --pairs 16   # GPU (untested here)

Both paths run TRL's own fused LM head (`trl.trainer.utils.add_fused_lm_head`, what `DPOTrainer` and `GRPOTrainer`
install): "padded" calls it on TRL's padded batch, "packed" through
`llm_packing.batches.padded_forward.pack_fused_lm_head` with `configure_packing` (the real tokens of each batch in one
row, as `PackedDPOTrainer` and `PackedGRPOTrainer` do).
- DPO step: `--pairs` preference pairs of `load_chitchat_preference_pairs` (demo tokenizer, chat template), collated
  by TRL's `DataCollatorForPreference` (chosen rows then rejected rows, right padding): policy forward + backward and
  reference forward (no grad), the sigmoid loss on the summed completion log-probs, as `DPOTrainer` computes them.
- GRPO step: `--pairs` prompts x 4 completions (the real replies of the demo pairs, cut at 128 tokens as
  `max_completion_length` would), prompts padded on the left and completions on the right as `GRPOTrainer` builds
  them: policy forward + backward of the completion log-probs.
tokens/s counts real (non-pad) tokens over step wall time; packed and padded steps alternate, repeat by repeat, so
both see the same machine load, and the ratio is taken per repeat (the median is reported). Peak memory is measured
in a separate subprocess per (step, path): growth of the peak RSS (reset before the steps) over the RSS with the
models and batches loaded on CPU, peak allocated on CUDA.
"""

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# name -> Llama config fields; vocab is the demo tokenizer's 32,000 (the LM head is a real share of the step).
MODELS = {
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1},
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "tie_word_embeddings": True},
}
GENERATIONS = 4
MAX_COMPLETION = 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--pairs", type=int, default=8, help="pairs per DPO step; prompts per GRPO step (x4)")
    parser.add_argument("--max-length", type=int, default=1024, help="DPO: longest pair kept")
    parser.add_argument("--steps", type=int, default=3, help="steps per path per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(RESULTS, "dpo_grpo_throughput"))
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: "step:path", one memory measurement
    return parser.parse_args(argv)


def build(args):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = LlamaConfig(vocab_size=32_000, max_position_embeddings=4096, **MODELS[args.model])
    policy = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(args.device)
    policy.config.use_cache = False
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(reference)
    return policy, reference


def batches(args):
    """Per step: the DPO batch (TRL's collator) and the GRPO batch (left-padded prompts, right-padded completions)."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from llm_packing.demo.chitchat import load_chitchat_preference_pairs, load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    examples = []
    for pair in load_chitchat_preference_pairs(max_pairs=400):
        prompt = tokenizer.apply_chat_template(pair["prompt"], tokenize=True, return_dict=True)["input_ids"]
        full = {key: tokenizer.apply_chat_template(pair["prompt"] + pair[key], tokenize=True,
                                                   return_dict=True)["input_ids"] for key in ("chosen", "rejected")}
        if max(len(ids) for ids in full.values()) <= args.max_length:
            examples.append({"prompt_ids": prompt, "chosen_ids": full["chosen"][len(prompt):],
                             "rejected_ids": full["rejected"][len(prompt):]})
    rng = np.random.default_rng(0)
    collator = DataCollatorForPreference(pad_token_id=0)
    dpo, grpo = [], []
    for _ in range(args.steps):
        chosen = [examples[i] for i in rng.choice(len(examples), args.pairs, replace=False)]
        dpo.append({key: value.to(args.device) for key, value in collator(chosen).items()})
        prompts = [example["prompt_ids"] for example in chosen for _ in range(GENERATIONS)]
        pool = [examples[i]["chosen_ids"][:MAX_COMPLETION] for i in rng.choice(len(examples), len(prompts))]
        width_p, width_c = max(map(len, prompts)), max(map(len, pool))
        input_ids = torch.zeros(len(prompts), width_p + width_c, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, (prompt, completion) in enumerate(zip(prompts, pool, strict=True)):
            input_ids[row, width_p - len(prompt):width_p] = torch.tensor(prompt)
            input_ids[row, width_p:width_p + len(completion)] = torch.tensor(completion)
            mask[row, width_p - len(prompt):width_p + len(completion)] = 1
        grpo.append({"input_ids": input_ids.to(args.device), "attention_mask": mask.to(args.device),
                     "logits_to_keep": width_c})
    return dpo, grpo


def dpo_step(policy, reference, batch):
    import torch
    import torch.nn.functional as F

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    logps = policy(**inputs, labels=labels, fused_lm_head=True).log_probs.sum(dim=1)
    with torch.no_grad():
        ref_logps = reference(**inputs, labels=labels, fused_lm_head=True).log_probs.sum(dim=1)
    chosen, rejected = (logps - ref_logps).chunk(2)
    loss = -F.logsigmoid(0.1 * (chosen - rejected)).mean()
    loss.backward()


def grpo_step(policy, reference, batch):
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, :-batch["logits_to_keep"]] = -100
    outputs = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                     fused_lm_head=True, use_cache=False)
    per_token = outputs.log_probs[:, -batch["logits_to_keep"]:]
    mask = labels[:, -batch["logits_to_keep"]:] != -100
    (-(per_token * mask).sum() / mask.sum()).backward()


STEPS = {"dpo": dpo_step, "grpo": grpo_step}


def set_packed(policy, reference, packed: bool, max_length: dict):
    from llm_packing.batches.padded_forward import pack_fused_lm_head
    from llm_packing.hook.configure import configure_packing, unconfigure_packing

    if not packed:
        unconfigure_packing()
        return
    configure_packing(policy)
    for model in (policy, reference):
        pack_fused_lm_head(model, max_length=max_length)


def synchronize(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(args, policy, reference, step, batches) -> float:
    synchronize(args.device)
    start = time.perf_counter()
    for batch in batches:
        STEPS[step](policy, reference, batch)
        policy.zero_grad(set_to_none=True)
    synchronize(args.device)
    return time.perf_counter() - start


def measure_throughput(args) -> dict:
    """Paired timings: per repeat, padded then packed (then the other order next repeat), same batches."""
    policy, reference = build(args)
    dpo, grpo = batches(args)
    results = {}
    for step, step_batches in (("dpo", dpo), ("grpo", grpo)):
        tokens = sum(int(batch["attention_mask"].sum()) for batch in step_batches)
        padded_tokens = sum(batch["attention_mask"].numel() for batch in step_batches)
        # Each path is installed per run: the packed wrapper replaces `forward`, so the padded run uses fresh models.
        models = {"padded": (policy, reference), "packed": (copy.deepcopy(policy), copy.deepcopy(reference))}
        from trl.trainer.utils import add_fused_lm_head

        for model, outputs in zip(models["packed"], (("log_probs", "entropy", "mean_logits", "is_top1"),
                                                     ("log_probs",)), strict=True):
            model.__dict__.pop("forward", None)
            add_fused_lm_head(model, outputs=outputs)
        set_packed(*models["packed"], packed=True, max_length=None)
        for path in ("padded", "packed"):
            timed(args, *models[path], step, step_batches[:1])  # warm-up
        times = {"padded": [], "packed": []}
        for repeat in range(args.repeats):
            for path in (("padded", "packed") if repeat % 2 == 0 else ("packed", "padded")):
                times[path].append(timed(args, *models[path], step, step_batches))
        set_packed(policy, reference, packed=False, max_length=None)
        ratios = [padded / packed for padded, packed in zip(times["padded"], times["packed"], strict=True)]
        results[step] = {"tokens": tokens, "padded_tokens": padded_tokens, "times": times,
                         "ratio": float(np.median(ratios)), "ratios": ratios}
    return results


def measure_memory(args) -> dict:
    """One (step, path) in this process: peak memory growth over the loaded model and batches."""
    import torch

    step, path = args.memory_of.split(":")
    policy, reference = build(args)
    dpo, grpo = batches(args)
    set_packed(policy, reference, packed=path == "packed", max_length=None)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        # Loading the tokenizer and pairs peaked higher than a step may: reset the kernel's peak RSS (VmHWM) first.
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        baseline = _status_bytes("VmRSS")
    timed(args, policy, reference, step, dpo if step == "dpo" else grpo)
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else _status_bytes("VmHWM")
    return {"peak_growth_bytes": peak - baseline}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as file:
        line = next(line for line in file if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def report(args, results, memory) -> str:
    lines = [
        f"# DPO / GRPO log-prob steps: TRL's padded forward vs the packed forward ({args.device}, {args.dtype})", "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs; model `{args.model}` (Llama, vocab 32,000, sdpa); {args.pairs} pairs per DPO step, "
        f"{args.pairs} prompts x {GENERATIONS} completions per GRPO step; "
        f"{args.steps} steps x {args.repeats} repeats.",
        "Command: `python benchmarks/dpo_grpo_throughput.py " + " ".join(sys.argv[1:]) + "`", "",
        "| step | path | real tokens | padded batch tokens | real tokens/s (median repeat) | paired speed-up "
        "(median, min-max) | peak memory growth |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, result in results.items():
        for path in ("padded", "packed"):
            rate = result["tokens"] / float(np.median(result["times"][path]))
            speedup = (f"{result['ratio']:.2f}x ({min(result['ratios']):.2f}-{max(result['ratios']):.2f})"
                       if path == "packed" else "1.00x")
            mem = memory.get(f"{step}:{path}")
            mem_text = f"{mem / 2**20:.0f} MiB" if mem is not None else "n/a"
            lines.append(f"| {step} | {path} | {result['tokens']} | {result['padded_tokens']} | {rate:,.0f} | "
                         f"{speedup} | {mem_text} |")
    lines += ["", "Target (issue 16): packed DPO step >= 1.5x TRL's padded DPO step: "
              + ("met" if results["dpo"]["ratio"] >= 1.5 else "NOT met")
              + f" ({results['dpo']['ratio']:.2f}x).", ""]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    if args.memory_of:
        print(json.dumps(measure_memory(args)))
        return
    results = measure_throughput(args)
    memory = {}
    for key in (f"{step}:{path}" for step in ("dpo", "grpo") for path in ("padded", "packed")):
        child = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                "--memory-of", key], capture_output=True, text=True, check=True)
        memory[key] = json.loads(child.stdout.strip().splitlines()[-1])["peak_growth_bytes"]
    text = report(args, results, memory)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output + ".md", "w", encoding="utf-8") as file:
        file.write(text)
    print(text)


if __name__ == "__main__":
    main()
