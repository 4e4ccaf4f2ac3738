"""`plan_rows` and its parts (streamed counting sort, templates, local order): the rows the per-item engine and the
former `local_order` gave, from a plan that holds ~10 bytes a document."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llm_packing.core import length_sort
from llm_packing.core.binpack import pack_sequences
from llm_packing.core.length_sort import ids_by_key, length_keys, take_in_turn
from llm_packing.core.locality import local_order
from llm_packing.core.plan import plan_rows
from llm_packing.errors import PackingValueError, SequenceTooLongError


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 items: every streamed step runs over many chunks, with groups cut across them."""
    monkeypatch.setattr(length_sort, "CHUNK", 7)


# The `local_order` of before the plan kept templates (commit 6b9521c), verbatim but for names: the reference.
_GOLDEN = 0.6180339887498949


def reference_local_order(order, bin_offsets, lengths, addresses):
    if len(bin_offsets) < 3:
        return order, bin_offsets
    if np.all(addresses[1:] >= addresses[:-1]):
        documents = np.argsort(lengths, kind="stable")
    else:
        documents = np.lexsort((addresses, lengths))
    order, bin_offsets = _rebind(order, bin_offsets, _spread(lengths[order], bin_offsets), lengths, documents)
    mean_address = np.add.reduceat(addresses[order].astype(np.float64), bin_offsets[:-1]) / np.diff(bin_offsets)
    return _rebind(order, bin_offsets, np.argsort(mean_address, kind="stable"), lengths, documents)


def _rebind(order, bin_offsets, bins, lengths, documents):
    counts = np.diff(bin_offsets)
    new_offsets = np.concatenate([[0], np.cumsum(counts[bins])])
    moved = np.repeat(bin_offsets[:-1][bins] - new_offsets[:-1], counts[bins]) + np.arange(len(order))
    slots = np.argsort(lengths[order[moved]], kind="stable")
    new_order = np.empty_like(order)
    new_order[slots] = documents
    return new_order, new_offsets


def _spread(slot_lengths, bin_offsets):
    x = slot_lengths.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    shape = np.add.reduceat(x ^ (x >> np.uint64(31)), bin_offsets[:-1])
    by_shape = np.argsort(shape, kind="stable")
    sorted_shape = shape[by_shape]
    firsts = np.concatenate([[0], np.flatnonzero(sorted_shape[1:] != sorted_shape[:-1]) + 1])
    sizes = np.diff(np.concatenate([firsts, [len(shape)]]))
    copy = np.arange(len(shape)) - np.repeat(firsts, sizes)
    place = np.empty(len(shape))
    place[by_shape] = (copy + (by_shape * _GOLDEN) % 1.0) / np.repeat(sizes, sizes)
    return np.argsort(place, kind="stable")


def lognormal_lengths(count, seed=0, max_length=4096):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(250), 1.0, count)), 1, max_length).astype(np.uint16)


def bin_shapes(order, bin_offsets, lengths):
    return sorted(tuple(sorted(lengths[order[a:b]])) for a, b in zip(bin_offsets[:-1], bin_offsets[1:], strict=True))


instances = st.integers(1, 40).flatmap(
    lambda capacity: st.tuples(st.lists(st.integers(1, capacity), min_size=1, max_size=80), st.just(capacity))
)


class TestLengthSort:
    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.integers(0, 20), max_size=60))
    def test_ids_by_key_is_a_stable_argsort(self, keys):
        keys = np.array(keys, np.uint16)
        expected = np.argsort(keys, kind="stable")
        for chunk in (7, 1 << 20):
            length_sort.CHUNK = chunk
            try:
                ids = ids_by_key(keys, np.bincount(keys, minlength=21))
            finally:
                length_sort.CHUNK = 1 << 20
            assert ids.dtype == np.uint32 and ids.tolist() == expected.tolist()

    def test_long_lengths_are_keyed_by_rank(self):
        lengths = np.array([1 << 25, 3, 1 << 25, 7])
        sizes, counts, keys, histogram = length_keys(lengths, int(lengths.max()))
        assert sizes.tolist() == [3, 7, 1 << 25] and counts.tolist() == [1, 1, 2] and keys.tolist() == [2, 0, 2, 1]
        assert ids_by_key(keys, histogram).tolist() == [1, 3, 0, 2]

    def test_take_in_turn_continues_across_chunks(self):
        pooled, starts = np.arange(10, 16), np.array([0, 2])  # key 0: 10, 11; key 1: 12..15
        assert take_in_turn(np.array([1, 0, 1]), starts, pooled).tolist() == [12, 10, 13]
        assert take_in_turn(np.array([1, 1, 0]), starts, pooled).tolist() == [14, 15, 11]


