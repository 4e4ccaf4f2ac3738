"""Image-text training throughput: padded batches (TRL's vision collator) against packed rows (llm_packing), on the
conversations and model of `recipes/tiny-cpu-vlm.yaml` (real photos; their length distribution).

    python benchmarks/image_text_throughput.py              # CPU, the recipe's model, 3 rounds
    python benchmarks/image_text_throughput.py --rounds 1 --repeat 1   # smoke run

Both configurations train the same conversations (the recipe's, `--repeat` times) for one epoch each, forward +
backward + AdamW step per batch, on the same token budget per step: packed takes `--rows` rows of `--max-length`
tokens (`pack_dataset(..., processor=...)`, `DataCollatorWithPacking(processor=...)`, the hook configured); padded
takes conversations in a shuffled order until the next would pass the same number of real tokens, collated by TRL's
`DataCollatorForVisionLanguageModeling` as `SFTTrainer` does without packing (padding on the right). Each batch is
collated before its step is timed (collation, image decoding included, is reported apart). tokens/s is the real
(non-pad) tokens of the epoch over the summed step times, wall and process CPU (on a shared machine CPU time is the
steadier). The two run in `--rounds` interleaved rounds, so that a drifting machine slows both alike.
"""

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np
import torch
import yaml


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "tiny-cpu-vlm.yaml")


def build_model(processor, seed: int):
    import types

    from llm_packing.cli.train_image_text import load_image_text_model

    recipe = yaml.safe_load(open(RECIPE, encoding="utf-8"))
    torch.manual_seed(seed)
    return load_image_text_model(
        types.SimpleNamespace(model_config=recipe["model_config"]),
        types.SimpleNamespace(dtype="float32", model_name_or_path=None, model_revision=None,
                              attn_implementation="sdpa"),
        types.SimpleNamespace(trust_remote_code=False, model_init_kwargs=None), processor)


def padded_batches(conversations, lengths: np.ndarray, budget: int, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(len(lengths))
    batches, current, tokens = [], [], 0
    for index in order:
        if current and tokens + lengths[index] > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(int(index))
        tokens += int(lengths[index])
    return batches + [current]


def run_epoch(model, batches, collate) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    wall = cpu = collate_seconds = 0.0
    real = slots = 0
    for examples in batches:
        start = time.perf_counter()
        batch = collate(examples)
        collate_seconds += time.perf_counter() - start
        real += int((batch["attention_mask"] > 0).sum())
        slots += batch["attention_mask"].numel()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wall += time.perf_counter() - start_wall
        cpu += time.process_time() - start_cpu
    return {"steps": len(batches), "real": real, "slots": slots, "wall": wall, "cpu": cpu, "collate": collate_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="the recipe's conversations, this many times")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(RESULTS, "image_text_throughput.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    import datasets
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from llm_packing import DataCollatorWithPacking, configure_packing, pack_dataset, unconfigure_packing
    from llm_packing.data.pack_image_text import plan_conversations
    from llm_packing.demo.photos import load_demo_processor, load_photo_conversations

    processor = load_demo_processor()
    conversations = datasets.concatenate_datasets([load_photo_conversations()] * args.repeat)
    lengths, _ = plan_conversations(conversations, processor)
    packed = pack_dataset(conversations, args.max_length, processor=processor)
    packed_batches = [[packed[i] for i in range(first, min(first + args.rows, len(packed)))]
                      for first in range(0, len(packed), args.rows)]
    trl_collator = DataCollatorForVisionLanguageModeling(processor)
    ours = DataCollatorWithPacking(processor=processor, max_length=args.max_length)
    totals = {"padded (TRL vision collator)": [], "llm_packing rows": []}
    for round_ in range(args.rounds):
        padded = [[conversations[i] for i in batch]
                  for batch in padded_batches(conversations, lengths, args.rows * args.max_length, round_)]
        for name in (list(totals) if round_ % 2 == 0 else list(totals)[::-1]):
            model = build_model(processor, seed=round_)
            if name == "llm_packing rows":
                configure_packing(model)
                try:
                    totals[name].append(run_epoch(model, packed_batches, ours))
                finally:
                    unconfigure_packing()
            else:
                totals[name].append(run_epoch(model, padded, trl_collator))
    lines = table(totals, lengths, args)
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")


def table(totals: dict, lengths: np.ndarray, args) -> list[str]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"# Image-text training throughput ({datetime.date.today()})", "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread, "
        f"float32, sdpa; load average {load:.1f} at the end (a shared machine: CPU time is the steadier "
        "measure).",
        f"Recipe model and conversations (`recipes/tiny-cpu-vlm.yaml`) x {args.repeat}: {len(lengths)} conversations, "
        f"{int(lengths.sum())} tokens with images expanded, {int(lengths.min())}-{int(lengths.max())} per "
        f"conversation (median {int(np.median(lengths))}); budget {args.rows} x {args.max_length} tokens per step; "
        f"{args.rounds} interleaved rounds of one epoch each.", "",
        "| configuration | steps/epoch | real tokens | padding | tokens/s (CPU) | tokens/s (wall) | collate s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    rates = {}
    for name, runs in totals.items():
        real, slots = sum(r["real"] for r in runs), sum(r["slots"] for r in runs)
        cpu, wall = sum(r["cpu"] for r in runs), sum(r["wall"] for r in runs)
        steps = sum(r["steps"] for r in runs)
        rates[name] = real / cpu
        lines.append(f"| {name} | {runs[0]['steps']} | {runs[0]['real']} | {1 - real / slots:.1%} | "
                     f"{real / cpu:,.0f} | {real / wall:,.0f} | {sum(r['collate'] for r in runs) / steps:.3f} |")
    names = list(rates)
    lines += ["", f"Packed / padded tokens per CPU second: {rates[names[1]] / rates[names[0]]:.2f}x."]
    return lines


if __name__ == "__main__":
    main()
