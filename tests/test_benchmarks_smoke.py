"""The training-throughput benchmark runs end to end in its tiny mode and writes its report and plot."""

import os
import subprocess
import sys

import pytest


BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                         "train_throughput.py")


@pytest.mark.slow
def test_train_throughput_tiny(tmp_path):
    output = tmp_path / "train_throughput"
    # Three of the nine configurations (each a fresh process per dataset, 6 s of it importing TRL): the baseline,
    # packed rows on the default sdpa route, TRL's packing.
    only = ["padded, random order", "llm_packing rows|sdpa", "TRL packing (bfd + padding-free)|sdpa"]
    subprocess.run([sys.executable, BENCHMARK, "--model", "tiny", "--also", "--max-length", "128", "--warmup", "1",
                    "--steps", "2", "--rounds", "1", "--max-samples", "100", "--output", str(output), "--only", *only],
                   check=True, capture_output=True)
    report = (tmp_path / "train_throughput.md").read_text()
    assert (tmp_path / "train_throughput.png").stat().st_size > 0
    for dataset in ("## conversations: tiny model", "## lognormal: tiny model", "## Targets: tiny model"):
        assert dataset in report
    rows = [line for line in report.splitlines() if line.startswith("| ") and "configuration" not in line]
    assert len(rows) == 6
    assert "skipped" not in report and "exit code" not in report  # a crash shows as "exit code"
    # Packed configurations train on full packed rows, not on the documents they were packed from.
    header = next(line for line in report.splitlines() if line.startswith("| configuration"))
    padding = [cell.strip() for cell in header.split("|")].index("padding")
    packed = [row for row in rows if row.startswith("| llm_packing rows | sdpa")]
    assert packed and all(float(row.split("|")[padding].strip(" %")) < 5 for row in packed), packed


@pytest.mark.slow
def test_pack_dataset_speed_tiny(tmp_path):
    script = os.path.join(os.path.dirname(BENCHMARK), "pack_dataset_speed.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(script)),
                                                                      os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, script, "--data", str(tmp_path / "corpus.arrow"), "--rows", "3000",
                    "--repeats", "1", "--output", str(tmp_path / "report.md")], check=True, capture_output=True,
                   env=env)
    rows = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("| ") and
            "packer" not in line]
    assert len(rows) == 2 and all("| yes |" in row and "input_ids, seq_lengths (file)" in row for row in rows)


def test_pack_locality_tiny():
    script = os.path.join(os.path.dirname(BENCHMARK), "pack_locality.py")
    result = subprocess.run([sys.executable, script, "--rows", "50000", "--max-length", "1024"], check=True,
                            capture_output=True, text=True)
    engine, local, by_index = (row for row in result.stdout.splitlines() if row.startswith("| ") and "GiB (" in row)
    ratio = lambda row: float(row.split("GiB (")[1].split("x")[0])  # noqa: E731
    assert ratio(local) < ratio(engine) and ratio(by_index) < ratio(engine)
