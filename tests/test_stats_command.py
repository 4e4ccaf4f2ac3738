import dataclasses
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llm_packing import cli
from llm_packing.cli.documents import load_demo_documents, load_tokenizer
from llm_packing.cli.stats import compare_strategies, main
from llm_packing.core.binpack import STRATEGIES, pack_sequences
from llm_packing.core.overflow import cut_pieces
from llm_packing.errors import PackingValueError, SequenceTooLongError


MAX_LENGTH = 128
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def lengths():
    # Mostly short documents, a few over MAX_LENGTH (so that overflow matters) and one empty one.
    rng = np.random.default_rng(0)
    return np.concatenate([rng.integers(1, 100, size=57), [300, 129, 0]])


@pytest.fixture
def dataset_file(tmp_path, lengths):
    path = tmp_path / "tokenized.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(n)), "source": "x"}) + "\n" for n in lengths))
    return str(path)


def table_rows(output: str) -> dict[str, list[str]]:
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    return {line.split()[0]: line.split()[1:] for line in lines[header + 1:] if line.split()[0] in STRATEGIES}


def percent(cell: str) -> float:
    return float(cell.rstrip("%")) / 100


def test_table_equals_pack_sequences_stats(dataset_file, lengths, capsys):
    runs = main(["--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--overflow", "split"])
    rows = table_rows(capsys.readouterr().out)
    pieces = cut_pieces(lengths, MAX_LENGTH, "split")
    assert list(rows) == list(runs) == list(STRATEGIES)
    for strategy in STRATEGIES:
        expected = pack_sequences(pieces.length, MAX_LENGTH, strategy=strategy).stats
        assert runs[strategy].stats == dataclasses.replace(expected, **pieces.counts())
        bins, efficiency, padding, gap, p50, p90, p99, _, unit = rows[strategy]
        assert int(bins.replace(",", "")) == expected.num_bins
        # The table rounds to 4 decimals of a percent (efficiency, padding, gap) and 2 for fullness.
        assert percent(efficiency) == pytest.approx(expected.efficiency, abs=5e-7)
        assert percent(padding) == pytest.approx(expected.padding_ratio, abs=5e-7)
        assert percent(gap) == pytest.approx(expected.gap_to_lower_bound, abs=5e-7)
        fullness = (expected.fullness_p50, expected.fullness_p90, expected.fullness_p99)
        for cell, value in zip((p50, p90, p99), fullness, strict=True):
            assert percent(cell) == pytest.approx(value, abs=5e-5)
        assert unit == "ms"


@pytest.fixture
def hand_file(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(n))}) + "\n" for n in (5, 4, 3, 2, 0, 11)))
    return str(path)


def test_hand_computed_split_table(hand_file, capsys):
    """Documents of 5, 4, 3, 2, 0 and 11 tokens in rows of 8, worked by hand. `split` cuts 11 into 8 + 3 and leaves
    the empty one out: pieces 5, 4, 3, 2, 8, 3, 25 tokens, lower bound ceil(25 / 8) = 4 rows.
    bfd (decreasing, best fit): [8] [5, 3] [4, 3] [2]: 25 of 32 slots = 78.125%; fill 8, 8, 7, 2 of 8, sorted
    0.25, 0.875, 1, 1: p50 (0.875 + 1) / 2 = 0.9375, p90 and p99 1.
    nf (in order, next fit): [5] [4, 3] [2] [8] [3]: 5 rows, 25 / 40 = 62.5%, gap 5 / 4 - 1 = 25%; fill sorted 0.25,
    0.375, 0.625, 0.875, 1: p50 0.625, p90 0.875 + 0.6 x 0.125 = 0.95, p99 0.875 + 0.96 x 0.125 = 0.995.
    Length summary of 0, 2, 3, 4, 5, 11: median 3.5 (prints 4), mean 4.17, p99 5 + 0.95 x 6 = 10.7 (prints 11)."""
    main(["--dataset", hand_file, "--max_length", "8", "--overflow", "split", "--strategies", "bfd", "nf"])
    output = capsys.readouterr().out
    assert output.splitlines()[:2] == [
        "documents 6, tokens 25; length min 0, median 4, mean 4.2, p99 11, max 11",
        "packed: 6 sequences into rows of 8 tokens (lower bound 4 bins); --overflow split: 1 split, 1 empty",
    ]
    rows = {strategy: cells[:-2] for strategy, cells in table_rows(output).items()}  # less the time and its unit
    assert rows == {
        "bfd": ["4", "78.1250%", "21.8750%", "+0.0000%", "93.75%", "100.00%", "100.00%"],
        "nf": ["5", "62.5000%", "37.5000%", "+25.0000%", "62.50%", "95.00%", "99.50%"],
    }


