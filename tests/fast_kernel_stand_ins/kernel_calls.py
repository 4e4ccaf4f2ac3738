"""What the stand-in kernels were called with: one record per call, read by the test."""

import importlib
import inspect


CALLS: list[dict] = []


def record(kernel: str, batch_size: int, length: int, kwargs: dict) -> None:
    CALLS.append({"kernel": kernel, "batch_size": batch_size, "length": length,
                  "layout": sorted(name for name in ("cu_seqlens", "seq_idx") if kwargs.get(name) is not None)})


def torch_reference(module_name: str, function_name: str):
    """transformers' torch implementation behind the kernel wrapper of `function_name` in `module_name`."""
    return inspect.unwrap(getattr(importlib.import_module(module_name), function_name))
