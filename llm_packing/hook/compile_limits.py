"""dynamo's recompile limit, raised while packing is configured, so that a compiled packed model stays compiled.

The hook's replacements run outside dynamo's graphs (`registry.outside_graphs`): a compiled packed model breaks its
graph at each of them (once per attention layer on sdpa's varlen route, once per forward otherwise), and dynamo then
compiles the frames around the break on their own. transformers wraps the `forward` of a model's attention, decoder
layer, base model and causal LM in one shared function (`deprecate_kwarg`'s `wrapped_func`), and dynamo counts every
compile of those four against that one code object: a tiny Llama took 4 entries on its first batch and 8 once shapes
went dynamic. At dynamo's default `recompile_limit` of 8, the next variant (an eval pass under `no_grad`, or with
`dynamic=False` a third row length) ran those frames eagerly for the rest of the process, with a warning. While
packing is configured a default limit is raised to `RECOMPILE_LIMIT` (a tiny Llama with gradient checkpointing and
`dynamic=False` took 20 after 5 lengths); a limit the user set is left alone, and `unconfigure_packing` restores the
default unless it was changed since.
"""

import sys

from . import registry


RECOMPILE_LIMIT = 64
_DYNAMO_DEFAULT = 8  # torch 2.6 to 2.13, where its config does not say
_CONFIG_MODULE = "torch._dynamo.config"


def raise_recompile_limit() -> None:
    """Raise dynamo's `recompile_limit` from its default to `RECOMPILE_LIMIT`, now or when dynamo is imported. A
    limit the user set is theirs (0 keeps transformers from compiling flex_attention, as the tests do)."""
    registry.patch_on_import(_CONFIG_MODULE, _raise)


def _raise() -> None:
    config = sys.modules[_CONFIG_MODULE]
    entry = getattr(config, "_config", {}).get("recompile_limit")
    default = getattr(entry, "default", _DYNAMO_DEFAULT)
    if getattr(config, "recompile_limit", None) == default < RECOMPILE_LIMIT:
        registry.replace_attribute(config, "recompile_limit", RECOMPILE_LIMIT)
