"""Per-document isolation for the non-attention mixers of hybrid models (gated delta nets, Mamba/Mamba2 SSMs, short
convolutions, lightning attention, ...).

These mixers carry a convolution window and a recurrent state along the whole row, so a packed row leaks each
document into the next; their torch fallbacks ignore `cu_seqlens`/`seq_idx`. The hook re-batches instead: every mixer
call receives a batch in which each document is its own right-padded sequence, starting from zero conv and recurrent
state, and the outputs are scattered back into the packed layout. The mixers are causal, so the right padding cannot
reach a document's tokens, whichever kernel runs the call: the parity matrix proves it with transformers' torch
fallbacks on CPU; the fast CUDA kernels (fla, causal-conv1d, mamba_ssm) get an ordinary padded batch but have not run
here. Pure SSMs (mamba, falcon_mamba, mamba2) take the same path, and so do the pure recurrent LMs RWKV and xLSTM,
whose blocks get no mask: a call of their model makes the mask it received visible to them (`MASK_RECORDERS`).

Documents are grouped by length with the rule varlen attention uses (`documents.bucket_bounds`), so short documents
share one call and padding stays small. The groups are derived once per forward, from the documents the mask builders
of the same forward already read (`hook.documents`; transformers' `create_recurrent_attention_mask` hands the mixers a
view of the same 2-D mask): one host sync per forward in all.

`MIXERS` (`hook.support.mixers`) is the one table of mixer classes the hook wraps; a hybrid type absent from it stays
refused.
"""

import functools
import importlib
import inspect
import re
import threading

import numpy as np
import torch

from .. import _compat
from ..errors import ContaminationError, IncompatibleTransformersError, UnsupportedSetupError
from . import registry
from .cache import use_cache_fix
from .documents import bucket_bounds, documents_from_positions, documents_of
from .masks import is_integer_mask
from .peft_methods import refuse_per_row_adapters
from .support.mixers import MASK_RECORDERS, MIXERS, MixerCall


# Arguments that describe the packed row as a whole (varlen kernels' boundaries): meaningless for the re-batched call.
_ROW_LAYOUT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")

class _ModelMaskPerThread(threading.local):
    def __init__(self):
        self.mask = None  # the `attention_mask` of the model call running on this thread (`MASK_RECORDERS`)
        self.outer: list = []  # the masks of the calls around it, for the instance hooks (`record_model_masks`)


_model_mask = _ModelMaskPerThread()
_RECORDS_MASK = "__llm_packing_records_model_mask__"


def mixer_classes(model_type: str) -> list[type]:
    """The mixer classes of `model_type` that the hook wraps (imports the modeling module); [] if it has none."""
    if model_type not in MIXERS:
        return []
    module_name, calls = MIXERS[model_type]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    return [getattr(module, name) for name in calls]


def mask_reading_mixers(model_type: str) -> tuple[str, ...]:
    """The names of `model_type`'s mixer classes that read the documents from a mask: the one they are handed, or
    the model's (RWKV's and xLSTM's blocks); not those that read them from `position_ids` (Griffin's recurrent block).
    A padding-free batch (no mask) leaks through them. RWKV and xLSTM take no `position_ids`, but their causal LMs
    accept any keyword, so a padding-free batch's reached them and ran each row whole (2.2 off alone).

    Example:
    ```python
    >>> from llm_packing.hook.mixers import mask_reading_mixers
    >>> mask_reading_mixers("lfm2"), mask_reading_mixers("recurrent_gemma"), mask_reading_mixers("rwkv")
    (('Lfm2ShortConv',), (), ('RwkvBlock',))

    ```
    """
    calls = MIXERS.get(model_type, ("", {}))[1]
    return tuple(name for name, call in calls.items() if call.documents in ("mask", "model"))


