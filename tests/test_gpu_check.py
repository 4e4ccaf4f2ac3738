"""benchmarks/gpu_check.py on a machine without CUDA: it says what it would run and exits 0 having written nothing;
its CUDA path's pieces (one `llm-packing verify` process, the table) on CPU (slow)."""

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch
from tiny_models import tiny_model


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine gpu_check runs for real")
def test_without_cuda_it_prints_the_plan(tmp_path):
    output = tmp_path / "gpu_check"
    process = subprocess.run([sys.executable, SCRIPT, "--output", str(output)], capture_output=True, text=True,
                             check=False, env={**os.environ, "PYTHONPATH": ROOT})
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    assert lines[0] == "gpu_check: no CUDA device here; nothing run. On a CUDA machine it would run:"
    for title in ("llama, every backend", "mistral, every backend", "gemma2, every backend",
                  "SmolLM2-135M (real weights), every backend", "qwen3_5_text (hybrid mixers)",
                  "nemotron_h (hybrid mixers)", "mamba2 (hybrid mixers)"):
        line = next(line for line in lines if line.startswith(f"- {title}"))
        assert "llm-packing verify --model " in line and "--dtype bfloat16 --device cuda" in line
    throughput = next(line for line in lines if line.startswith("- throughput, 0.5B-class config: "))
    assert "benchmarks/train_throughput.py --model 0.5b" in throughput and "--device cuda --dtype bf16" in throughput
    assert "kernel packages importable here: flash_attn " in process.stdout
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_a_check_and_its_table_on_cpu(tmp_path):
    """What the CUDA path does per check, here on CPU: a verify process, its report read back, a row per route."""
    gpu_check = load_script()
    torch.manual_seed(0)
    tiny_model("llama", attn_implementation="eager").save_pretrained(tmp_path / "llama")
    row = gpu_check.run_verify("llama, sdpa", ["--model", str(tmp_path / "llama")], str(tmp_path))
    failed = gpu_check.run_verify("missing model", ["--model", str(tmp_path / "nowhere")], str(tmp_path))
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_name=lambda: "a GPU"),
                                       version=types.SimpleNamespace(cuda="12.x"))
    table = gpu_check.render([row, failed], "throughput table", fake_torch)
    assert "| llama, sdpa | sdpa/varlen | per-document SDPA (length buckets) | exact | " in table
    assert "| missing model | | | failed to run | | | exit 2: " in table
    assert table.rstrip().endswith("throughput table") and "- GPU: a GPU, CUDA 12.x" in table
