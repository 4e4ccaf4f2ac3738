import dataclasses

import pytest

from llm_packing.core.stats import PackingStats


class TestPackingStats:
    def test_hand_example(self):
        # Bins of capacity 10 holding 10, 9, 7 and 4 tokens: 30 of 40 slots used, ceil(30 / 10) = 3 bins needed.
        stats = PackingStats.from_bin_token_counts([10, 9, 7, 4], num_sequences=9, capacity=10)
        assert (stats.num_bins, stats.num_sequences, stats.num_tokens, stats.capacity) == (4, 9, 30, 10)
        assert stats.efficiency == 0.75
        assert stats.padding_ratio == 0.25
        assert stats.lower_bound_bins == 3
        assert stats.gap_to_lower_bound == pytest.approx(1 / 3)
        # Fullness sorted: 0.4, 0.7, 0.9, 1.0. Linear percentiles at ranks 1.5, 2.7 and 2.97 of 0..3.
        assert stats.fullness_p50 == pytest.approx(0.8)
        assert stats.fullness_p90 == pytest.approx(0.97)
        assert stats.fullness_p99 == pytest.approx(0.997)
        assert (stats.dropped_sequences, stats.truncated_tokens, stats.empty_sequences) == (0, 0, 0)

    def test_zero_bins(self):
        stats = PackingStats.from_bin_token_counts([], num_sequences=0, capacity=4096)
        assert (stats.num_bins, stats.num_tokens, stats.lower_bound_bins) == (0, 0, 0)
        assert (stats.efficiency, stats.padding_ratio, stats.fullness_p50, stats.fullness_p99) == (0.0, 0.0, 0.0, 0.0)
        assert stats.gap_to_lower_bound == 0.0
        assert str(stats).startswith("0 sequences, 0 tokens -> 0 bins of 4,096 tokens")

    def test_values_are_plain_python(self):
        stats = PackingStats.from_bin_token_counts([3, 5], num_sequences=2, capacity=8)
        assert all(type(value) in (int, float) for value in stats.to_dict().values())

    def test_to_dict_round_trips(self):
        stats = PackingStats.from_bin_token_counts([3, 5], num_sequences=2, capacity=8)
        assert stats.to_dict()["efficiency"] == 0.5
        assert PackingStats(**stats.to_dict()) == stats

    def test_str(self):
        stats = PackingStats.from_bin_token_counts([4096, 4000], num_sequences=30, capacity=4096)
        assert str(stats) == (
            "30 sequences, 8,096 tokens -> 2 bins of 4,096 tokens\n"
            "efficiency 98.8281% (padding 1.1719%), lower bound 2 bins (+0.0000%)\n"
            "bin fullness p50 98.83%, p90 99.77%, p99 99.98%"  # 4000 / 4096 = 97.66%, then 100%
        )

    def test_str_reports_overflow(self):
        stats = dataclasses.replace(
            PackingStats.from_bin_token_counts([5], num_sequences=1, capacity=8),
            dropped_sequences=2, dropped_tokens=30, truncated_sequences=1, truncated_tokens=4, empty_sequences=3,
        )
        assert str(stats).splitlines()[-1] == "overflow: 2 dropped (30 tokens), 1 truncated (4 tokens cut), 3 empty"
