"""The limits of `verify_packing` and `measure_packing`: how far packed outputs may sit from the documents alone.

A limit is `max(base, NOISE_MARGIN x floor)`. The floor is the model's own floating-point noise, measured on the spot
(each document followed by unrelated tokens, no packing, against the document alone); the base only stands in for
noise the floor rows happen not to show. On the tiny model of every supported type (float32 and bfloat16, three
layouts, two seeds each) the configured model's packed difference is at most 1.6 times its floor, and no floor is 0
where the packed difference is not. The logits' base is relative to the largest logit alone (float32: 8 to 17 units
in the last place there), so that a model whose noise is far below the parity matrix's 1e-5 (most tiny float32
models: 1e-7 to 6e-6) is held to that noise, not to a fixed number: verify then catches every leak the parity matrix
catches, and smaller ones (`benchmarks/results/verify_leaks.md`).

One floor for all documents, not one per document: per document, SmolLM2-135M's configured difference reaches 2.1
times that document's floor in float32 (1.6 in bfloat16), which would leave `NOISE_MARGIN` too little headroom.
"""

from dataclasses import dataclass

import torch


# Packed outputs may differ from the alone ones by this many times the noise floor. On SmolLM2-135M (CPU, sdpa and
# eager, seeds 0-7, benchmarks/results/verify_noise_floor.md) the configured model differs by up to 2.8 times the floor
# (float32 eager seed 1, 0.93 of its limit); in half precision by at most 0.19 of the limit. The unconfigured one
# exceeds the limit 2.4-14.3 times in bfloat16 (not on sdpa seeds 4 and 7, whose floor one unstable token raises to
# 24-26 logits), 16-54 times in float16 and over 5,900 times in float32 (transformers 5.24).
NOISE_MARGIN = 3.0
# The logits' base, times the largest |logit| of the documents alone: 8 to 17 units in the last place of float32 at
# that scale, 2 to 4 of bfloat16 (configured, the tiny model of every supported type stays below 0.46 and 0.33 of the
# limits these give with the floor, eager and sdpa, seeds 0-2; before issue 35 the base was 1e-4 and 5e-2, whatever
# the scale).
LOGITS_BASE = {torch.float32: 1e-6, torch.float64: 1e-6}
HALF_LOGITS_BASE = 2**-6
# The gradients' base, of the largest alone gradient entry: the parity matrix's 1e-5 in float32. Gradient noise follows
# the floor less closely than the logits' does: on tiny models configured differences reach 4 times their floor
# (exaone_moe: 9.5e-7 against 2.4e-7), and 9e-6 at most (gemma4_unified_text, whose floor is 8.9e-6).
GRADIENTS_BASE = {torch.float32: 1e-5, torch.float64: 1e-5}
HALF_GRADIENTS_BASE = 5e-2


@dataclass(frozen=True)
class Comparison:
    """
    Packed against alone for one quantity (logits, or gradients relative to their largest entry).

    Attributes: `difference` (largest absolute difference), `limit` (largest accepted), `floor` (the model's own noise:
    the same documents followed by unrelated tokens, no packing; `None` when the limit was given), `explained` (how
    the limit was set, in words).
    """

    difference: float
    limit: float
    floor: float | None
    explained: str

    @property
    def exact(self) -> bool:
        return self.difference <= self.limit


@dataclass(frozen=True)
class PackingMeasurement:
    """What [`~llm_packing.hook.verify.measure_packing`] found: the logits' [`Comparison`], and the gradients' one when
    asked for."""

    logits: Comparison
    gradients: Comparison | None = None

    @property
    def exact(self) -> bool:
        return self.logits.exact and (self.gradients is None or self.gradients.exact)


def compare(name: str, packed, followed, alone, atol: float | None, *, dtype: torch.dtype) -> Comparison:
    """
    The [`Comparison`] of `packed` against `alone` (per document, tensors of one shape each), its limit `atol` or
    calibrated on `followed` (the noise-floor rows' documents). `name` is `"logits"` (the base is relative to their
    largest alone entry) or `"gradients"` (already relative to the largest alone gradient entry).

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.verify_limits import compare
    >>> alone = [torch.tensor([[0.5, -0.25]])]
    >>> packed, followed = [alone[0] + 2**-20], [alone[0] + 2**-21]
    >>> compared = compare("logits", packed, followed, alone, None, dtype=torch.float32)
    >>> compared.exact, compared.difference
    (True, 9.5367431640625e-07)
    >>> compared.explained
    'limit 1.43e-06 = max(1e-06 x the largest alone |logit| 0.5, 3 x the noise floor 4.77e-07 of float32)'

    ```
    """
    difference = _largest(packed, alone)
    if atol is not None:
        return Comparison(difference, atol, None, f"atol {atol:g}")
    floor = _largest(followed, alone)
    if name == "logits":
        scale = max((tensor.abs().max().item() for tensor in alone if tensor.numel()), default=0.0)
        relative = LOGITS_BASE.get(dtype, HALF_LOGITS_BASE)
        base, base_explained, unit = relative * scale, f"{relative:g} x the largest alone |logit| {scale:.3g}", ""
    else:
        base = GRADIENTS_BASE.get(dtype, HALF_GRADIENTS_BASE)
        base_explained, unit = f"{base:g}", " of the largest alone gradient"
    limit = max(base, NOISE_MARGIN * floor)
    explained = (f"limit {limit:.3g}{unit} = max({base_explained}, {NOISE_MARGIN:g} x the noise floor {floor:.3g} of "
                 f"{str(dtype).removeprefix('torch.')})")
    return Comparison(difference, limit, floor, explained)


def _largest(side, alone) -> float:
    return max(((s - a).abs().max().item() for s, a in zip(side, alone, strict=True) if a.numel()), default=0.0)
