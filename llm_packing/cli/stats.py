"""`llm-packing stats`: how tightly a dataset packs into rows of `max_length` tokens, per strategy, before training.

    llm-packing stats --dataset chitchat --max_length 2048
    llm-packing stats --dataset data.jsonl --max_length 4096 --strategies bfd nf --overflow drop --plot fill.png

Lengths come from an `input_ids` column, else from tokenizing as `llm-packing train` does. Over-long documents follow
`--overflow` as in `pack_dataset`; each strategy then packs the pieces with `pack_sequences`. `--plot` writes a PNG of
the length histogram and the bin fill per strategy (needs `pip install "llm_packing[plot]"`).
"""

import argparse
import dataclasses
import os
import time
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..core.binpack import STRATEGIES, PackResult, pack_sequences
from ..core.checks import check_integer
from ..core.overflow import OVERFLOW_POLICIES, check_max_length, check_overflow_policy, cut_pieces
from ..core.stats import PackingStats
from ..errors import PackingValueError
from .documents import DEMO_TOKENIZER_NAME, load_documents, load_tokenizer, tokenize_documents


class StrategyRun(NamedTuple):
    """One strategy's packing: the plan, its stats (with the overflow counts) and the seconds `pack_sequences` took."""

    result: PackResult
    stats: PackingStats
    seconds: float


def compare_strategies(lengths, max_length: int, strategies=STRATEGIES, *, overflow: str = "split",
                       seed: int | None = None, max_docs_per_bin: int | None = None) -> dict[str, StrategyRun]:
    """
    Cut the documents per the `overflow` policy (as `pack_dataset` does) and pack the pieces with each strategy.

    Args:
        lengths (`Sequence[int]` or `np.ndarray`): Tokens per document, e.g. `[7, 3, 3, 2, 1]`.
        max_length (`int`): Tokens per packed row.
        strategies (`Sequence[str]`, *optional*, defaults to `STRATEGIES`): Strategies of `pack_sequences`.
        overflow (`str`, *optional*, defaults to `"split"`): `"error"`, `"truncate"`, `"split"` or `"drop"`.
        seed (`int`, *optional*), max_docs_per_bin (`int`, *optional*): As in `pack_sequences`.

    Returns:
        `dict[str, StrategyRun]`: by strategy, in the order given.

    Example:
    ```python
    >>> runs = compare_strategies([7, 3, 3, 2, 1], 6, ["bfd", "nf"])
    >>> {name: run.result.bin_token_counts.tolist() for name, run in runs.items()}
    {'bfd': [6, 6, 4], 'nf': [6, 4, 6]}
    >>> runs["bfd"].stats.num_sequences, runs["bfd"].stats.split_sequences
    (6, 1)

    ```
    """
    check_max_length(max_length)
    check_overflow_policy(overflow)  # cut_pieces itself would treat an unknown policy as a silent truncation
    pieces = cut_pieces(np.asarray(lengths, dtype=np.int64), max_length, overflow)
    runs = {}
    for strategy in strategies:
        start = time.perf_counter()
        result = pack_sequences(pieces.length, max_length, strategy=strategy, seed=seed,
                                max_docs_per_bin=max_docs_per_bin)
        seconds = time.perf_counter() - start
        runs[strategy] = StrategyRun(result, dataclasses.replace(result.stats, **pieces.counts()), seconds)
    return runs


def format_lengths(lengths: np.ndarray) -> str:
    """One line: documents, tokens, and min / median / mean / p99 / max tokens per document."""
    median, p99 = np.percentile(lengths, [50, 99])
    return (f"documents {len(lengths):,}, tokens {int(lengths.sum()):,}; length min {int(lengths.min()):,}, median "
            f"{median:,.0f}, mean {lengths.mean():,.1f}, p99 {p99:,.0f}, max {int(lengths.max()):,}")


