"""How tests run flex_attention on CPU: uncompiled in the parity matrices, compiled in two tests.

transformers compiles flex_attention and its block masks (`torch.compile`) on first use, and dynamo compiles again
for every new shape and mask function, up to its recompile limit. With inductor's cache cold, as on a CI machine, a
compile took 8 to 24 s on the 2-core machine (a tiny llama's packed batch: 24 s), and past the recompile limit flex
ran uncompiled anyway, so which cells ran compiled depended on test order (and compiled, llama4_text's chunked mask
failed to build its kernel on the random layouts: a CppCompileError in torch 2.13's inductor).

[`uncompiled_flex`] sets dynamo's recompile limit to 0: flex_attention runs torch's unfused implementation of the same
mask functions, about 0.2 s a matrix cell. dynamo then never compiles flex_attention again in that process, so
[`compiled_flex`] resets dynamo first, and fails if flex_attention still ran uncompiled.
"""

import contextlib
from unittest import mock

import torch
import torch.nn.attention.flex_attention as torch_flex


@contextlib.contextmanager
def uncompiled_flex():
    with torch._dynamo.config.patch(recompile_limit=0):
        yield


@contextlib.contextmanager
def compiled_flex():
    """Compiled, with static shapes: compiled flex_attention on CPU fails to build its C++ kernel once dynamo
    recompiles with dynamic shapes (CppCompileError in torch 2.13's flex template)."""
    eager_runs = []
    warn_once = torch_flex._warn_once

    def record(*args, **kwargs):  # flex_attention warns, once per process, each time it runs uncompiled
        eager_runs.append(kwargs.get("warning_id", args[0] if args else None))
        return warn_once(*args, **kwargs)

    torch._dynamo.reset()
    with (mock.patch.object(torch_flex, "_warn_once", record),
          torch._dynamo.config.patch(automatic_dynamic_shapes=False)):
        yield
    assert "flex_attention_performance" not in eager_runs, "flex_attention ran uncompiled"