def patch_mixers(model_type: str) -> None:
    """Wrap the `forward` of every mixer class of `model_type`, and the `__call__` of its mask recorders
    (idempotent; `unconfigure_packing` restores them through the registry)."""
    if model_type not in MIXERS:
        return
    module_name, calls = MIXERS[model_type]
    for cls in mixer_classes(model_type):
        if not registry.is_ours(cls.forward):
            registry.replace_attribute(cls, "forward", registry.ours(_wrap_forward(cls.forward, calls[cls.__name__])))
        if _compat.layers_checkpoint_in_call() and _is_checkpointing_layer(cls) and not registry.is_ours(cls.__call__):
            # Before 5.23 `GradientCheckpointingLayer.__call__` checkpoints the whole packed call, whose backward
            # recompute runs outside the model call (no recorded mask: the packed row as one sequence). Bypass it, so
            # that `_checkpointing` checkpoints each document group, as transformers' `forward` wrapper does since.
            registry.replace_attribute(cls, "__call__", _call_without_checkpointing)
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    for cls in (getattr(module, name) for name in MASK_RECORDERS.get(model_type, ())):
        if not getattr(cls.__call__, _RECORDS_MASK, False):  # wrapped already, perhaps by `hook.builderless` only
            recorder = registry.ours(_record_mask(cls.__call__, cls.forward))
            setattr(recorder, _RECORDS_MASK, True)
            registry.replace_attribute(cls, "__call__", recorder)


def record_model_masks(model: torch.nn.Module, model_type: str) -> None:
    """Record the mask of every call of `model`'s mask recorders through hooks on the instances too (idempotent;
    removed by `unconfigure_packing`). The class `__call__` that `patch_mixers` wraps is not always the one that
    runs: `torch.compile(model)` before configuring binds the model's `__call__` as it was, and RWKV's causal LM does
    not hand its mask to its base model, so its blocks ran the packed row whole (2.3 off eager in the logits). Module
    hooks run on every call, compiled or not."""
    recorders = MASK_RECORDERS.get(model_type, ())
    for module in model.modules():
        if type(module).__name__ in recorders:
            signature = inspect.signature(type(module).forward)
            registry.add_forward_pre_hook(module, "model mask", functools.partial(_push_mask, signature=signature))
            registry.add_forward_hook(module, "model mask", _pop_mask, always_call=True)


def _push_mask(module, args, kwargs, *, signature):
    mask = _mask_of_call(signature, (module, *args), kwargs)
    _model_mask.outer.append(_model_mask.mask)
    if mask is not None:
        _model_mask.mask = mask


def _pop_mask(module, args, kwargs, output):
    if _model_mask.outer:
        _model_mask.mask = _model_mask.outer.pop()


def check_mixers_covered(model) -> None:
    """Refuse a model holding a mixer the table lacks for its type (a new layer kind in a newer transformers, a custom
    model): it would carry state across documents unwrapped."""
    model_type = model.config.model_type
    handled = tuple(mixer_classes(model_type))
    covered: list[str] = []  # names of the handled mixers: their submodules run inside them, per document
    inside: set[int] = set()  # the modules of the handled mixers, wherever else they are registered too
    for name, module in model.named_modules():
        if isinstance(module, handled) or id(getattr(module, "original_module", None)) in inside:
            # PEFT's `modules_to_save=["conv"]` on lfm2 wraps the handled mixer and, beside it, the mixer's own Conv1d
            # (a wrapper whose `original_module` is inside the mixer, with copies of it, which nothing calls).
            covered.append(name + ".")
            inside.update(id(part) for part in module.modules())
        elif _looks_like_mixer(module) and not name.startswith(tuple(covered)) and not _in_media_tower(name):
            raise UnsupportedSetupError(
                f"Module {name!r} of model_type {model_type!r} is a {type(module).__name__}, a non-attention mixer "
                "(it owns a causal convolution) that llm_packing does not isolate (handled for this type: "
                f"{sorted(cls.__name__ for cls in handled)}). Train this model without packing, or add the class to "
                "`llm_packing.hook.support.mixers.MIXERS` with a parity test."
            )


