"""A packed forward for trainers that run the model on padded batches (TRL's DPO, GRPO, RLOO, KTO).

The real tokens of each row of a padded batch (left, right or both-side padding) become one document of a packed
batch: an indexed `attention_mask` and positions restarting at 0, so that with [`~llm_packing.configure_packing`]
every row attends only to itself. The model runs once on the packed rows, and each per-token output is scattered back
to the padded layout the trainer expects (zeros on padding), so the trainer's own loss code runs unchanged.

TRL 1.16 computes per-token log-probabilities through its fused LM head (`model(..., labels=labels,
fused_lm_head=True)`, see `trl.trainer.utils.add_fused_lm_head`). [`pack_fused_lm_head`] wraps that forward: the
labels are shifted in the padded layout and handed over as `shift_labels`, so a document's last token never scores the
next document's first one.
"""

import functools
import types
from dataclasses import dataclass

import numpy as np
import torch

from ..core.binpack import pack_sequences
from ..core.rows import position_ids, segment_aranges
from ..errors import (
    ContaminationError,
    PackingTypeError,
    PackingValueError,
    SequenceTooLongError,
    UnsupportedSetupError,
)
from ..hook import registry
from ..hook.configure import is_packing_configured
from ..hook.verify import configure_and_verify


# Per-token fields of TRL's `FusedCausalLMOutput`, each `(batch, length - 1)`, zero where the label is -100.
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


@dataclass(frozen=True)
class PaddedToPacked:
    """
    Where each real token of a padded batch sits in the packed batch.

    Attributes:
        input_ids (`torch.Tensor`): `(rows, length)` packed token ids, 0 on padding.
        attention_mask (`torch.Tensor`): `(rows, length)` indexed mask: 1-based document id per token, 0 on padding.
        position_ids (`torch.Tensor`): `(rows, length)` positions restarting at 0 for every document.
        padded_index (`torch.Tensor`): flat index in the padded batch of each real token, in packed order.
        packed_index (`torch.Tensor`): flat index in the packed batch of the same tokens.
        padded_shape (`tuple[int, int]`): `(batch_size, sequence_length)` of the padded batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    padded_index: torch.Tensor
    packed_index: torch.Tensor
    padded_shape: tuple[int, int]

    def pack(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """Move a `(batch_size, sequence_length)` tensor of the padded batch into the packed packing."""
        flat = values.new_full((self.input_ids.numel(),), fill)
        flat[self.packed_index] = values.reshape(-1)[self.padded_index]
        return flat.view(self.input_ids.shape)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Scatter a `(rows, length)` tensor of the packed batch back to the padded layout, zeros on padding. Keeps
        gradients."""
        picked = values.reshape(-1).index_select(0, self.packed_index)
        flat = values.new_zeros((self.padded_shape[0] * self.padded_shape[1],))
        return flat.index_copy(0, self.padded_index, picked).view(self.padded_shape)


