"""dynamo's recompile limit, raised while packing is configured, so that a compiled packed model stays compiled.

The hook's replacements run outside dynamo's graphs (`registry.outside_graphs`): a compiled packed model breaks its
graph at each of them (once per attention layer on sdpa's varlen route, once per forward otherwise), and dynamo then
compiles the frames around the break on their own. transformers wraps the `forward` of a model's attention, decoder
layer, base model and causal LM in one shared function (`deprecate_kwarg`'s `wrapped_func`), and dynamo counts every
compile of those four against that one code object: a tiny Llama took 4 entries on its first batch and 8 once shapes
went dynamic. At dynamo's default `recompile_limit` of 8, the next variant (an eval pass under `no_grad`, or with
`dynamic=False` a third row length) ran those frames eagerly for the rest of the process, with a warning. While
packing is configured the limit is at least `RECOMPILE_LIMIT` (a tiny Llama with gradient checkpointing and
`dynamic=False` took 20 after 5 lengths); `unconfigure_packing` restores it unless it was changed since.
"""

import sys

from . import registry


RECOMPILE_LIMIT = 64
_CONFIG_MODULE = "torch._dynamo.config"


def raise_recompile_limit() -> None:
    """Raise dynamo's `recompile_limit` to `RECOMPILE_LIMIT` if it is lower, now or when dynamo is imported."""
    registry.patch_on_import(_CONFIG_MODULE, _raise)


def _raise() -> None:
    config = sys.modules[_CONFIG_MODULE]
    if getattr(config, "recompile_limit", RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
        registry.replace_attribute(config, "recompile_limit", RECOMPILE_LIMIT)