def format_table(runs: dict[str, StrategyRun]) -> str:
    """The stats of every strategy as an aligned text table, one row per strategy."""
    rows = [("strategy", "bins", "efficiency", "padding", "gap to LB", "fill p50", "fill p90", "fill p99", "time")]
    for name, (_, s, seconds) in runs.items():
        rows.append((name, f"{s.num_bins:,}", f"{s.efficiency:.4%}", f"{s.padding_ratio:.4%}",
                     f"{s.gap_to_lower_bound:+.4%}", f"{s.fullness_p50:.2%}", f"{s.fullness_p90:.2%}",
                     f"{s.fullness_p99:.2%}", f"{seconds * 1e3:.1f} ms"))
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    return "\n".join(" ".join(cell.ljust(w) if i == 0 else cell.rjust(w + 1) for i, (cell, w) in
                               enumerate(zip(row, widths, strict=True))) for row in rows)


def plot_packing(lengths: np.ndarray, max_length: int, runs: dict[str, StrategyRun], path: str) -> None:
    """Write a PNG: document length histogram with `max_length` marked, and bin fill histograms per strategy."""
    figure = _agg_figure(figsize=(12, 4.5), layout="constrained")
    left, right = figure.subplots(1, 2)
    positive = lengths[lengths > 0]
    # Document lengths are heavy-tailed: log-spaced bins on a log axis keep both the bulk and the tail readable.
    low, high = (int(positive.min()), int(positive.max())) if positive.size else (1, 1)
    edges = np.geomspace(low, max(high, max_length) * 1.01, 60)
    left.hist(positive, bins=edges, color="tab:blue")
    left.axvline(max_length, color="tab:red", linestyle="--",
                 label=f"max_length = {max_length:,} ({int((lengths > max_length).sum()):,} longer)")
    left.set(xscale="log", xlabel="tokens per document", ylabel="documents",
             title=f"Document lengths ({len(lengths):,} documents)")
    left.legend()
    fills = [run.result.bin_token_counts / max_length for run in runs.values()]
    labels = [f"{name}: {run.stats.num_bins:,} bins, {run.stats.efficiency:.2%}" for name, run in runs.items()]
    # Side-by-side bars, not overlaid: strategies that find the same bins (bfd and ffd often do) stay visible.
    right.hist(fills, bins=np.linspace(0, 1, 21), label=labels)
    right.set(yscale="log", xlim=(0, 1), xlabel="bin fill (tokens / max_length)", ylabel="bins",
              title=f"Bin fill per strategy (lower bound {next(iter(runs.values())).stats.lower_bound_bins:,} bins)")
    right.legend(loc="upper left")
    figure.savefig(path, dpi=120)


def _agg_figure(**kwargs):
    # A bare Figure on an Agg canvas: no pyplot, so the global backend (a caller's notebook, say) is left alone.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ModuleNotFoundError('`--plot` needs matplotlib, which is not installed. Install it with `pip install '
                                  '"llm_packing[plot]"`, or leave out `--plot` for the table alone.') from None
    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def make_parser() -> argparse.ArgumentParser:
    """The flags of `llm-packing stats`; names are the training recipe's keys, with shorter aliases."""
    parser = argparse.ArgumentParser(prog="llm-packing stats", allow_abbrev=False, description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--dataset_name", "--dataset", default="chitchat",
        help="Hub dataset, local json/jsonl/parquet/csv file or folder, or 'chitchat' (built-in demo).")
    add("--dataset_config", help="Configuration name of a hub dataset.")
    add("--dataset_train_split", "--split", default="train", help="Split to read.")
    add("--max_length", required=True, help="Tokens per packed row.")
    add("--strategies", "--packing_strategy", nargs="+", default=list(STRATEGIES),
        help=f"Strategies to compare (default: all of {', '.join(STRATEGIES)}).")
    add("--overflow", default="split",
        help=f"Documents longer than max_length: {', '.join(OVERFLOW_POLICIES)} (default: split, keeps every token; "
        "`llm-packing train` defaults to error).")
    add("--max_docs_per_bin", help="Cap on documents per packed row.")
    add("--packing_seed", "--seed", help="Seed for pairing documents of equal length; default deterministic.")
    add("--max_samples", help="Read only the first this many examples.")
    add("--tokenizer_name_or_path", "--tokenizer", default=DEMO_TOKENIZER_NAME,
        help="Tokenizer for datasets without input_ids ('demo': the built-in Mistral one).")
    add("--dataset_messages_field", "--messages_field", default="messages", help="Column of chat messages.")
    add("--dataset_text_field", "--text_field", default="text", help="Column of plain text (without messages).")
    add("--assistant_only_loss", action="store_true", help="Tokenize with the assistant-marked chat template.")
    add("--plot", metavar="PATH", help="Write a PNG of the length histogram and the bin fill per strategy.")
    return parser