def _in_media_tower(name: str) -> bool:
    """Audio and vision encoders run only on media inputs, which `multimodal.guard_media_inputs` refuses in packed
    batches (phi4_multimodal's audio encoder owns convolutions that never see packed text)."""
    return any(word in part for part in name.split(".") for word in _TOWER_WORDS)


_TOWER_WORDS = ("audio", "vision", "visual", "image", "speech")


def _looks_like_mixer(module: torch.nn.Module) -> bool:
    """Every conv, SSM and delta-net mixer of transformers owns the short causal convolution that carries state, or
    is one under its own name (Inkling 2's dynamic short convolution holds its taps as plain weights)."""
    return any(isinstance(child, torch.nn.Conv1d) for child in module.children()) or bool(
        _SHORT_CONVOLUTION_NAME.search(type(module).__name__)
    )


_SHORT_CONVOLUTION_NAME = re.compile(r"(Short|Causal)Conv")


def _require_arguments(forward, signature: inspect.Signature, expected) -> None:
    missing = [name for name in expected if name is not None and name not in signature.parameters]
    if missing:
        raise IncompatibleTransformersError(
            f"Cannot isolate the documents in `{forward.__qualname__}`: it takes no {missing} argument(s) (installed "
            f"transformers {_compat.TRANSFORMERS_VERSION}; llm_packing is tested with "
            f"{_compat.MIN_TRANSFORMERS_VERSION} to {_compat.MAX_TESTED_TRANSFORMERS_VERSION}). Install a tested "
            f"version, e.g. `pip install transformers=={_compat.MAX_TESTED_TRANSFORMERS_VERSION}`."
        )


def _record_mask(call, forward):
    """`call` (a model class's `__call__`) keeping the `attention_mask` it receives, read by `forward`'s signature,
    visible to the model's blocks (on this thread, for the duration of the call), for mixers handed no mask
    (`MixerCall.documents == "model"`). A call without a mask inside one with a mask (RWKV's base model inside its
    causal LM) keeps the outer one."""
    signature = inspect.signature(forward)

    @functools.wraps(call)
    def call_recording_mask(*args, **kwargs):
        mask = _mask_of_call(signature, args, kwargs)
        previous = _model_mask.mask
        _model_mask.mask = previous if mask is None else mask
        try:
            return call(*args, **kwargs)
        finally:
            _model_mask.mask = previous

    return call_recording_mask


def _mask_of_call(signature: inspect.Signature, args, kwargs):
    """The `attention_mask` of a model call (`args` with the module first), by name or in its `**kwargs`."""
    arguments = signature.bind_partial(*args, **kwargs).arguments
    return arguments.get("attention_mask", arguments.get(_var_keyword(signature), {}).get("attention_mask"))


