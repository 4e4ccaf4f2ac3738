"""How tests run flex_attention on CPU: unfused in the parity matrices, traced or not, and compiled in two tests.

transformers compiles flex_attention and its block masks (`torch.compile`) on first use, and dynamo compiles again
for every new shape and mask function, up to its recompile limit. With inductor's cache cold, as on a CI machine, a
compile took 8 to 24 s on the 2-core machine (a tiny llama's packed batch: 24 s), and past the recompile limit flex
ran uncompiled anyway, so which cells ran compiled depended on test order (and compiled, llama4_text's chunked mask
failed to build its kernel on the random layouts: a CppCompileError in torch 2.13's inductor).

Both unfused modes set dynamo's recompile limit to 0, so transformers' own `torch.compile` never compiles, and run
torch's unfused implementation of the same score and mask functions:
- [`traced_flex`]: what flex_attention does uncompiled by default. Each call first traces its score and mask functions
  with dynamo (an eager-backend compile, whole graph), which fails if the hook's mask functions could not compile on
  a GPU. A trace costs about 0.3 s here, once for every forward whose packed batch brings new mask functions.
- [`untraced_flex`]: the same implementation called directly (torch's `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`), with
  no trace: the same logits to the bit, about 3 times faster. For references and for the random layouts, whose mask
  functions the fixed matrices trace for every type.

dynamo then never compiles flex_attention again in that process, so [`compiled_flex`] resets dynamo first, and fails
if flex_attention still ran uncompiled.
"""

import contextlib
from unittest import mock

import torch
import torch.nn.attention.flex_attention as torch_flex


@contextlib.contextmanager
def traced_flex():
    with torch._dynamo.config.patch(recompile_limit=0):
        yield


@contextlib.contextmanager
def untraced_flex():
    with traced_flex(), mock.patch.object(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True):
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
