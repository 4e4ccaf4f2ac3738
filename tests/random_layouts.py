"""Packed layouts drawn at random for the parity matrix (tests/test_parity.py), each from a seed that a failure prints.

A layout is a row length and, per row, the lengths of its documents; what a row leaves over is trailing padding. The
fixed layout of `tiny_models.PACKED_DOCUMENT_LENGTHS` proves that layout only: the sparse key indexers' `topk` keeps
other tied keys when a document moves within its row or the row grows (issue 25), which it never showed. Each layout
here has three rows of different fill, drawn by kind: a long row (a document longer than `SMALLEST_BUCKET`, the
varlen route's and the mixers' bucket boundary, itself longer than every window of the tiny configs: see
`longest_window`), then two of: one document filling the row, many tiny documents, mostly one-token documents, and
random lengths; the kinds rotate with the seed, so that two consecutive seeds of this family draw every kind. Every
third seed draws a batch of another family instead: rows of one document each, most with trailing padding,
consecutive rows often of the same length (a batch whose mask holds no document id above 1, which transformers' own
padded path runs: issue 35's glm_moe_dsa leak was there).

Documents are prefixes of `BASE_SEQUENCES` (a document's tokens: the first `length` tokens of one of them), so that
one forward of the base sequences gives the reference of every document of every layout where the model is causal
and length-independent (see test_parity's `References`, which checks that property). Consecutive documents of a
layout take different base sequences, whose first tokens all differ: no two neighbouring one-token documents are the
same token, which would hide a leak between them.
"""

import dataclasses
import random

import torch
from tiny_models import VOCAB_SIZE

from llm_packing.hook.documents import SMALLEST_BUCKET


ROW_LENGTHS = (36, 40, 48)
MAX_ROW_LENGTH = max(ROW_LENGTHS)
BASE_SEQUENCE_COUNT = 12
# The other row kinds, two per layout after the long row; `draw_layout` rotates through them.
ROW_KINDS = ("filled", "tiny", "one_token", "mixed")
# Config fields that bound a span of tokens a document must cross: sliding windows, attention chunks, the sparse
# indexers' top-k and token budgets, convolution kernels, SSM chunks, lightning-attention blocks and the positions
# over which Llama 4's attention temperature steps.
WINDOW_FIELDS = (
    "sliding_window", "attention_chunk_size", "window_size", "attention_window_size", "index_topk", "indexer_budget",
    "conv_kernel", "d_conv", "mamba_d_conv", "conv_L_cache", "linear_conv_kernel_dim", "short_conv_kernel_size",
    "conv_size", "chunk_size", "mamba_chunk_size", "block_size", "floor_scale",
)  # fmt: skip


def _base_sequences() -> torch.Tensor:
    generator = torch.Generator().manual_seed(25)
    sequences = torch.randint(3, VOCAB_SIZE, (BASE_SEQUENCE_COUNT, MAX_ROW_LENGTH), generator=generator)
    sequences[:, 0] = torch.randperm(VOCAB_SIZE - 3, generator=generator)[:BASE_SEQUENCE_COUNT] + 3
    return sequences


BASE_SEQUENCES = _base_sequences()


@dataclasses.dataclass(frozen=True)
class Layout:
    """`rows[r]`: the document lengths of row `r`, in order; `seed` names the draw (None for a fixed layout)."""

    row_length: int
    rows: tuple[tuple[int, ...], ...]
    seed: int | None = None

    def __str__(self) -> str:
        drawn = f"draw_layout({self.seed})" if self.seed is not None else "a fixed layout"
        return f"{drawn}: row length {self.row_length}, documents {[list(row) for row in self.rows]}"


# Issue 25's row (documents of 6, 1, 1, 11, 2 and 3 tokens), with a row of one document filling it.
ISSUE_25_LAYOUT = Layout(24, ((6, 1, 1, 11, 2, 3), (24,)))