def _wrap_forward(forward, call: MixerCall):
    signature = inspect.signature(forward)
    cache_name = call.cache or _compat.cache_parameter(forward)
    documents_name = {"mask": call.mask, "position_ids": "position_ids", "model": None}[call.documents]
    _require_arguments(forward, signature, (call.hidden, call.mask, documents_name, cache_name, *call.per_token))

    @functools.wraps(forward)
    def forward_per_document(*args, **kwargs):
        kwargs = _compat.rename_legacy_cache_argument(kwargs, signature)
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        documents = arguments.get(documents_name) if documents_name else _model_mask.mask
        if call.documents == "position_ids" and _is_plain_mask(_model_mask.mask):
            documents = None  # left padding numbered 0 (generation's, a 0/1 mask's cumsum) is no document start
        module = arguments["self"]
        inner, checkpoint = _checkpointing(forward, module)
        batches = None
        if is_integer_mask(documents):
            batch_size = arguments[call.hidden].shape[0]
            if documents.shape[0] != batch_size:  # `position_ids` of one row, shared by every row
                documents = documents.expand(batch_size, -1)
            batches = _document_batches(documents, from_positions=call.documents == "position_ids")
        if batches is None:  # not packed: the call as it was, checkpointed where transformers' wrapper would have
            return checkpoint(functools.partial(inner, module, **kwargs), *args[1:]) if checkpoint else forward(
                *args, **kwargs)
        # A cache object, or `use_cache=True` for a mixer that keeps its state on itself.
        if arguments.get(cache_name) not in (None, False):
            raise ContaminationError(
                f"A packed batch (indexed `attention_mask`) reached {type(module).__name__} with a cache "
                f"(`{cache_name}`, i.e. `use_cache=True`): its conv and recurrent state would carry one document "
                f"into the next. {use_cache_fix()}{call.cache_hint}"
            )
        refuse_per_row_adapters(module)
        hidden_states = arguments.pop(call.hidden)
        per_token = {name: arguments.pop(name) for name in call.per_token}
        if call.mask is not None:
            arguments[call.mask] = None
        arguments[cache_name] = None
        extra = arguments.pop(_var_keyword(signature), {})
        extra = {key: value for key, value in extra.items() if key not in _ROW_LAYOUT_KWARGS}
        arguments.pop("self")
        returned = []  # how many values the mixer returns

        def mix(states, **document_tokens):
            run = functools.partial(inner, module, **document_tokens, **arguments, **extra)
            # Positional under a checkpoint: reentrant checkpointing passes gradients through positional tensors only.
            output = checkpoint(run, states) if checkpoint else run(**{call.hidden: states})
            returned[:] = [len(output) if call.returns_state else 1]
            return output[0] if call.returns_state else output

        packed = batches.run(mix, hidden_states, **per_token)
        return (packed, *[None] * (returned[0] - 1)) if call.returns_state else packed

    return forward_per_document