class TestPlanRows:
    @pytest.mark.parametrize("strategy", ["bfd", "ffd", "wfd"])
    @pytest.mark.parametrize("mapped", [False, True])
    def test_the_rows_of_the_engine_in_the_former_local_order(self, strategy, mapped, small_chunks):
        lengths = lognormal_lengths(3000, max_length=1024)
        addresses = np.random.default_rng(1).permutation(len(lengths)) * 3 if mapped else None
        plan = plan_rows(lengths, 1024, strategy=strategy, addresses=addresses)
        engine = pack_sequences(lengths, 1024, strategy=strategy)
        expected = reference_local_order(engine.order, engine.bin_offsets, lengths.astype(np.int64),
                                         np.arange(len(lengths)) if addresses is None else addresses)
        assert plan.order.dtype == np.uint32 and plan.bin_offsets.dtype == np.int64
        assert plan.order.tolist() == expected[0].tolist() and plan.bin_offsets.tolist() == expected[1].tolist()
        assert plan.tokens_per_bin.tolist() == np.add.reduceat(lengths[plan.order].astype(int),
                                                               plan.bin_offsets[:-1]).tolist()
        assert plan.stats == engine.stats

    @settings(max_examples=200, deadline=None)
    @given(instances, st.none() | st.integers(1, 5), st.sampled_from(["bfd", "ffd", "wfd"]), st.booleans())
    def test_any_instance_matches_the_reference(self, instance, max_docs, strategy, mapped):
        lengths, capacity = instance
        lengths = np.array(lengths)
        addresses = np.random.default_rng(len(lengths)).integers(0, 5, len(lengths)) if mapped else None
        plan = plan_rows(lengths, capacity, strategy=strategy, max_docs_per_bin=max_docs, addresses=addresses)
        engine = pack_sequences(lengths, capacity, strategy=strategy, max_docs_per_bin=max_docs)
        expected = reference_local_order(engine.order, engine.bin_offsets, lengths,
                                         np.arange(len(lengths)) if addresses is None else addresses)
        assert plan.order.tolist() == expected[0].tolist() and plan.bin_offsets.tolist() == expected[1].tolist()

    def test_local_order_still_matches_the_reference(self):
        lengths = lognormal_lengths(4000, max_length=2048).astype(np.int64)
        addresses = np.random.default_rng(2).permutation(len(lengths))
        engine = pack_sequences(lengths, 2048, strategy="wfd")
        for where in (addresses, np.arange(len(lengths)) * 5):
            got = local_order(engine.order, engine.bin_offsets, lengths, where)
            expected = reference_local_order(engine.order, engine.bin_offsets, lengths, where)
            assert got[0].dtype == np.int64 and all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))

    @pytest.mark.parametrize("strategy", ["bfd", "ffd", "wfd", "nf"])
    def test_seeded_rows_are_the_same_bins_paired_at_random(self, strategy, small_chunks):
        lengths = np.random.default_rng(3).integers(1, 40, 600).astype(np.uint16)
        unseeded = plan_rows(lengths, 64, strategy=strategy)
        first, again, other = (plan_rows(lengths, 64, strategy=strategy, seed=seed) for seed in (7, 7, 8))
        assert np.array_equal(first.order, again.order) and np.array_equal(first.bin_offsets, again.bin_offsets)
        assert not np.array_equal(first.order, other.order) and not np.array_equal(first.order, unseeded.order)
        engine = pack_sequences(lengths, 64, strategy=strategy)
        for plan in (first, other, unseeded):
            assert np.array_equal(np.sort(plan.order), np.arange(len(lengths)))
            assert bin_shapes(plan.order, plan.bin_offsets, lengths) == bin_shapes(engine.order, engine.bin_offsets,
                                                                                   lengths)

    def test_next_fit_is_the_engine_plan(self):
        lengths = np.array([4, 4, 1, 5, 2, 2])
        plan = plan_rows(lengths, 6, strategy="nf")
        assert plan.order.tolist() == [0, 1, 2, 3, 4, 5] and plan.bin_offsets.tolist() == [0, 1, 3, 4, 6]

    def test_one_bin_and_no_documents(self):
        assert plan_rows(np.array([2, 3, 2]), 8).order.tolist() == pack_sequences([2, 3, 2], 8).order.tolist()
        empty = plan_rows(np.zeros(0, np.uint16), 8)
        assert empty.order.tolist() == [] and empty.bin_offsets.tolist() == [0] and empty.stats.num_bins == 0

    def test_refuses_what_pack_sequences_refuses(self):
        with pytest.raises(SequenceTooLongError, match=r"longer than `capacity`=4"):
            plan_rows(np.array([3, 5]), 4)
        with pytest.raises(PackingValueError, match=r"must be positive"):
            plan_rows(np.array([3, 0]), 4)
