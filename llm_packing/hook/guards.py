"""A configured model refuses the training batches that would leave its documents unisolated.

`DataCollatorWithPacking` (and the hook's own packed forwards) always send `position_ids`, and an indexed mask
whenever a row holds several documents. A training forward (gradients on) that gets neither document ids in its
mask nor `position_ids` comes from a collator that knows nothing of packing: TRL's default on `pack_dataset` rows is
the case that matters (`trl.SFTTrainer(model=configured_model, train_dataset=pack_dataset(...))` with stock defaults
collates each packed row with an all-ones mask, so its documents attend to each other). In training mode that batch
is refused before any layer runs; in eval mode (a hand-written loop that never called `model.train()`), at the
backward pass through it. Evaluation, generation and inference (no backward) are never refused, nor
`verify_packing`'s gradients of documents alone (`unpacked_forwards`).

A packed training batch whose labels would teach one document to predict the next is refused too: the model shifts
labels by one, so the label at a document's first token is the target of the previous document's last token, and must
be -100 (`DataCollatorWithPacking` sets it; a hand-made collator may not). See `refuse_labels_across_documents`.

A training forward on a kernel measured to compute packed gradients wrongly is refused the same way: FlashAttention
4's varlen backward below head dim 32 (see `refuse_broken_kernels`).
"""

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator

import torch

from ..errors import ContaminationError, UnsupportedSetupError
from . import registry
from .documents import documents_of, enter_forward, leave_forward
from .masks import is_integer_mask
from .shapes import attention_head_dims
from .support.architectures import calls_no_mask_builder


def scope_documents_to_forwards(model: torch.nn.Module) -> None:
    """Make each outermost forward of `model` start from no documents (`hook.documents.enter_forward`): pre-hooks put
    first on the causal LM (whose labels check reads the mask before its base model runs) and on the base model
    (which PEFT's wrappers reach through `__call__`), and hooks that run however the forward ends (idempotent;
    removed by `unconfigure_packing`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for module in {id(part): part for part in (inner, input_module(model))}.values():
        registry.add_forward_pre_hook(module, "forward documents", _enter_forward, prepend=True)
        registry.add_forward_hook(module, "forward documents", _leave_forward, always_call=True)


def _enter_forward(module, args, kwargs):
    positions = kwargs.get("position_ids")
    enter_forward(module, positions_given=positions is not None, position_ids=positions)


def _leave_forward(module, args, kwargs, output):
    leave_forward()


def refuse_batches_without_documents(model: torch.nn.Module) -> None:
    """Add the checks to `model`: in training mode at the forward, in eval mode at a backward (idempotent; removed by
    `unconfigure_packing`)."""
    registry.add_forward_pre_hook(input_module(model), "training batches", _refuse_batch_without_documents)
    registry.add_forward_hook(input_module(model), "eval-mode backward", _refuse_backward_without_documents)


def complete_document_positions(model: torch.nn.Module) -> None:
    """Give a packed batch the `position_ids` the collator would (idempotent; removed by `unconfigure_packing`):
    - none given: each document's own, from the indexed mask. biogpt, xglm, git and opt build their mask before they
      number their positions, so the builders' position check never saw the row's numbering they then used: packed
      documents were 0.11-0.57 off alone (opt: a raw `IndexError`), and llama-like models refused the batch;
    - given: 0 on padding. The rotary embeddings whose frequencies follow each document's length (`hook.rotary`)
      read the documents from the positions, and trailing padding numbered on from the last document (the row's
      `arange`) lengthened it past Phi-3's longrope switch: 1.8e-3 to 7.5e-3 off alone.
    Only where the model takes `position_ids` (not the pure SSMs)."""
    module = input_module(model)
    if "position_ids" in inspect.signature(module.forward).parameters:
        registry.add_forward_pre_hook(module, "document positions", _complete_document_positions)


def _complete_document_positions(module, args, kwargs):
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if not is_integer_mask(mask) or not mask.numel() or _input_length(args, kwargs) != mask.shape[1]:
        return None  # no indexed mask, or a piece of each row (sequence parallelism: its shard sets the positions)
    flat = isinstance(positions, torch.Tensor) and positions.shape == mask.shape
    if positions is not None and not flat:  # 3-D (mRoPE) positions, or a decoding step's: checked where they are read
        return None
    documents = documents_of(mask, positions)  # the forward's one host copy, of the positions too (`hook.documents`)
    if not documents.is_packed:
        return None
    return args, {**kwargs, "position_ids": documents.complete_positions(positions)}


def _input_length(args, kwargs) -> int | None:
    """The tokens a row of a forward holds."""
    _, tokens = _input_tensor(args, kwargs)
    return tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None


def _input_tensor(args, kwargs) -> tuple[str, torch.Tensor | None]:
    """A forward's `input_ids` (often passed positionally), else its `inputs_embeds`, with the name it came under."""
    for name, tokens in (("input_ids", kwargs.get("input_ids")), ("input_ids", args[0] if args else None),
                         ("inputs_embeds", kwargs.get("inputs_embeds"))):
        if isinstance(tokens, torch.Tensor):
            return name, tokens
    return "inputs", None


