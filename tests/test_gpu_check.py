"""benchmarks/gpu_check.py without a GPU: its dry run lists every check and throughput row with its time estimate,
the wheel bundles' install is formed as the GPU machine needs it (pip from the folder, an archive unpacked into
site-packages), and the throughput code it runs (gradient accumulation, the varlen route, a profiled step, the time
budget, model FLOPs and MFU, tokenized documents from a file) runs on CPU; the CUDA path's verify process and table
(slow)."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
import types

import datasets
import pytest
import torch
from tiny_models import tiny_model


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCHMARKS, "gpu_check.py")


def load(name: str):
    """A benchmarks/ module by file name (that folder is no package)."""
    sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(*flags: str) -> list[str]:
    process = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, check=False,
                             env={**os.environ, "PYTHONPATH": ROOT})
    assert process.returncode == 0, process.stderr
    return process.stdout.splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine gpu_check runs for real")
def test_without_cuda_it_prints_the_plan_and_writes_nothing(tmp_path):
    lines = plan("--out", str(tmp_path))
    assert lines[0] == "gpu_check: no CUDA device here; nothing run. On a CUDA machine it would run:"
    assert not os.listdir(tmp_path)


def test_dry_run_lists_every_check_and_row_with_estimates():
    lines = plan("--dry-run", "--budget-s", "470")
    assert lines[0] == "gpu_check --dry-run: it would run:"
    for title in ("llama, every backend", "mistral, every backend", "gemma2, every backend",
                  "SmolLM2-135M shape (random weights), every backend", "qwen3_5_text (hybrid mixers)",
                  "nemotron_h (hybrid mixers)", "mamba2 (hybrid mixers)"):
        line = next(line for line in lines if line.startswith(f"- exactness, {title}"))
        assert "llm-packing verify --model " in line and "--dtype bfloat16 --device cuda" in line
    assert "- exactness, compiled packed steps: python benchmarks/gpu_compile_check.py --json <file>" in lines
    sections = [line for line in lines if line.startswith("- throughput ")]
    assert [line.split(",")[0] for line in sections] == [
        "- throughput 1.5b-16384", "- throughput 1.5b-4096", "- throughput 0.5b-4096", "- throughput 0.5b-16384"]
    assert all("python benchmarks/train_throughput.py --model " in line and "--device cuda --dtype bf16" in line
               for line in sections)
    # 18 s of setup + 5 rows x 31 s after 190 s of exactness checks; then 20 s of setup + 5 rows x 30 s + the
    # compiled row's 30 s + 150 s of compiling.
    assert "estimated 173 s (cumulative 363 s, fits)" in sections[0]
    assert "estimated 350 s (cumulative 713 s, over --budget-s: skipped)" in sections[1]
    assert "--accumulation 4" in sections[1] and "--max-length 16384" in sections[0]
    assert "--row-timeout-s 360" in sections[1]  # twice the compiled row's estimate
    assert "--profile 'llm_packing rows|sdpa'" in sections[0]
    assert "--profile 'llm_packing rows, varlen route|sdpa'" in sections[1]
    assert "--gradient-checkpointing on-oom" in sections[0]
    assert not any("--gradient-checkpointing" in line for line in sections[1:])
    rows = [line.strip() for line in lines if line.startswith("  - row ")]
    fa4, trl, ours, padded = "flash_attention_4", "TRL packing (bfd + padding-free)", "llm_packing rows", \
        "padded, group_by_length"
    # At 4,096 tokens `auto` takes the dense route on CUDA for head dims 64 (0.5B) and 128 (1.5B), so the other sdpa
    # row is the varlen route; at 16,384 it is the other way round.
    assert [row.split(": ", 1)[1] for row in rows if row.startswith("- row 0.5b-4096")] == [
        f"{ours}|sdpa", f"{ours}, varlen route|sdpa", f"{ours}|{fa4}", f"{trl}|sdpa", f"{trl}|{fa4}",
        f"{padded}|sdpa", f"{padded}|{fa4}", f"{ours}, compiled|sdpa"]
    assert [row.split(": ", 1)[1] for row in rows if row.startswith("- row 1.5b-4096")] == [
        f"{ours}|{fa4}", f"{trl}|{fa4}", f"{ours}|sdpa", f"{ours}, varlen route|sdpa", f"{trl}|sdpa",
        f"{ours}, compiled|{fa4}"]
    assert [row.split(": ", 1)[1] for row in rows if row.startswith("- row 1.5b-16384")] == [
        f"{ours}|{fa4}", f"{ours}|sdpa", f"{ours}, dense mask|sdpa", f"{trl}|{fa4}", f"{trl}|sdpa"]
    assert f"- row 0.5b-16384: {ours}, dense mask|sdpa" in rows


def test_gradient_checkpointing_only_after_running_out_of_memory():
    """`--gradient-checkpointing on-oom` (the 1.5B shape at 16,384 in gpu_check): steps run without it; where one runs
    out of memory, checkpointing is turned on and every step runs again, and the row says so."""
    train_throughput = load("train_throughput")
    report = load("throughput_report")
    checkpointing, ran = [], []

    def train_step(micro_batches):
        if not checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory")
        ran.append(micro_batches)
        return {"step": micro_batches}

    with pytest.raises(torch.OutOfMemoryError):
        train_throughput.run_steps(train_step, ["warm-up", "a"])
    assert train_throughput.run_steps(train_step, ["warm-up", "a"], lambda: checkpointing.append(True)) == (
        [{"step": "warm-up"}, {"step": "a"}], True)
    assert ran == ["warm-up", "a"] and checkpointing == [True]
    assert train_throughput.run_steps(train_step, ["b"], lambda: None) == ([{"step": "b"}], False)
    steps = [{"seconds": 0.5, "cpu": 0.5, "mask": 0.0, "real": 10, "tensor": 10, "mixer": 0.0, "rebatch": 0.0}]
    row = report.summarise(report.merge_rounds([{"steps": steps, "peak_mib": 1.0, "base_mib": 0.0,
                                                 "note": "gradient checkpointing: out of memory without"}]))
    lines = report.table({("lognormal", report.OURS, "sdpa"): row}, "lognormal", "cuda")
    assert lines[2].startswith("| llm_packing rows (gradient checkpointing: out of memory without) | sdpa | 20 |")


def test_bundle_install_is_pip_from_the_folder_and_archives_into_site_packages(tmp_path):
    gpu_wheels = load("gpu_wheels")
    bundle = tmp_path / "a"
    bundle.mkdir()
    (bundle / "requirements.txt").write_text("transformers==5.24.0\n")
    (bundle / "libs.tar.zst").write_bytes(b"")
    steps = gpu_wheels.install_plan(str(bundle), site=str(tmp_path / "site"))
    assert steps == [
        ("pip", [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                 "--disable-pip-version-check", "-q", "--find-links", str(bundle), "-r",
                 str(bundle / "requirements.txt")], None),
        ("unpack", str(bundle / "libs.tar.zst"), str(tmp_path / "site")),
    ]
    with pytest.raises(FileNotFoundError, match="gpu_wheels.py"):
        gpu_wheels.install_plan(str(tmp_path / "site"))
    lines = plan("--dry-run", "--wheels", str(bundle), "--skip-throughput")
    assert f"- install: unpack {bundle / 'libs.tar.zst'} into " in "\n".join(lines)
    assert any(line.startswith("- install: ") and "--no-index --no-deps" in line for line in lines)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="builds a tar.zst with the zstd program")
def test_an_archive_unpacks_with_its_dist_info(tmp_path):
    gpu_wheels = load("gpu_wheels")
    source = tmp_path / "source"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "lib.so").write_bytes(b"\x7fELF" * 1000)
    (source / "pkg-1.0.dist-info").mkdir()
    (source / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\nVersion: 1.0\n")
    with tarfile.open(tmp_path / "b.tar", "w") as tar:
        for path in ("pkg/lib.so", "pkg-1.0.dist-info/METADATA"):
            tar.add(source / path, arcname=path)
    subprocess.run(["zstd", "-q", "--long=30", str(tmp_path / "b.tar"), "-o", str(tmp_path / "b.tar.zst")],
                   check=True)
    gpu_wheels.unpack(str(tmp_path / "b.tar.zst"), str(tmp_path / "site"))
    assert (tmp_path / "site" / "pkg" / "lib.so").read_bytes() == b"\x7fELF" * 1000
    assert (tmp_path / "site" / "pkg-1.0.dist-info" / "METADATA").read_text().startswith("Name: pkg")


def test_mfu_and_gpu_memory_columns():
    """The CUDA table from a configuration's measured steps: MFU is model FLOPs over time over the device's peak."""
    report = load("throughput_report")
    flops = load("model_flops")
    steps = [{"seconds": 0.5, "cpu": 0.5, "mask": 0.01, "real": 16384, "tensor": 16384, "mixer": 0.0,
              "rebatch": 0.0, "flops": 1e14}] * 2
    peak = flops.peak_bf16_flops("NVIDIA H100 80GB HBM3")
    result = report.summarise(report.merge_rounds([{"steps": steps, "peak_mib": 30000.0, "base_mib": 0.0,
                                                    "peak_flops": peak}]))
    assert result["mfu"] == pytest.approx(1e14 / 0.5 / 989e12)
    config = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, hidden_size=64)  # head dim 32
    assert flops.step_flops(10, config, [2]) == 6 * 10 * 2 + 6 * 2 * 2 * 32 * (2 * 3)
    lines = report.table({("conversations", report.OURS, "flash_attention_4"): result,
                          ("conversations", report.TRL, "flash_attention_4"): {"error": "OutOfMemoryError: CUDA"}},
                         "conversations", "cuda")
    assert "| MFU |" in lines[0] and "peak GPU memory MiB" in lines[0]
    assert lines[2].startswith("| llm_packing rows | flash_attention_4 | 32,768 | n/a | 20.2% | 500 | 16,384 |")
    assert lines[2].endswith("| 30,000 |")
    assert lines[3] == "| TRL packing (bfd + padding-free) | flash_attention_4 | skipped: OutOfMemoryError: CUDA |" + \
        " |" * 7


def test_a_configuration_past_the_budget_is_not_started():
    train_throughput = load("train_throughput")
    args = types.SimpleNamespace(row_timeout_s=None)
    result = train_throughput.run_child(args, "tiny", "conversations", "llm_packing rows", "sdpa", 0, "<docs>",
                                        "<dir>", deadline=time.monotonic() - 1)
    assert result == {"error": "not run: the time budget (--budget-s) was spent"}


def test_throughput_on_cpu_with_accumulation_and_a_profile(tmp_path):
    """train_throughput.py's new path on a tiny model: 2 micro-batches a step, the varlen route on request, a
    profiled step, documents from a token file."""
    token_documents = load("token_documents")
    ids = [[3 + (i * 7 + j) % 100 for j in range(5 + (i * 13) % 40)] for i in range(120)]
    token_documents.save_documents(datasets.Dataset.from_dict(
        {"input_ids": ids, "labels": [[-100] * 2 + row[2:] for row in ids]}), str(tmp_path / "docs.npz"))
    output = tmp_path / "throughput"
    ours, varlen = "llm_packing rows|sdpa", "llm_packing rows, varlen route|sdpa"
    subprocess.run([sys.executable, os.path.join(BENCHMARKS, "train_throughput.py"), "--model", "tiny", "--also",
                    "--max-length", "64", "--rows", "2", "--accumulation", "2", "--steps", "1", "--rounds", "1",
                    "--datasets", "conversations", "--conversations", str(tmp_path / "docs.npz"), "--no-plot",
                    "--profile", ours, "--output", str(output), "--only", ours, varlen],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})
    report = (tmp_path / "throughput.md").read_text()
    assert "- budget: 2 x 2 x 64 = 256 tokens per step (micro-batches x rows x max_length)" in report
    assert "- conversations (vocabulary 4,096): 120 documents" in report
    rows = [line for line in report.splitlines() if line.startswith("| llm_packing rows")]
    assert [row.split(" | ")[0] for row in rows] == ["| llm_packing rows", "| llm_packing rows, varlen route"]
    assert "skipped" not in report and not (tmp_path / "throughput.png").exists()
    profile = (tmp_path / "throughput_profile.md").read_text()
    assert profile.startswith("### llm_packing rows | sdpa: tiny model, conversations, 2 x 2 x 64 tokens")
    assert "| operator | calls | self CPU ms | share |" in profile


@pytest.mark.parametrize("name", ["llm_packing rows", "TRL packing (bfd + padding-free)", "padded, group_by_length"])
def test_the_benchmarks_loss_is_sft_trainers_fused_head_and_equals_the_models_own(name):
    """`--loss trl` (the default) computes the loss as SFTTrainer does, by TRL's fused LM head; it is the model's own
    loss, not a cheaper stand-in; and MFU counts the head only on the positions it scores."""
    from llm_packing import pack_dataset, unconfigure_packing

    train_throughput = load("train_throughput")
    rng = torch.Generator().manual_seed(0)
    lengths = [9, 30, 4, 17, 25, 11]
    ids = [torch.randint(3, 4096, (n,), generator=rng).tolist() for n in lengths]
    documents = datasets.Dataset.from_dict({"input_ids": ids, "labels": [[-100] * 3 + row[3:] for row in ids]})
    features = list(documents if name.startswith("padded") else
                    (trl_pack(documents, 64) if name.startswith("TRL") else pack_dataset(documents, 64)))
    losses = {}
    try:
        for loss in ("trl", "model"):
            args = types.SimpleNamespace(model="tiny", max_length=64, seed=0, device="cpu", loss=loss)
            model, collator = train_throughput.build(name, "sdpa", args)
            batch = collator(features)
            losses[loss] = model(**batch, **({"fused_lm_head": True} if loss == "trl" else {})).loss
    finally:
        unconfigure_packing()
    assert losses["trl"].item() == pytest.approx(losses["model"].item(), rel=1e-5)
    flops = load("model_flops")
    config = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, hidden_size=64)
    assert flops.step_flops(1000, config, lengths, head_weights=300, scored_tokens=80) == \
        flops.step_flops(1000, config, lengths) - 6 * 300 * (sum(lengths) - 80)


def trl_pack(documents, max_length):
    from trl.data_utils import pack_dataset

    return pack_dataset(documents, max_length, strategy="bfd")


@pytest.mark.slow
def test_a_check_and_its_table_on_cpu(tmp_path):
    """What the CUDA path does per check, here on CPU: a verify process, its report read back, a row per route."""
    gpu_check = load("gpu_check")
    torch.manual_seed(0)
    tiny_model("llama", attn_implementation="eager").save_pretrained(tmp_path / "llama")
    row = gpu_check.run_verify("llama, sdpa", ["--model", str(tmp_path / "llama")], str(tmp_path))
    failed = gpu_check.run_verify("missing model", ["--model", str(tmp_path / "nowhere")], str(tmp_path))
    table = gpu_check.render_exactness([row, failed])
    assert "| llama, sdpa | sdpa/varlen | per-document SDPA (length buckets) | exact | " in "\n".join(table)
    assert "| missing model | | | failed to run | | | | exit 2: " in "\n".join(table)
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "h100" and gpu_check.device_slug("NVIDIA H200") == "h200"
