"""The routes `llm-packing verify` checks, each measured on its own: the packed rows it builds, one route's run
(switch the backend, configure, measure, undo) and its entry in the report.

A route is an attention backend, and for sdpa the way packed rows attend (`varlen`: each document's own causal block;
`dense`: transformers' `L x L` packed mask). A route ends in one status:
- `exact`: logits (and gradients, where the backend has a backward here) within the calibrated limit;
- `contaminated`: over it: documents reach each other;
- `refused`: `configure_packing` refuses this model or backend (the reason says why);
- `unavailable`: transformers cannot switch to the backend here (its kernel is not installed, or needs CUDA);
- `failed`: the forward raised; the error is the reason.
"""

import importlib.util
import time

from ..errors import PackingError
from ..hook import mixers, rotary
from ..hook.attention import temperature
from ..hook.attention.flash_op import FLASH_DTYPES, flash_varlen_op
from ..hook.autocast import computed_dtype
from ..hook.configure import configure_packing, unconfigure_packing
from ..hook.support.architectures import sdpa_route
from ..hook.support.model_types import causal_lm_model_type
from ..hook.verify import measure_packing
from ..hook.verify_limits import Comparison


# Every backend the hook has a route for, sdpa once per route: what `--all-backends` runs.
ALL_ROUTES = (("eager", None), ("sdpa", "varlen"), ("sdpa", "dense"), ("flex_attention", None),
              ("flash_attention_2", None), ("flash_attention_3", None), ("flash_attention_4", None))
# Packages of the hybrids' fast kernels: their mixers run on them where installed (CUDA), else on torch fallbacks.
FAST_KERNEL_PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")
EXACT, CONTAMINATED, REFUSED, UNAVAILABLE, FAILED = "exact", "contaminated", "refused", "unavailable", "failed"


def realistic_rows(columns: int) -> list[list[int]]:
    """
    Document lengths of three packed rows of `columns` tokens (at least 16): a long document with one-token documents
    and a mid-sized one (one pad), one document filling its row, and many short documents before a quarter of padding.

    Example:
    ```python
    >>> from llm_packing.cli.verify_routes import realistic_rows
    >>> realistic_rows(128)
    [[93, 1, 32, 1], [128], [1, 2, 3, 5, 8, 13, 21, 34, 1]]
    >>> realistic_rows(16)
    [[9, 1, 4, 1], [16], [1, 2, 3, 5, 1]]

    ```
    """
    quarter = columns // 4
    short, current, following = [], 1, 2
    while sum(short) + current + 1 <= columns - quarter:
        short.append(current)
        current, following = following, current + following
    return [[columns - quarter - 3, 1, quarter, 1], [columns], [*short, 1]]


def columns_crossing_windows(config, columns: int, cap: int = 1024) -> int:
    """`columns`, raised in steps of 16 up to `cap` until the long document of [`realistic_rows`] is longer than the
    model's sliding window or attention chunk (a window of up to 764 tokens); unchanged where `cap` is not enough."""
    window = min(windows(config).values(), default=None)
    needed = columns
    while window is not None and needed - needed // 4 - 3 <= window and needed <= cap:
        needed += 16
    return needed if needed <= cap else columns