def pack_padded_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                      max_length: int | None = None) -> PaddedToPacked:
    """
    Pack the real tokens of each row of a padded batch as one document, rows kept whole.

    Args:
        input_ids (`torch.Tensor`):
            `(batch_size, sequence_length)` token ids.
        attention_mask (`torch.Tensor`):
            0/1 (or bool) mask of the same shape; each row's real tokens must be one contiguous run.
        max_length (`int`, *optional*):
            Tokens per packed row. `None` packs everything into one row; otherwise, rows are filled by best-fit
            decreasing ([`~llm_packing.pack_sequences`]) when the batch does not fit one row.

    Returns:
        [`PaddedToPacked`]

    Raises:
        `SequenceTooLongError`: a row holds more than `max_length` real tokens.
        `PackingValueError`: a mask that is not 0/1, or a row with padding between real tokens.

    Example:
    ```python
    >>> import torch
    >>> input_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    >>> packing = pack_padded_batch(input_ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]]))
    >>> packing.input_ids
    tensor([[5, 6, 7, 8, 9]])
    >>> packing.attention_mask
    tensor([[1, 1, 2, 2, 2]])
    >>> packing.position_ids
    tensor([[0, 1, 0, 1, 2]])
    >>> packing.unpack(packing.position_ids)
    tensor([[0, 0, 0, 1],
            [0, 1, 2, 0]])

    ```
    """
    lengths, starts = _row_runs(input_ids, attention_mask)
    real_rows = np.flatnonzero(lengths)
    capacity = int(lengths.sum()) if max_length is None else max_length
    if max_length is not None and lengths.max(initial=0) > max_length:
        row = int(lengths.argmax())
        raise SequenceTooLongError(
            f"Row {row} of the padded batch holds {int(lengths[row])} real tokens, more than `max_length`="
            f"{max_length}. Raise `max_length` to at least {int(lengths.max())}, or shorten the sequence before "
            "batching (packing never cuts a sequence)."
        )
    if lengths.sum() <= capacity:
        bins = [real_rows]
    else:
        result = pack_sequences(lengths[real_rows], capacity)
        bins = [real_rows[np.asarray(members)] for members in result.bins]
    width = max(int(lengths[members].sum()) for members in bins) if len(real_rows) else 0
    padded_index, packed_index, document_ids, positions = [], [], [], []
    for row, members in enumerate(bins):
        member_lengths = lengths[members]
        within = position_ids(member_lengths)
        padded_index.append(segment_aranges(members * attention_mask.shape[1] + starts[members], member_lengths))
        packed_index.append(row * width + np.arange(len(within)))
        document_ids.append(np.repeat(np.arange(1, len(members) + 1), member_lengths))
        positions.append(within)
    device = input_ids.device
    padded_index = torch.from_numpy(np.concatenate(padded_index)).to(device)
    packed_index = torch.from_numpy(np.concatenate(packed_index)).to(device)
    packed_mask = torch.zeros(len(bins) * width, dtype=torch.long, device=device)
    packed_mask[packed_index] = torch.from_numpy(np.concatenate(document_ids)).to(device)
    packed_positions = torch.zeros_like(packed_mask)
    packed_positions[packed_index] = torch.from_numpy(np.concatenate(positions)).to(device)
    packed_ids = input_ids.new_zeros(len(bins) * width)
    packed_ids[packed_index] = input_ids.reshape(-1)[padded_index]
    shape = (len(bins), width)
    return PaddedToPacked(packed_ids.view(shape), packed_mask.view(shape), packed_positions.view(shape), padded_index,
                        packed_index, tuple(input_ids.shape))


def pack_fused_lm_head(model, *, max_length: int | None = None):
    """
    Make the fused LM head TRL adds to `model` (`trl.trainer.utils.add_fused_lm_head`) run every padded batch packed.

    `model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)` then packs the real tokens of each row
    ([`pack_padded_batch`]), runs the backbone once on the packed rows and returns TRL's `FusedCausalLMOutput` with
    every per-token field (`log_probs`, `entropy`, ...) back in the padded `(batch_size, sequence_length - 1)` layout,
    zeros on padding. Calls without `fused_lm_head=True` (generation, `verify_packing`) are untouched. Idempotent;
    [`~llm_packing.unconfigure_packing`] puts TRL's fused head back.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            The model TRL patched (for PEFT, `peft_model.get_base_model()`).
        max_length (`int`, *optional*):
            Tokens per packed row; `None` packs each batch into one row.

    Raises (on each packed call): `ContaminationError` if [`~llm_packing.configure_packing`] is not in effect,
    `SequenceTooLongError` for a row longer than `max_length`, `PackingValueError` for a batch the packed layout cannot
    reproduce exactly, `UnsupportedSetupError` for inputs it does not handle (images, MoE router logits, pre-shifted
    labels).
    """
    forward = model.__dict__.get("forward")
    if forward is None or not hasattr(forward, "__func__"):
        raise UnsupportedSetupError(
            f"`model` ({type(model).__name__}) has no fused LM head to pack: its `forward` is the class's own. Call "
            "`trl.trainer.utils.add_fused_lm_head(model)` first (TRL's DPO and GRPO trainers do it in their "
            "constructor)."
        )
    if getattr(forward.__func__, "_packs_padded_batches", False):
        return model
    fused_forward = forward.__func__

    @functools.wraps(fused_forward)
    def packed_fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, **kwargs):
        if not fused_lm_head:
            return fused_forward(self, *args, labels=labels, shift_labels=shift_labels, **kwargs)
        input_ids, attention_mask = _check_call(args, kwargs, labels, shift_labels)
        packing = pack_padded_batch(input_ids, attention_mask, max_length=max_length)
        shift_labels = packing.pack(next_token_labels(labels, attention_mask), -100)
        outputs = fused_forward(
            self, input_ids=packing.input_ids, attention_mask=packing.attention_mask,
            position_ids=packing.position_ids, shift_labels=shift_labels, fused_lm_head=True, **kwargs,
        )
        for name in _PER_TOKEN_FIELDS:
            value = getattr(outputs, name)
            if value is not None:
                outputs[name] = packing.unpack(value)[:, :-1]
        return outputs

    packed_fused_forward._packs_padded_batches = True
    with registry.lock:  # undone by `unconfigure_packing`: TRL's fused head is left as TRL made it
        registry.replace_attribute(model, "forward", types.MethodType(packed_fused_forward, model), configures=False)
    return model