def test_hand_computed_truncate_and_drop(hand_file, capsys):
    """The same documents: `truncate` cuts 3 tokens of the 11, pieces 5, 4, 3, 2, 8 (22 tokens, lower bound 3 rows);
    ffd (decreasing, first fit) packs [8] [5, 3] [4, 2]: 22 / 24 = 91.6667%, fill 0.75, 1, 1. nf packs [5] [4, 3] [2]
    [8]: 22 / 32 = 68.75%, gap 4 / 3 - 1 = 33.3333%. `drop` leaves the 11 out: pieces 5, 4, 3, 2 (14 tokens, 2 rows);
    bfd packs [5, 3] [4, 2]: 14 / 16 = 87.5%, fill 0.75, 1: p50 0.875, p90 0.975, p99 0.9975."""
    main(["--dataset", hand_file, "--max_length", "8", "--overflow", "truncate", "--strategies", "ffd", "nf"])
    output = capsys.readouterr().out
    assert output.splitlines()[1] == (
        "packed: 5 sequences into rows of 8 tokens (lower bound 3 bins); --overflow truncate: 1 truncated "
        "(3 tokens cut), 1 empty"
    )
    assert {strategy: cells[:-2] for strategy, cells in table_rows(output).items()} == {
        "ffd": ["3", "91.6667%", "8.3333%", "+0.0000%", "100.00%", "100.00%", "100.00%"],
        "nf": ["4", "68.7500%", "31.2500%", "+33.3333%", "75.00%", "96.25%", "99.62%"],
    }
    main(["--dataset", hand_file, "--max_length", "8", "--overflow", "drop", "--strategies", "bfd"])
    output = capsys.readouterr().out
    assert output.splitlines()[1] == (
        "packed: 4 sequences into rows of 8 tokens (lower bound 2 bins); --overflow drop: 1 dropped (11 tokens), "
        "1 empty"
    )
    assert table_rows(output)["bfd"][:-2] == ["2", "87.5000%", "12.5000%", "+0.0000%", "87.50%", "97.50%", "99.75%"]


def test_length_summary_and_overflow_line(dataset_file, lengths, capsys):
    main(["--dataset_name", dataset_file, "--max_length", str(MAX_LENGTH)])
    summary, packed = capsys.readouterr().out.splitlines()[:2]
    median, p99 = np.percentile(lengths, [50, 99])
    assert summary == (
        f"documents {len(lengths)}, tokens {lengths.sum():,}; length min 0, median {median:,.0f}, mean "
        f"{lengths.mean():,.1f}, p99 {p99:,.0f}, max 300"
    )
    pieces = cut_pieces(lengths, MAX_LENGTH, "split")
    assert f"packed: {len(pieces.length)} sequences into rows of {MAX_LENGTH} tokens" in packed
    assert packed.endswith("--overflow split: 2 split, 1 empty")


@pytest.mark.parametrize("overflow, reported, num_sequences", [
    ("drop", "2 dropped (429 tokens), 1 empty", 57),  # 300 + 129 tokens left out
    ("truncate", "2 truncated (173 tokens cut), 1 empty", 59),  # (300 - 128) + (129 - 128) cut
])
def test_overflow_policies_are_reported(dataset_file, overflow, reported, num_sequences, capsys):
    runs = main(["--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--overflow", overflow,
                 "--strategies", "bfd"])
    assert capsys.readouterr().out.splitlines()[1].endswith(f"--overflow {overflow}: {reported}")
    assert runs["bfd"].stats.num_sequences == num_sequences


def test_overflow_error_raises_like_pack_dataset(dataset_file):
    with pytest.raises(SequenceTooLongError, match="2 sequence"):
        main(["--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--overflow", "error"])


