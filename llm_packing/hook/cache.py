"""The KV cache of a packed forward: refused, since it would hold a row's documents as one sequence; and an image-text
model's top-level `use_cache=False` passed on to its text model.

An image-text model of transformers (LLaVA, Qwen2.5-VL, Gemma 3, ...) hands `use_cache` to its text model only when
its own forward is given one; otherwise the text model reads its own config, `model.config.text_config.use_cache`,
True in most checkpoints. `transformers.Trainer` sets only `model.config.use_cache = False`, so a packed training step
under it would build a cache and be refused. A forward pre-hook on such a model's base ([`honour_top_level_use_cache`])
passes the top-level `False` on in packed forwards not given `use_cache`. Whatever still builds a cache (the forward
given `use_cache=True`, a top-level `use_cache=True` that the model reads, a checkpoint's text config) is refused where
the cache reaches attention or a mixer, with the fix for that model ([`use_cache_fix`]): the pre-hook records on the
forward's documents what the forward was given and which config it reads.
"""

import functools
import inspect
from dataclasses import dataclass

from . import registry
from .documents import ForwardDocuments, current_documents, documents_of
from .guards import input_module
from .masks import is_integer_mask


_REQUEST = "use_cache request"  # the key of the forward's `CacheRequest` on its documents


@dataclass(frozen=True)
class CacheRequest:
    """What a packed forward of a model with a text config of its own was given (`use_cache`, None if not given), and
    the model's top-level config."""

    given: bool | None
    config: object


def honour_top_level_use_cache(model) -> None:
    """Add the pre-hook to `model`'s base if its text model has a config of its own (idempotent; removed by
    `unconfigure_packing`)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config") or config.get_text_config() is config:
        return
    base = input_module(model)
    parameters = inspect.signature(base.forward).parameters.values()
    takes_use_cache = any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in parameters)
    hook = functools.partial(_pass_top_level_use_cache, config=config, takes_use_cache=takes_use_cache)
    registry.add_forward_pre_hook(base, "use_cache", hook)


def _pass_top_level_use_cache(module, args, kwargs, *, config, takes_use_cache):
    attention_mask = kwargs.get("attention_mask")
    if not is_integer_mask(attention_mask) or not attention_mask.numel():
        return None
    documents = documents_of(attention_mask, kwargs.get("position_ids"))
    if not documents.is_packed:
        return None
    given = kwargs.get("use_cache")
    documents.derived(_REQUEST, lambda: CacheRequest(given, config))
    if given is None and getattr(config, "use_cache", None) is False and takes_use_cache:
        kwargs["use_cache"] = False
        return args, kwargs
    return None


def use_cache_fix(documents: ForwardDocuments | None = None) -> str:
    """
    How to turn the KV cache off for the packed forward of `documents` (this thread's current forward if not given):
    the sentence that ends the refusal of a cache, naming the `use_cache` that asked for it.

    Example:
    ```python
    >>> import torch
    >>> use_cache_fix(documents_of(torch.tensor([[1, 1, 2, 2, 2, 0]])))  # a text model's forward: nothing recorded
    'Pass `use_cache=False` (Trainer does this for you) or set `model.config.use_cache = False`.'

    ```
    """
    documents = documents if documents is not None else current_documents()
    request = documents.derived(_REQUEST, lambda: None) if documents is not None else None
    if request is None:  # a model whose text model reads the top-level config, or one configured from its config
        return "Pass `use_cache=False` (Trainer does this for you) or set `model.config.use_cache = False`."
    if request.given:
        return "The forward was given `use_cache=True`: pass `use_cache=False`."
    model_type = getattr(request.config, "model_type", "?")
    top_level = getattr(request.config, "use_cache", None)
    if top_level:
        return (f"`model.config.use_cache` is True (model_type {model_type!r}): set `model.config.use_cache = False` "
                "(Trainer does this for you) or pass `use_cache=False`.")
    text_model_type = getattr(request.config.get_text_config(), "model_type", "?")
    also = ("" if top_level is False else
            "`model.config.use_cache = False` (Trainer does this for you; packing passes it on to the text model), ")
    return (f"`model.config` (model_type {model_type!r}) gives its text model no `use_cache`, so the text model "
            f"reads its own `model.config.text_config.use_cache`=True (model_type {text_model_type!r}): set {also}"
            "`model.config.text_config.use_cache = False`, or pass `use_cache=False`.")