def _checkpointing(forward, module):
    """The forward to run per document group, and the checkpoint function to run it under (or None). A mixer that is
    itself a gradient-checkpointing layer (RWKV's and xLSTM's blocks) checkpoints only when its class `forward` is
    transformers' own wrapper, which this hook has replaced: the wrapper checkpoints each group's call itself, around
    the class's original `forward` (whose first argument must be the hidden states), so the re-batching stays outside
    and the backward recompute sees the same groups."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not isinstance(module, GradientCheckpointingLayer):
        return forward, None
    inner = getattr(forward, "__wrapped__", forward)  # the class's forward inside transformers' checkpointing wrapper
    active = module.gradient_checkpointing and module.training and torch.is_grad_enabled()
    return inner, module._gradient_checkpointing_func if active else None


def _is_checkpointing_layer(cls: type) -> bool:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return issubclass(cls, GradientCheckpointingLayer)


@registry.ours
def _call_without_checkpointing(self, *args, **kwargs):
    """`nn.Module.__call__`, in place of `GradientCheckpointingLayer.__call__` on transformers < 5.23 (see
    `patch_mixers`)."""
    return torch.nn.Module.__call__(self, *args, **kwargs)


def _var_keyword(signature: inspect.Signature) -> str:
    return next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), "kwargs")


class DocumentBatches:
    """
    The documents of a packed batch as right-padded groups of similar length: where each group's tokens come from
    in the flattened `(batch_size * length)` row layout, and where its real tokens go back.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.mixers import DocumentBatches
    >>> batches = DocumentBatches.from_mask(torch.tensor([[1, 1, 1, 2, 0], [1, 2, 2, 3, 3]]))
    >>> [group.tolist() for group in batches.gather]
    [[[0, 1, 2], [6, 7, 10], [8, 9, 10], [3, 10, 10], [5, 10, 10]]]
    >>> batches.run(lambda states: states.cumsum(1), torch.ones(2, 5, 1))[..., 0]
    tensor([[1., 2., 3., 1., 0.],
            [1., 1., 2., 1., 2.]])

    ```
    """

    def __init__(self, gather: list[torch.Tensor], real: list[torch.Tensor], targets: torch.Tensor, shape):
        self.gather = gather  # per group: (documents, width) flat token index, `batch_size * length` on padding
        self.real = real  # per group: positions of the real tokens in the group's flattened (documents * width)
        self.targets = targets  # flat token index of every real token, in the groups' order
        self.shape = shape  # (batch_size, length)

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "DocumentBatches":
        """The document batches of an indexed mask (`batch_size`, `length`): 1-based document ids, 0 on padding."""
        documents = documents_of(mask)
        return cls.from_spans(documents.starts, documents.lengths, mask.shape, mask.device)

    @classmethod
    def from_spans(cls, begins: np.ndarray, lengths: np.ndarray, shape, device: torch.device) -> "DocumentBatches":
        """The document batches from each document's flat start and length in a `(batch_size, length)` batch,
        documents grouped by `documents.bucket_bounds` (the rule varlen attention groups by too)."""
        order = np.argsort(-lengths, kind="stable")
        pad_index = int(np.prod(shape))
        gather, real, targets = [], [], []
        for first, last in bucket_bounds(lengths[order]):
            chosen = order[first:last]
            width = int(lengths[chosen[0]])
            offsets = np.arange(width)
            inside = offsets[None, :] < lengths[chosen, None]
            index = np.where(inside, begins[chosen, None] + offsets[None, :], pad_index)
            gather.append(index)
            real.append(np.flatnonzero(inside.reshape(-1)))
            targets.append(index[inside])
        return cls(
            [torch.from_numpy(index).to(device) for index in gather],
            [torch.from_numpy(positions).to(device) for positions in real],
            torch.from_numpy(np.concatenate(targets)).to(device),
            tuple(shape),
        )

    def run(self, mixer, hidden_states: torch.Tensor, **per_token: torch.Tensor):
        """`mixer` applied to every document alone; padding positions of the packed layout get zeros. `per_token`
        tensors (`(batch_size, length, ...)`, e.g. `position_ids`) are re-batched alike and passed to `mixer` by name.
        A mixer returning a tuple of per-token tensors (zaya's queries, keys and values) gets a tuple back."""
        sources = [self._source(tensor) for tensor in (hidden_states, *per_token.values())]
        outputs = []
        for index, real in zip(self.gather, self.real, strict=True):
            states, *others = (source[index] for source in sources)
            output = mixer(states, **dict(zip(per_token, others, strict=True)))
            parts = output if isinstance(output, tuple) else (output,)
            outputs.append([part.reshape(-1, *part.shape[2:]).index_select(0, real) for part in parts])
        packed = tuple(self._scatter(torch.cat(values)) for values in zip(*outputs, strict=True))
        return packed if isinstance(output, tuple) else packed[0]

    def _scatter(self, values: torch.Tensor) -> torch.Tensor:
        """The real tokens' `values`, in the groups' order, put back into the packed `(batch_size, length, ...)`."""
        batch_size, length = self.shape
        packed = values.new_zeros(batch_size * length, *values.shape[1:]).index_copy(0, self.targets, values)
        return packed.view(batch_size, length, *values.shape[1:])

    def _source(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` flattened to `(batch_size * length, ...)`, plus the zero row that a group's right padding reads."""
        batch_size, length = self.shape
        flat = tensor.expand(batch_size, length, *tensor.shape[2:]).reshape(batch_size * length, *tensor.shape[2:])
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])


def _is_plain_mask(mask) -> bool:
    """Whether the model was called with an ordinary 0/1 mask (bool, or integers without a document id above 1)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    return mask.dtype == torch.bool or (is_integer_mask(mask) and not documents_of(mask).is_packed)


def _document_batches(documents: torch.Tensor, from_positions: bool = False) -> DocumentBatches | None:
    """The [`DocumentBatches`] of this forward's indexed mask (`documents`), or None for a plain 0/1 mask: built once
    per forward, from the documents the mask builders of the forward already derived (`hook.documents`).
    `from_positions`: `documents` holds `position_ids`, and a document starts at every 0."""
    state = documents_from_positions(documents) if from_positions else documents_of(documents)
    if not state.is_packed:
        return None
    return state.derived("mixers", lambda: DocumentBatches.from_spans(
        state.starts, state.lengths, state.ids.shape, documents.device
    ))
