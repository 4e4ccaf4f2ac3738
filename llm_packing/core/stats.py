"""`PackingStats`: how tight a packing is (bins, efficiency, fullness percentiles, gap to the token lower bound) and
what the overflow policy cut.

Built from the tokens per bin in one vectorised pass (a partition for the percentiles); never divides by zero.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackingStats:
    """
    Summary of a packing: `num_tokens` tokens of `num_sequences` sequences in `num_bins` bins of `capacity` tokens.

    Args:
        num_bins (`int`): Bins (packed rows).
        num_sequences (`int`): Sequences (documents or pieces of documents) packed.
        num_tokens (`int`): Tokens packed.
        capacity (`int`): Tokens per bin.
        efficiency (`float`): `num_tokens / (num_bins * capacity)`, `0.0` without bins.
        padding_ratio (`float`): Share of bin slots left as padding, `1 - efficiency` (`0.0` without bins).
        fullness_p50 (`float`), fullness_p90 (`float`), fullness_p99 (`float`):
            Percentiles (linear interpolation) of the bin fullness `tokens / capacity`, `0.0` without bins.
        lower_bound_bins (`int`): `ceil(num_tokens / capacity)`: no packing needs fewer bins.
        dropped_sequences (`int`), dropped_tokens (`int`):
            Sequences over `max_length` left out by `overflow="drop"`, and their tokens.
        truncated_sequences (`int`), truncated_tokens (`int`):
            Sequences cut by `overflow="truncate"`, and the tokens cut off.
        split_sequences (`int`): Sequences cut into several pieces by `overflow="split"`.
        empty_sequences (`int`): Sequences without tokens, left out.
    """

    num_bins: int
    num_sequences: int
    num_tokens: int
    capacity: int
    efficiency: float
    padding_ratio: float
    fullness_p50: float
    fullness_p90: float
    fullness_p99: float
    lower_bound_bins: int
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    truncated_sequences: int = 0
    truncated_tokens: int = 0
    split_sequences: int = 0
    empty_sequences: int = 0

    @classmethod
    def from_bin_token_counts(cls, bin_token_counts, *, num_sequences: int, capacity: int) -> "PackingStats":
        """
        Compute the stats from the tokens in each bin.

        Args:
            bin_token_counts (`Sequence[int]` or `np.ndarray`):
                Tokens per bin, e.g. `[6, 6, 3]`.
            num_sequences (`int`):
                Sequences in all bins together.
            capacity (`int`):
                Tokens per bin.

        Example:
        ```python
        >>> stats = PackingStats.from_bin_token_counts([6, 6, 3], num_sequences=5, capacity=6)
        >>> stats.num_bins, stats.num_tokens, stats.efficiency, stats.lower_bound_bins, stats.gap_to_lower_bound
        (3, 15, 0.8333333333333334, 3, 0.0)
        >>> stats.fullness_p50, stats.fullness_p90
        (1.0, 1.0)

        ```
        """
        counts = np.asarray(bin_token_counts, dtype=np.int64)
        num_bins, num_tokens = int(counts.size), int(counts.sum())
        if num_bins:
            slots = num_bins * capacity
            efficiency, padding_ratio = num_tokens / slots, (slots - num_tokens) / slots
            p50, p90, p99 = np.percentile(counts / capacity, [50, 90, 99]).tolist()
        else:
            efficiency = padding_ratio = p50 = p90 = p99 = 0.0
        return cls(
            num_bins=num_bins, num_sequences=int(num_sequences), num_tokens=num_tokens, capacity=int(capacity),
            efficiency=efficiency, padding_ratio=padding_ratio, fullness_p50=p50, fullness_p90=p90,
            fullness_p99=p99, lower_bound_bins=-(-num_tokens // int(capacity)),
        )

    @property
    def gap_to_lower_bound(self) -> float:
        """`num_bins / lower_bound_bins - 1`: `0.0` is optimal, `0.0001` is 0.01% more bins than any packing needs."""
        return self.num_bins / self.lower_bound_bins - 1 if self.lower_bound_bins else 0.0

    def to_dict(self) -> dict[str, int | float]:
        """The fields as a plain `dict` (JSON- and logger-friendly; `PackingStats(**d)` rebuilds the stats)."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [
            f"{self.num_sequences:,} sequences, {self.num_tokens:,} tokens -> {self.num_bins:,} bins of "
            f"{self.capacity:,} tokens",
            f"efficiency {self.efficiency:.4%} (padding {self.padding_ratio:.4%}), lower bound "
            f"{self.lower_bound_bins:,} bins ({self.gap_to_lower_bound:+.4%})",
            f"bin fullness p50 {self.fullness_p50:.2%}, p90 {self.fullness_p90:.2%}, p99 {self.fullness_p99:.2%}",
        ]
        cut = [
            f"{self.dropped_sequences:,} dropped ({self.dropped_tokens:,} tokens)" if self.dropped_sequences else "",
            f"{self.truncated_sequences:,} truncated ({self.truncated_tokens:,} tokens cut)"
            if self.truncated_sequences else "",
            f"{self.split_sequences:,} split" if self.split_sequences else "",
            f"{self.empty_sequences:,} empty" if self.empty_sequences else "",
        ]
        if any(cut):
            lines.append("overflow: " + ", ".join(part for part in cut if part))
        return "\n".join(lines)