def draw_layout(seed: int) -> Layout:
    """The layout of `seed`: three rows of different fill, or every third seed rows of one document each (see the
    module docstring)."""
    rng = random.Random(seed)
    row_length = rng.choice(ROW_LENGTHS)
    if seed % 3 == 2:
        return Layout(row_length, _single_document_rows(rng, row_length), seed)
    kinds = ("long", ROW_KINDS[(2 * seed) % 4], ROW_KINDS[(2 * seed + 1) % 4])
    rows, fills = [], set()
    for kind in kinds:
        lengths = _row(rng, kind, row_length)
        while sum(lengths) in fills:  # rows of different fill: cut the last document, or drop it
            lengths[-1] -= 1
            if not lengths[-1]:
                lengths.pop()
        fills.add(sum(lengths))
        rows.append(tuple(lengths))
    return Layout(row_length, tuple(rows), seed)


def _single_document_rows(rng: random.Random, row_length: int) -> tuple[tuple[int, ...], ...]:
    """Two to four rows of one document each: the first past the bucket boundary with trailing padding, each other
    the same length as the row before it, the row's length, or any length."""
    lengths = [rng.randint(SMALLEST_BUCKET + 1, row_length - 1)]
    for _ in range(rng.randint(1, 3)):
        lengths.append(rng.choice((lengths[-1], row_length, rng.randint(1, row_length - 1))))
    return tuple((length,) for length in lengths)


def _row(rng: random.Random, kind: str, row_length: int) -> list[int]:
    if kind == "filled":
        return [row_length]
    if kind == "long":  # one document past the bucket boundary, shorter ones around it, trailing padding
        fill = rng.randint(SMALLEST_BUCKET + 2, row_length - 1)
        long = rng.randint(SMALLEST_BUCKET + 1, fill - 1)
        lengths = [long] + _fill(rng, fill - long, lambda: rng.randint(1, 8))
        rng.shuffle(lengths)
        return lengths
    if kind == "tiny":
        return _fill(rng, rng.randint(row_length // 2, row_length - 1), lambda: rng.randint(1, 3))
    if kind == "one_token":  # mostly one-token documents, a few past the tiny windows
        return _fill(rng, row_length - rng.randint(0, 3), lambda: 1 if rng.random() < 0.75 else rng.randint(5, 12))
    return _fill(rng, row_length, lambda: rng.randint(1, row_length // 2))  # "mixed": any lengths, no padding


def _fill(rng: random.Random, total: int, draw) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(draw(), total - sum(lengths)))
    return lengths


def longest_window(config) -> int:
    """The largest of `WINDOW_FIELDS` in `config` and its nested configs."""
    found, pending, seen = [1], [config], set()
    while pending:
        part = pending.pop()
        if id(part) in seen:
            continue
        seen.add(id(part))
        found += [
            value for name in WINDOW_FIELDS
            if isinstance(value := getattr(part, name, None), int) and value > 0
        ]
        pending += [value for value in vars(part).values() if hasattr(value, "to_dict")]
    return max(found)


def packed_layout_batch(layout: Layout) -> dict:
    """The packed batch of `layout`, in `tiny_models.packed_batch`'s format, whose `documents` also name each
    document's base sequence: per row, `(start, length, base)`."""
    rows = len(layout.rows)
    input_ids = torch.zeros(rows, layout.row_length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    position_ids = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    documents, count = [], 0
    for row, lengths in enumerate(layout.rows):
        start, spans = 0, []
        for index, length in enumerate(lengths, start=1):
            base = count % BASE_SEQUENCE_COUNT
            count += 1
            input_ids[row, start : start + length] = BASE_SEQUENCES[base, :length]
            attention_mask[row, start : start + length] = index
            position_ids[row, start : start + length] = torch.arange(length)
            labels[row, start + 1 : start + length] = BASE_SEQUENCES[base, 1:length]
            spans.append((start, length, base))
            start += length
        input_ids[row, start:] = 3 + row  # padding tokens: any id; the mask hides them
        documents.append(spans)
    return {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels,
        "documents": documents,
    }