def pack_trainer_models(trainer, *, max_length: int | None, verify: bool) -> None:
    """
    For a TRL trainer that built its fused LM heads (DPO, GRPO): [`~llm_packing.configure_packing`] on the policy and
    the reference model, [`pack_fused_lm_head`] on both, then [`~llm_packing.verify_packing`] on the policy (logged).
    """
    # Under `torch_compile=True` the module `torch.compile` wraps: its own `forward` is what the compiled one calls.
    models = [trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(trainer.accelerator.unwrap_model(trainer.ref_model, keep_torch_compile=False))
    for model in models:
        # TRL adds the fused head to the model under PEFT's wrapper.
        pack_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model,
                           max_length=max_length)
    configure_and_verify(models, verify=verify, autocast=trainer.accelerator.autocast)


def next_token_labels(labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """
    The label each position scores (`labels` shifted left by one, -100 at the end), refusing labels a padding
    position would score: packed, padding has no hidden state.

    Example:
    ```python
    >>> import torch
    >>> next_token_labels(torch.tensor([[-100, 6, 7, -100]]), torch.tensor([[1, 1, 1, 0]]))
    tensor([[   6,    7, -100, -100]])

    ```
    """
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    scored_on_padding = (attention_mask == 0) & (shifted != -100)
    if bool(scored_on_padding.any()):
        row, col = map(int, scored_on_padding.nonzero()[0])
        raise PackingValueError(
            f"`labels` row {row} scores token {col + 1} from padding position {col}: the padded forward predicts it "
            "from a padding token's hidden state, which a packed batch does not have. Set the labels of padding "
            "positions to -100, as TRL's trainers do."
        )
    return shifted


def _check_call(args, kwargs, labels, shift_labels) -> tuple[torch.Tensor, torch.Tensor]:
    if not is_packing_configured():
        raise ContaminationError(
            "`fused_lm_head=True` on a model whose padded batches are packed, but `configure_packing` is not in "
            "effect: the packed rows would attend to each other. Call `llm_packing.configure_packing(model)` first "
            "(PackedDPOTrainer and PackedGRPOTrainer do)."
        )
    extra = sorted(set(kwargs) - {"input_ids", "attention_mask", "use_cache", "num_items_in_batch"})
    if args or extra or shift_labels is not None or kwargs.get("use_cache"):
        raise UnsupportedSetupError(
            f"A packed fused forward got inputs it cannot pack: positional={len(args)}, keyword={extra}, "
            f"shift_labels={'given' if shift_labels is not None else None}, use_cache={kwargs.get('use_cache')}. "
            "Allowed: `input_ids`, `attention_mask`, `labels`, `use_cache=False`, `num_items_in_batch` (text only, "
            "no MoE router logits, no context/sequence parallelism). Use TRL's own trainer for these inputs."
        )
    input_ids, attention_mask = kwargs.pop("input_ids", None), kwargs.pop("attention_mask", None)
    shapes = {name: tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
              for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels))}
    if len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 2:
        raise PackingTypeError(
            f"`input_ids`, `attention_mask` and `labels` must be 2-D tensors of one shape (batch_size, "
            f"sequence_length), got {shapes}. Pass the padded batch as the trainer's collator builds it."
        )
    return input_ids, attention_mask


def _row_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Length and first column of each row's real tokens (one host sync), refusing masks packing cannot reproduce."""
    if tuple(input_ids.shape) != tuple(attention_mask.shape) or input_ids.dim() != 2:
        raise PackingTypeError(
            f"`input_ids` {tuple(input_ids.shape)} and `attention_mask` {tuple(attention_mask.shape)} must be 2-D and "
            "of one shape (batch_size, sequence_length). Pass the padded batch as the collator builds it."
        )
    mask = attention_mask.detach().cpu().numpy()
    if ((mask != 0) & (mask != 1)).any():
        raise PackingValueError(
            f"`attention_mask` must be 0/1 (a padded batch), got values {np.unique(mask)[:8].tolist()}. An indexed "
            "mask is packed already: call the model with it directly."
        )
    real = mask.astype(bool)
    lengths = real.sum(axis=1)
    starts = real.argmax(axis=1)
    ends = real.shape[1] - real[:, ::-1].argmax(axis=1)
    gapped = (lengths > 0) & (ends - starts != lengths)
    if gapped.any():
        row = int(np.flatnonzero(gapped)[0])
        raise PackingValueError(
            f"`attention_mask` row {row} has padding between real tokens ({mask[row].tolist()[:32]}): a packed "
            "document is contiguous, so its positions would differ from the padded forward's. Pad only on the left "
            "and/or right of each row."
        )
    return lengths, starts
