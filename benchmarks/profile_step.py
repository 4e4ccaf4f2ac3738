"""Where a training step's CPU time goes, per real token: configurations of `train_throughput.py` side by side.

    python benchmarks/profile_step.py --dataset conversations --steps 6
    python benchmarks/profile_step.py --model medium --only "llm_packing rows|sdpa" "padded, global length sort|sdpa"

All configurations live in one process and take turns step by step (a machine whose speed drifts slows them alike), on
the same systematic sample of their epoch's batches as `train_throughput.py`. Each measured step runs under
`torch.profiler` (CPU): the table gives each operator's self CPU time per real (non-pad) token, forward and backward
together, and the totals; "thread CPU" is the steps' thread CPU time per real token, the profiler's own cost included.
The profiler times operators by the clock: on a loaded machine its figures include time the process waited for a
core, so compare the columns (interleaved, hence waiting alike) and read absolute figures from "thread CPU".
"""

import argparse
import os
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_throughput  # noqa: E402 -- the benchmark's documents, batches, models and collators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=train_throughput.MODELS, default="small")
    parser.add_argument("--dataset", choices=train_throughput.DATASETS, default="conversations")
    parser.add_argument("--only", nargs="+", metavar="NAME|BACKEND",
                        default=["llm_packing rows|sdpa", "padded, group_by_length|sdpa",
                                 "padded, global length sort|sdpa"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--max-samples", type=int)
    parser.add_argument("--operators", type=int, default=20, help="rows of the table, costliest first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.device, args.round, args.rounds = "cpu", 0, 1

    import datasets
    import torch

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as directory:
        train_throughput.prepare_documents(args, directory)
        documents = datasets.load_from_disk(os.path.join(directory, args.dataset))
        runs = {}
        for key in args.only:
            name, backend = key.split("|")
            batches = train_throughput.step_batches(name, documents, args)
            model, collator = train_throughput.build(name, backend, args)
            runs[key] = {"batches": batches, "model": model, "collator": collator, "real": 0, "thread": 0.0,
                         "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-5), "operators": {}}
    for step in range(-1, args.steps):  # step -1: warm-up
        for run in runs.values():
            features = run["batches"][max(step, 0)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                start = time.thread_time()
                run["model"](**run["collator"](features)).loss.backward()
                run["optimizer"].step()
                run["optimizer"].zero_grad(set_to_none=True)
                seconds = time.thread_time() - start
            if step < 0:
                continue
            run["real"] += sum(len(f["input_ids"]) for f in features)
            run["thread"] += seconds
            for event in profile.key_averages():
                run["operators"][event.key] = run["operators"].get(event.key, 0.0) + event.self_cpu_time_total

    def per_token(run, key):
        return run["operators"].get(key, 0.0) / run["real"]

    keys = sorted({key for run in runs.values() for key in run["operators"]},
                  key=lambda key: -max(per_token(run, key) for run in runs.values()))
    print(f"# Self CPU time per real token (us), {args.model} model, {args.dataset}, {args.steps} steps each, load "
          f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| operator | " + " | ".join(key.replace("|", ", ") for key in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for key in keys[: args.operators]:
        print(f"| {key[:70]} | " + " | ".join(f"{per_token(run, key):.1f}" for run in runs.values()) + " |")
    totals = [sum(run["operators"].values()) / run["real"] for run in runs.values()]
    print("| all operators | " + " | ".join(f"{total:.1f}" for total in totals) + " |")
    print("| thread CPU | " + " | ".join(
        f"{run['thread'] / run['real'] * 1e6:.1f}" for run in runs.values()) + " |")


if __name__ == "__main__":
    main()
