"""The wheel installs clean: `python -m build` makes an sdist and a wheel (built from the sdist) holding every module
of the package and `py.typed`; installed into a fresh virtual environment with only the base requirements (no TRL), it
imports, packs a dataset, answers `llm-packing --help` and proves a tiny model exact with `llm-packing verify`.

Slow: the virtual environment's installs take about half a minute (torch from the local wheel cache first, as the
README's test command installs it, so pip never fetches another torch; the rest from the package index; neither
byte-compiled).
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_INPUTS = ("llm_packing", "setup.cfg", "pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE")
PACK_AND_REPORT = textwrap.dedent("""
    import importlib.util, json, sys
    import llm_packing
    from datasets import Dataset
    from llm_packing import pack_dataset

    packed = pack_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]}), max_length=5)
    rows = packed.to_dict()
    print(json.dumps({"file": llm_packing.__file__, "version": llm_packing.__version__,
                      "trl": importlib.util.find_spec("trl") is not None,
                      "rows": rows["input_ids"], "seq_lengths": rows["seq_lengths"]}))
""")


def run(command, **kwargs) -> subprocess.CompletedProcess:
    process = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    assert process.returncode == 0, f"{command} exited {process.returncode}:\n{process.stdout}\n{process.stderr}"
    return process


@pytest.mark.slow
def test_wheel_installs_clean(tmp_path):
    timings = {}
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:  # a copy: building writes build/ and *.egg-info beside the sources
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, source / name)
    modules = sorted(os.path.relpath(os.path.join(folder, file), source).replace(os.sep, "/")
                     for folder, _, files in os.walk(source / "llm_packing") for file in files)
    assert "llm_packing/py.typed" in modules and "llm_packing/hook/support/table.py" in modules

    started = time.perf_counter()
    run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(source)])
    timings["build"] = time.perf_counter() - started
    (wheel,) = (tmp_path / "dist").glob("llm_packing-*.whl")
    (sdist,) = (tmp_path / "dist").glob("llm_packing-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
        entry_points = archive.read(next(name for name in in_wheel if name.endswith("entry_points.txt"))).decode()
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert [module for module in modules if module not in in_wheel] == []
    assert [module for module in modules if module not in in_sdist] == []
    assert "llm-packing = llm_packing.cli:main" in entry_points
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in in_wheel) and "LICENSE" in in_sdist

    venv = tmp_path / "venv"
    python, pip, console = (str(venv / "bin" / name) for name in ("python", "pip", "llm-packing"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of this checkout
    started = time.perf_counter()
    run([sys.executable, "-m", "venv", str(venv)])
    # `--no-compile`: byte-compiling torch's and transformers' thousands of modules was most of this test's time.
    # This process's torch (the README's `pip install torch==2.13.0` takes it from the local wheel cache): the wheel's
    # `torch>=2.6` is then met, and pip never downloads a CUDA build.
    run([pip, "install", "--quiet", "--no-compile", f"torch=={torch.__version__}"], env=env, cwd=tmp_path)
    timings["torch"] = time.perf_counter() - started
    started = time.perf_counter()
    run([pip, "install", "--quiet", "--no-compile", str(wheel)], env=env, cwd=tmp_path)
    timings["wheel and base requirements"] = time.perf_counter() - started

    report = json.loads(run([python, "-c", PACK_AND_REPORT], env=env, cwd=tmp_path).stdout.splitlines()[-1])
    assert report["file"].startswith(str(venv)) and report["version"] == "0.2.0"
    assert report["trl"] is False
    assert sorted(token for row in report["rows"] for token in row) == list(range(1, 11))
    assert sorted(n for row in report["seq_lengths"] for n in row) == [1, 2, 3, 4]

    help_text = run([console, "--help"], env=env, cwd=tmp_path).stderr
    assert all(command in help_text for command in ("train", "stats", "verify"))

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "tiny")
    verdict = run([console, "verify", "--model", str(tmp_path / "tiny")], env=env, cwd=tmp_path).stdout
    assert verdict.startswith("exact: ")
    print(f"wheel test timings (s): {json.dumps({k: round(v) for k, v in timings.items()})}")