def _int_flag(flag: str, value: str | None, minimum: int) -> int | None:
    # Parsed here rather than by argparse `type=int`, so that a bad value raises PackingValueError, not SystemExit.
    if value is None:
        return None
    number = int(value) if value.removeprefix("-").isdecimal() else value
    check_integer(flag, number, minimum=minimum)
    return number


def document_lengths(args: argparse.Namespace) -> np.ndarray:
    """Tokens per example of the dataset the flags name: its `input_ids` lengths, tokenizing it first if needed."""
    name = args.dataset_name
    dataset = load_documents(name, config=args.dataset_config, split=args.dataset_train_split,
                             max_samples=args.max_samples, key="--dataset_name")
    if len(dataset) == 0:
        raise PackingValueError(f"`--dataset_name` {name!r} (split {args.dataset_train_split!r}) has no examples.")
    columns = dataset.column_names
    if "input_ids" not in columns:
        if args.dataset_messages_field not in columns and args.dataset_text_field not in columns:
            raise PackingValueError(
                f"`--dataset_name` {name!r} has columns {columns}: no 'input_ids', no {args.dataset_messages_field!r} "
                f"(`--dataset_messages_field`), no {args.dataset_text_field!r} (`--dataset_text_field`). Set one of "
                "those two flags to the column of chat messages or text to tokenize."
            )
        dataset = tokenize_documents(dataset, load_tokenizer(args.tokenizer_name_or_path),
                                     messages_field=args.dataset_messages_field, text_field=args.dataset_text_field,
                                     assistant_only_loss=args.assistant_only_loss)
    column = dataset.with_format("arrow")[:].column("input_ids")  # honours the row selection of `max_samples`
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or column.null_count:
        raise PackingValueError(f"Column 'input_ids' of `--dataset_name` {name!r} must hold token id lists, got "
                                f"{column.type} with {column.null_count} null rows. Fix it, or drop it to tokenize.")
    return pc.list_value_length(column).to_numpy().astype(np.int64)


def main(argv: list[str] | None = None) -> dict[str, StrategyRun]:
    """Run `llm-packing stats` with the flags in `argv` (default `sys.argv[1:]`); returns the runs by strategy."""
    args = make_parser().parse_args(argv)
    max_length = _int_flag("--max_length", args.max_length, 1)
    args.max_samples = _int_flag("--max_samples", args.max_samples, 1)
    seed = _int_flag("--packing_seed", args.packing_seed, 0)
    max_docs_per_bin = _int_flag("--max_docs_per_bin", args.max_docs_per_bin, 1)
    unknown = [name for name in args.strategies if name not in STRATEGIES]
    if unknown:
        raise PackingValueError(f"`--strategies` got unknown {unknown}; choose from {', '.join(STRATEGIES)}.")
    check_overflow_policy(args.overflow)
    # Fail before tokenizing (minutes on a large dataset), not after.
    if args.plot:
        _agg_figure()
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            raise PackingValueError(f"`--plot` {args.plot!r} is in a folder that does not exist. Create it first.")
    lengths = document_lengths(args)
    runs = compare_strategies(lengths, max_length, list(dict.fromkeys(args.strategies)), overflow=args.overflow,
                              seed=seed, max_docs_per_bin=max_docs_per_bin)
    stats = next(iter(runs.values())).stats
    # PackingStats' own "overflow: ..." line says what was cut; it is absent when nothing was.
    cut = next((line.removeprefix("overflow: ") for line in str(stats).splitlines()[3:]), "nothing cut")
    print(format_lengths(lengths))
    print(f"packed: {stats.num_sequences:,} sequences into rows of {max_length:,} tokens (lower bound "
          f"{stats.lower_bound_bins:,} bins); --overflow {args.overflow}: {cut}")
    print(format_table(runs))
    if args.plot:
        plot_packing(lengths, max_length, runs, args.plot)
        print(f"plot written to {args.plot}")
    return runs
