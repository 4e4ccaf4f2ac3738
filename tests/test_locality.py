"""`local_order`: the same bins, in an order whose runs of rows each read one stretch of the input."""

import numpy as np
import pytest
from datasets import Dataset

from llm_packing.core.binpack import pack_sequences
from llm_packing.core.locality import local_order
from llm_packing.data.pack import pack_dataset


def lognormal_lengths(count, seed=0, max_length=4096):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(250), 1.0, count)), 1, max_length).astype(np.int64)


def bin_shapes(order, bin_offsets, lengths):
    return sorted(tuple(sorted(lengths[order[a:b]])) for a, b in zip(bin_offsets[:-1], bin_offsets[1:], strict=True))


def run_spread(order, bin_offsets, addresses, runs=10):
    """The median, over `runs` equal runs of rows, of the spread (5th to 95th percentile) of their documents'
    addresses, as a fraction of the input."""
    doc_run = np.repeat(np.arange(len(bin_offsets) - 1) * runs // (len(bin_offsets) - 1), np.diff(bin_offsets))
    spreads = [np.subtract(*np.percentile(addresses[order[doc_run == run]], [95, 5])) for run in range(runs)]
    return float(np.median(spreads)) / addresses.max()


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "wfd"])
def test_same_bins_every_document_once_equal_lengths_in_address_order(strategy):
    lengths = lognormal_lengths(5000, max_length=1024)
    addresses = np.random.default_rng(1).permutation(len(lengths)) * 7  # an indices mapping: not input order
    plan = pack_sequences(lengths, 1024, strategy=strategy)
    order, bin_offsets = local_order(plan.order, plan.bin_offsets, lengths, addresses)
    assert np.array_equal(np.sort(order), np.arange(len(lengths)))
    assert bin_offsets[0] == 0 and bin_offsets[-1] == len(lengths)
    assert bin_shapes(order, bin_offsets, lengths) == bin_shapes(plan.order, plan.bin_offsets, lengths)
    for length in np.unique(lengths):
        along_rows = addresses[order[lengths[order] == length]]
        assert np.all(np.diff(along_rows) > 0)


def test_runs_of_rows_read_one_stretch_of_the_input():
    # The engine's order takes every run of a tenth of the rows from all over the input (90% of its documents spread
    # over 91% of it); the local order from a quarter of it (24%).
    lengths = lognormal_lengths(100_000)
    addresses = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    plan = pack_sequences(lengths, 4096)
    assert run_spread(plan.order, plan.bin_offsets, addresses) > 0.8
    order, bin_offsets = local_order(plan.order, plan.bin_offsets, lengths, addresses)
    assert run_spread(order, bin_offsets, addresses) < 0.3


def test_deterministic_and_small_plans_keep_their_rows():
    lengths = lognormal_lengths(2000, max_length=1024)
    plan = pack_sequences(lengths, 1024)
    addresses = np.arange(len(lengths))
    first, second = (local_order(plan.order, plan.bin_offsets, lengths, addresses) for _ in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    single = pack_sequences([3, 2], 8)
    assert local_order(single.order, single.bin_offsets, np.array([3, 2]), np.arange(2)) == (
        single.order, single.bin_offsets)


def test_pack_dataset_rows_follow_the_input_unless_seeded():
    # Each document's ids are its row number: a packed row's ids say where its documents lie in the input.
    lengths = lognormal_lengths(20_000, max_length=2048)
    ds = Dataset.from_dict({"input_ids": [[row] * int(n) for row, n in enumerate(lengths)]})
    for seed, spread in ((None, lambda s: s < 0.5), (3, lambda s: s > 0.8)):  # measured: 0.41, 0.90
        packed = pack_dataset(ds, 2048, seed=seed)
        sources = np.array([ids[0] for row in packed["input_ids"] for ids in _documents(row)])
        counts = np.array([len(row) for row in packed["seq_lengths"]])
        assert np.array_equal(np.sort(sources), np.arange(len(lengths)))
        assert spread(run_spread(np.arange(len(sources)), np.concatenate([[0], np.cumsum(counts)]), sources))


def _documents(ids):
    """A packed row's documents, cut where the id changes (each document's ids are one row number)."""
    cuts = np.flatnonzero(np.diff(ids)) + 1
    return np.split(np.asarray(ids), cuts)