def test_strategies_seed_and_max_samples(dataset_file, lengths, capsys):
    runs = main(["--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--strategies", "nf", "bfd",
                 "--seed", "3", "--max_samples", "10", "--max_docs_per_bin", "2"])
    assert capsys.readouterr().out.startswith("documents 10,")
    assert list(runs) == ["nf", "bfd"]
    expected = pack_sequences(lengths[:10], MAX_LENGTH, strategy="bfd", seed=3, max_docs_per_bin=2)
    assert runs["bfd"].result == expected


def test_plot_writes_a_png(dataset_file, tmp_path, capsys):
    path = tmp_path / "fill.png"
    main(["--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--plot", str(path)])
    assert capsys.readouterr().out.endswith(f"plot written to {path}\n")
    data = path.read_bytes()
    assert len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE)


def test_plot_without_matplotlib_names_the_extra(dataset_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # makes the import fail
    with pytest.raises(ModuleNotFoundError, match=r'pip install "llm_packing\[plot\]"'):
        main(["--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--plot", str(tmp_path / "fill.png")])


def test_through_the_cli(dataset_file, capsys):
    assert cli.main(["stats", "--dataset", dataset_file, "--max_length", str(MAX_LENGTH)]) == 0
    assert set(table_rows(capsys.readouterr().out)) == set(STRATEGIES)


def test_tokenizes_a_dataset_without_input_ids(capsys):
    runs = main(["--dataset", "chitchat", "--max_samples", "4", "--max_length", "4096", "--strategies", "bfd"])
    documents = load_demo_documents(max_samples=4, assistant_only_loss=False)
    lengths = [len(ids) for ids in documents["input_ids"]]
    assert runs["bfd"].result == pack_sequences(lengths, 4096)
    assert capsys.readouterr().out.startswith(f"documents 4, tokens {sum(lengths):,};")


def test_text_field(tmp_path):
    texts = ["Hello world", "Hi"]
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts))
    runs = main(["--dataset", str(path), "--text_field", "body", "--max_length", "16", "--strategies", "bfd"])
    tokenizer = load_tokenizer("demo")
    lengths = [len(tokenizer(text)["input_ids"]) + 1 for text in texts]  # plain text is trained with an EOS appended
    assert runs["bfd"].result.lengths.tolist() == lengths


@pytest.mark.parametrize("flags, match", [
    (["--max_length", "0"], "`--max_length` must be a positive integer, got 0"),
    (["--max_length", "-8"], "`--max_length`"),
    (["--max_length", "2k"], "`--max_length`"),
    (["--max_length", "64", "--max_samples", "0"], "`--max_samples`"),
    (["--max_length", "64", "--seed", "-1"], "`--packing_seed`"),
    (["--max_length", "64", "--strategies", "bfd", "best"], r"`--strategies` got unknown \['best'\]"),
    (["--max_length", "64", "--overflow", "wrap"], "`overflow` must be one of"),
    (["--max_length", "64", "--plot", "no/such/folder/fill.png"], "`--plot`"),
])
def test_bad_flags(dataset_file, flags, match):
    with pytest.raises(PackingValueError, match=match):
        main(["--dataset", dataset_file, *flags])


def test_missing_file(tmp_path):
    with pytest.raises(PackingValueError, match="`dataset_name` .*missing.jsonl' is not a file or folder"):
        main(["--dataset", str(tmp_path / "missing.jsonl"), "--max_length", "64"])


def test_no_usable_column(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text('{"prompt": "Hello"}\n')
    with pytest.raises(PackingValueError, match="`--dataset_messages_field`.*`--dataset_text_field`"):
        main(["--dataset", str(path), "--max_length", "64"])


def test_compare_strategies_validates_overflow():
    with pytest.raises(PackingValueError, match="`overflow`"):
        compare_strategies([3, 4], 8, overflow="wrap")


@pytest.mark.slow
def test_console_script(dataset_file, tmp_path):
    executable = shutil.which("llm-packing")
    assert executable, "the `llm-packing` console script is not installed: `pip install -e .`"
    path = tmp_path / "fill.png"
    completed = subprocess.run(
        [executable, "stats", "--dataset", dataset_file, "--max_length", str(MAX_LENGTH), "--plot", str(path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert set(table_rows(completed.stdout)) == set(STRATEGIES)
    assert path.read_bytes().startswith(PNG_SIGNATURE)