def refuse_labels_across_documents(model: torch.nn.Module) -> None:
    """Add the labels check to the module that takes `labels` (a PEFT model's transformers model; idempotent)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "labels" in inspect.signature(inner.forward).parameters:
        registry.add_forward_pre_hook(inner, "labels across documents", _refuse_labels_across_documents)


def _refuse_labels_across_documents(module, args, kwargs):
    labels, mask = kwargs.get("labels"), kwargs.get("attention_mask")
    if not isinstance(labels, torch.Tensor) or kwargs.get("shift_labels") is not None:
        return  # no loss, or labels shifted already, within documents (`llm_packing.parallel`)
    if kwargs.get("fused_lm_head"):
        return  # padded rows, which TRL's fused head under `pack_fused_lm_head` packs and checks itself
    if not is_integer_mask(mask) or labels.shape != mask.shape or not mask.numel():
        return
    documents = documents_of(mask)  # the forward's one host copy of the mask, kept for its builders
    if not documents.is_packed:
        return
    row_length = mask.shape[1]
    starts = documents.starts[documents.starts % row_length != 0]  # a row's first label is never a target
    if not len(starts):
        return
    targets = labels.reshape(-1)[torch.as_tensor(starts, device=labels.device)]
    wrong = torch.nonzero(targets != -100).flatten().tolist()
    if wrong:
        row, column = divmod(int(starts[wrong[0]]), row_length)
        raise ContaminationError(
            f"A packed batch with `labels` has label {int(targets[wrong[0]])} at row {row}, position {column}, the "
            f"first token of a document ({len(wrong)} such documents in the batch): the model shifts labels by one, "
            "so the previous document's last token would learn to predict it (or be scored on it). Set every "
            "document's first label to -100, as `DataCollatorWithPacking` does."
        )


def refuse_flattened_batches_for_mixers(model: torch.nn.Module, mixer_names: tuple[str, ...],
                                        check_mask: Callable[[torch.Tensor, torch.Tensor | None], object]) -> None:
    """Refuse, before any layer runs, a padding-free batch for a model whose conv, SSM or delta-net mixers
    (`mixer_names`, none for most models) read the documents from the indexed mask (idempotent). Such a batch has no
    `attention_mask`, and `position_ids` that restart within its row, or `cu_seq_lens_q`: transformers isolates its
    attention from those, but nothing hands them to the mixers, whose state would run from one document into the next
    (tiny qwen3_next: 3.8e-2 off alone, lfm2: 6.2e-4).

    A model that calls no mask builder (mamba2, rwkv, xlstm) also gets its 2-D mask and `position_ids` checked here
    by `check_mask(mask, position_ids)` (the builders' check), where a builder would check them for the others: a 0/1
    mask with positions restarting inside it is packed documents the mixers read as one (2.8, 2.2 and 1.9 off
    alone)."""
    if mixer_names:
        module = input_module(model)
        builderless = calls_no_mask_builder(type(module).__module__)
        registry.add_forward_pre_hook(module, "flattened batches", functools.partial(
            _refuse_flattened_batch, mixer_names=mixer_names, check_mask=check_mask if builderless else None))


def flattened_layout(kwargs: dict) -> str | None:
    """How a call's keyword arguments say that its batch is padding-free packed documents (no `attention_mask`;
    `position_ids` restarting within a row, or FlashAttention's `cu_seq_lens_q`), or None if they do not."""
    if kwargs.get("attention_mask") is not None:
        return None
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.shape[-1] > 1 and bool((positions[..., 1:] == 0).any()):
        return "`position_ids` restarting within a row"
    return "`cu_seq_lens_q`" if kwargs.get("cu_seq_lens_q") is not None else None


def _refuse_flattened_batch(module, args, kwargs, *, mixer_names: tuple[str, ...], check_mask: Callable | None):
    layout = flattened_layout(kwargs)
    if layout is not None:
        raise ContaminationError(
            f"A padding-free batch (no `attention_mask`; {layout}) reached model_type {module.config.model_type!r}, "
            f"whose {', '.join(mixer_names)} read the documents only from an indexed `attention_mask`: their conv "
            "and recurrent state would run from one document into the next. Collate with "
            "`llm_packing.DataCollatorWithPacking()` and its indexed mask (without `padding_free` or "
            "`return_flash_attn_kwargs`; recipe: `padding_free: false`), not with TRL's `padding_free` or "
            "transformers' `DataCollatorWithFlattening`."
        )
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if check_mask is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel():
        check_mask(mask, positions if isinstance(positions, torch.Tensor) else None)


def refuse_broken_kernels(model: torch.nn.Module) -> None:
    """Refuse, before any layer runs, a CUDA training forward whose FlashAttention 4 varlen backward is wrong: head
    dims below 32. Measured with flash-attn-4 4.0.0b36 on an H200 (`benchmarks/gpu_fa4_backward.py`, results in
    benchmarks/results/gpu-2026-11-27-h200/): at head dim 16 its varlen backward's dq, dk and dv were 0.7-1.4
    (relative) away from float32 attention while the forward and the unpacked `flash_attn_func` were right; at 32 and
    64 both were right. Packed rows always take the varlen kernel, so their gradients would be wrong. Idempotent."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "flash_attention_4" and min(
            attention_head_dims(config), default=32) < 32:
        registry.add_forward_pre_hook(input_module(model), "broken kernels", _refuse_small_flash_attention_4_heads)


def _refuse_small_flash_attention_4_heads(module, args, kwargs):
    if not (module.training and torch.is_grad_enabled()):
        return
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    tensor = input_ids if isinstance(input_ids, torch.Tensor) else kwargs.get("inputs_embeds")
    if _on_cuda(tensor):
        raise UnsupportedSetupError(
            f"attn_implementation='flash_attention_4' with head_dim {min(attention_head_dims(module.config))}: "
            "FlashAttention 4's varlen backward computes wrong gradients below head dim 32 on CUDA (measured with "
            "flash-attn-4 4.0.0b36: dq, dk and dv 0.7-1.4 off at head dim 16; forward and head dims 32-64 right), and "
            "packed rows always take it. Train this model with `attn_implementation='sdpa'` (or "
            "'flash_attention_2'/'_3')."
        )


def _on_cuda(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda


def input_module(model: torch.nn.Module) -> torch.nn.Module:
    """The base model where it takes `position_ids`: a causal LM calls it through `__call__` with the mask and
    positions it was given, even inside PEFT's wrappers, which call the causal LM's `forward` directly. Models whose
    base takes no positions (RWKV, xLSTM, Mamba) are checked where they are called."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's transformers model
    base = getattr(inner, "base_model", inner)
    decoder = getattr(base, "decoder", None)
    if isinstance(decoder, torch.nn.Module) and "position_ids" in inspect.signature(decoder.forward).parameters:
        base = decoder  # OPT's causal LM calls its base model's decoder directly, never the base model
    return base if "position_ids" in inspect.signature(base.forward).parameters else inner


class _UnpackedForwards(threading.local):
    depth = 0  # > 0 inside `unpacked_forwards()` on this thread


_unpacked = _UnpackedForwards()


@contextlib.contextmanager
def unpacked_forwards() -> Iterator[None]:
    """Forwards in this block take unpacked rows on purpose and run backward in eval mode (`verify_packing`'s
    documents alone): the eval-mode guard asks them for no documents. Per thread."""
    _unpacked.depth += 1
    try:
        yield
    finally:
        _unpacked.depth -= 1


def _refuse_batch_without_documents(module, args, kwargs):
    mask = kwargs.get("attention_mask")
    if not (module.training and torch.is_grad_enabled()) or _tells_documents(kwargs, mask):
        return
    raise ContaminationError(
        f"A training batch ({_inputs(args, kwargs)}) reached a model configured for packing "
        f"with {_describe(mask)} and no `position_ids`: nothing tells where its documents start, so packed rows would "
        "attend across documents (stock `trl.SFTTrainer`'s default collator on `pack_dataset` rows does this). Train "
        "with `llm_packing.PackedSFTTrainer`, or collate with `llm_packing.DataCollatorWithPacking` (it sends the "
        "indexed mask and `position_ids`); to train unpacked rows instead, call `llm_packing.unconfigure_packing()`."
    )


def _refuse_backward_without_documents(module, args, kwargs, output):
    """In eval mode a forward is refused only when a backward pass runs through it: `from_pretrained` returns an
    eval-mode model, and a hand-written loop that never calls `model.train()` trains all the same (most decoders have
    no dropout to show it), with `labels` or a loss of its own. Inference that leaves gradients on never runs a
    backward, and is not refused."""
    mask = kwargs.get("attention_mask")
    if module.training or not torch.is_grad_enabled() or _unpacked.depth or _tells_documents(kwargs, mask):
        return
    hidden = output[0] if isinstance(output, (tuple, dict)) else output
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(functools.partial(_refuse_backward, inputs=_inputs(args, kwargs),
                                               described=_describe(mask)))


def _refuse_backward(gradient, *, inputs: str, described: str):
    raise ContaminationError(
        f"A backward pass ran through a forward of a model configured for packing in eval mode ({inputs}, "
        f"{described}, no `position_ids`): a training step with nothing telling where its documents start, "
        "so packed rows would attend across documents. Call `model.train()` before training (`from_pretrained` "
        "returns an eval-mode model), and collate with `llm_packing.DataCollatorWithPacking` (it sends the indexed "
        "mask and `position_ids`); to train unpacked rows instead, call `llm_packing.unconfigure_packing()`."
    )


def _tells_documents(kwargs, mask) -> bool:
    """Whether a forward's inputs say where its documents start: `position_ids`, or document ids in its mask."""
    if kwargs.get("position_ids") is not None:
        return True
    return is_integer_mask(mask) and bool(mask.numel()) and documents_of(mask).is_packed


def _inputs(args, kwargs) -> str:
    name, tokens = _input_tensor(args, kwargs)
    if tokens is None:
        return "inputs of unknown shape"
    described = f"{name} of shape {tuple(tokens.shape)}"
    # PEFT's prompt tuning and p-tuning pass embeddings with their virtual tokens, and drop `position_ids`.
    return described if name == "input_ids" else f"{described}; PEFT's prompt learning cannot be packed, use LoRA"


def _describe(mask) -> str:
    if mask is None:
        return "no `attention_mask`"
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return "a 0/1 `attention_mask`"
    return f"an `attention_mask` of shape {tuple(mask.shape)}"