def windows(config) -> dict[str, int]:
    """The model's sliding window and attention chunk, in tokens, where it has them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {name: getattr(text, name, None) for name in ("sliding_window", "attention_chunk_size")}
    return {name: value for name, value in found.items() if isinstance(value, int) and value > 0}


def length_switches(config) -> dict[str, int]:
    """The lengths, in tokens, past which the model's length-dependent rope or Llama 4's attention temperature change
    (`longrope`'s original context, for one): only rows with a longer document check the hook's handling of them."""
    return rotary.length_switches(config) | temperature.length_switches(config)


def route_name(backend: str, route: str | None) -> str:
    return f"{backend}/{route}" if route else backend


def run_route(model, backend: str, attention_route: str | None, rows, columns: int, seed: int) -> dict:
    """
    Check one route on `model`; returns its report entry. `attention_route` (sdpa only): `"varlen"`, `"dense"`, or
    `None`/`"auto"` for the route `configure_packing` picks. The model ends on the backend it came with, unconfigured.
    """
    started = time.perf_counter()
    previous = model.config._attn_implementation
    try:
        entry = _route_result(model, backend, attention_route, rows, columns, seed)
    finally:
        unconfigure_packing()
        model.set_attn_implementation(previous)
    return {**entry, "seconds": round(time.perf_counter() - started, 1)}


def _route_result(model, backend: str, attention_route: str | None, rows, columns: int, seed: int) -> dict:
    entry = {"route": route_name(backend, attention_route or ("auto" if backend == "sdpa" else None)),
             "backend": backend, "status": None, "kernel": None, "logits": None, "gradients": None, "reason": None}
    try:
        model.set_attn_implementation(backend)
    except (ValueError, ImportError) as error:  # transformers' own refusal: the kernel is missing or unsupported
        return {**entry, "status": UNAVAILABLE, "reason": _one_line(error)}
    try:
        configure_packing(model, attention_route=attention_route)
        entry["kernel"] = kernel(model, backend, attention_route)
        if backend == "sdpa":
            entry["route"] = route_name(backend, "dense" if entry["kernel"].startswith("dense") else "varlen")
        return {**entry, **_measured(model, rows, columns, seed)}
    except PackingError as error:  # `configure_packing`'s refusal, or a guard's inside the forward
        return {**entry, "status": REFUSED, "reason": _one_line(error)}
    except Exception as error:  # noqa: BLE001 -- the report names it; the verdict counts the route as not exact
        return {**entry, "status": FAILED, "reason": f"{type(error).__name__}: {_one_line(error)}"}


def _measured(model, rows, columns: int, seed: int) -> dict:
    gradients_reason = None
    try:
        measured = measure_packing(model, rows, columns, gradients=True, seed=seed)
    except NotImplementedError as error:  # no backward here (flex_attention on CPU); PackingErrors are not caught
        if isinstance(error, PackingError):
            raise
        gradients_reason = _one_line(error)
        measured = measure_packing(model, rows, columns, seed=seed)
    return {"status": EXACT if measured.exact else CONTAMINATED, "logits": _comparison(measured.logits),
            "gradients": _comparison(measured.gradients) if measured.gradients else None,
            "reason": gradients_reason and f"gradients not compared: {gradients_reason}"}


def _comparison(comparison: Comparison) -> dict:
    difference, limit = comparison.difference, comparison.limit
    return {"difference": difference, "limit": limit, "floor": comparison.floor,
            "margin": limit / difference if difference else None}


def kernel(model, backend: str, route: str | None) -> str:
    """What computes a configured packed forward's attention on this backend and device."""
    if backend != "sdpa":
        return {"flex_attention": "document BlockMask", "eager": "additive document mask"}.get(
            backend, "FlashAttention varlen (cu_seqlens)")
    if route == "dense" or sdpa_route(model.config)[0] == "dense":
        return "dense L x L document mask"
    parameter = next(model.parameters())
    if parameter.is_cuda and computed_dtype(parameter) in FLASH_DTYPES and flash_varlen_op() is not None:
        return "torch FlashAttention 2 varlen op (one call per layer)"
    return "per-document SDPA (length buckets)"


def mixers_entry(model) -> dict | None:
    """The hybrid mixers the hook re-batches per document, and which fast-kernel packages are importable (their
    mixers use them on CUDA; on CPU, or without them, transformers' torch fallbacks run)."""
    classes = mixers.mixer_classes(causal_lm_model_type(model.config) or model.config.model_type)
    if not classes:
        return None
    installed = {name: importlib.util.find_spec(name) is not None for name in FAST_KERNEL_PACKAGES}
    return {"classes": sorted(cls.__name__ for cls in classes), "fast_kernel_packages": installed,
            "note": "every route above runs these mixers per document; its difference is theirs too"}


def verdict(routes: list[dict]) -> tuple[str, int]:
    """The overall status and exit code: exact (0) when every route that ran is exact and at least one ran;
    contaminated or failed (1) when any is; refused (1) when none ran."""
    statuses = {entry["status"] for entry in routes}
    if CONTAMINATED in statuses:
        return CONTAMINATED, 1
    if FAILED in statuses:
        return FAILED, 1
    if EXACT in statuses:
        return EXACT, 0
    return REFUSED if REFUSED in statuses else UNAVAILABLE, 1


def describe(entry: dict) -> str:
    """One route as words: `sdpa/varlen: exact: logits max |packed - alone| 3.1e-07 <= limit 1.0e-04 (...)`."""
    head = f"{entry['route']}: {entry['status']}"
    if entry["logits"] is None:
        return f"{head}: {entry['reason']}"
    parts = [_bound("logits max |packed - alone|", entry["logits"])]
    if entry["gradients"]:
        parts.append(_bound("gradients (of the largest alone)", entry["gradients"]))
    elif entry["reason"]:
        parts.append(entry["reason"])
    return f"{head}: {'; '.join(parts)}"


def _bound(what: str, comparison: dict) -> str:
    difference, limit, margin = comparison["difference"], comparison["limit"], comparison["margin"]
    relation = "<=" if difference <= limit else ">"
    return (f"{what} {difference:.3g} {relation} limit {limit:.3g}"
            + (f" (margin {margin:.1f}x)" if margin and difference <= limit else ""))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
