"""`DataCollatorWithPacking`: packed rows (or raw examples) to the batch the model hook expects.

Every tensor is built with numpy operations over the whole batch (one loop per row, to read the features). Layouts:
- default: `[B, L]` rows with an indexed `attention_mask` (`[1, 1, 2, 2, 2, 0]`); needs `configure_packing(model)`;
- `padding_free=True`: one `[1, sum of tokens]` row with `position_ids` and no mask, isolated by transformers' own
  packed-sequence detection (which needs `use_cache=False`, as `Trainer` sets);
- `return_flash_attn_kwargs=True`: precomputed `cu_seq_lens_q/k` and `max_length_q/k` and no mask, for the
  `flash_attention_*` backends only.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.data.data_collator import DataCollatorMixin

from ..core.binpack import pack_sequences
from ..core.checks import check_bool, check_integer, check_processor
from ..core.rows import (
    IGNORE_INDEX,
    MASK_COLUMNS,
    check_tokens,
    flat_integers,
    ignore_document_starts,
    ignore_masked,
    length_error,
    padding_error,
    position_ids,
    segment_aranges,
)
from ..errors import ContaminationError, PackingTypeError, PackingValueError, SequenceTooLongError


@dataclass
class DataCollatorWithPacking(DataCollatorMixin):
    """
    Data collator for packed causal-LM training: every document attends only to itself and restarts its positions.

    Takes either packed rows (with `seq_lengths`, as [`~llm_packing.data.pack.pack_dataset`] makes them) or raw
    tokenized examples, each one document, which it packs into rows of `max_length` tokens (or, without `max_length`,
    puts one per row). `labels` default to `input_ids`; TRL's `completion_mask` / `assistant_masks` set the labels
    where they are 0 to -100, as in `pack_dataset` (drop the column to train on those tokens). A raw example whose
    `attention_mask` holds a 0 (tokenized with padding) is refused: its pad tokens would be packed as document tokens.

    Args:
        pad_token_id (`int`, *optional*, defaults to `0`):
            Token id used for padding; padding is never attended to nor trained on, but it is embedded, so it must be
            >= 0. Likewise `input_ids` must be in [0, 2**31 - 1], as in `pack_dataset`'s int32 columns, and `labels`
            too or -100 (anything else is refused; ids at or above the vocabulary size are left for the model to
            refuse, as the collator does not know the vocabulary).
        max_length (`int`, *optional*):
            Longest row allowed. Raw examples are packed into rows of at most this many tokens.
        pad_to_multiple_of (`int`, *optional*):
            Pad the sequence dimension to a multiple of this value.
        padding_free (`bool`, *optional*, defaults to `False`):
            Flatten the batch into a single row with `position_ids` and no `attention_mask`, for models that are not
            configured for packing (like [`~transformers.DataCollatorWithFlattening`]). On sdpa/eager this builds a
            dense mask over the whole flattened batch, which costs more than `B` separate rows. transformers
            isolates the documents from the `position_ids` alone, so anything that drops them merges the documents:
            PEFT's prompt tuning and p-tuning do (with a warning).
        return_flash_attn_kwargs (`bool`, *optional*, defaults to `False`):
            Add `cu_seq_lens_q/k` (`int32`, over the `B * L` flattened tokens, each row's trailing padding one
            segment) and `max_length_q/k` (`int`), and leave out `attention_mask`, which FlashAttention would give
            precedence over them. For the `flash_attention_*` backends only.
        check_model_configured (`bool`, *optional*, defaults to `True`):
            Raise [`~llm_packing.errors.ContaminationError`] when an indexed mask with several documents in a row is
            emitted while `configure_packing` is not applied. In a DataLoader worker process (`num_workers > 0`),
            which may be a fresh process (the `spawn` start method), whether it was applied in the main process
            when the workers started counts. Turn off only if you apply the hook some other way.
        return_tensors (`str`, *optional*, defaults to `"pt"`):
            Only `"pt"` is supported.
        processor (`ProcessorMixin`, *optional*):
            For image-text rows (`pack_dataset(..., processor=processor)`, or one TRL `messages` + `images`
            conversation per row): each document is tokenized and its images processed by this processor, as TRL's
            vision collator does, then laid out packed (see `packed_conversations.py`). `pad_token_id` pads the
            `input_ids`; labels are -100 on image placeholder tokens too.
        chat_template (`str`, *optional*):
            With `processor`: a chat template other than the processor's.
        assistant_only_loss (`bool`, *optional*, defaults to `False`):
            With `processor`: labels -100 outside the assistant turns (the chat template's `{% generation %}`
            blocks), as TRL's `assistant_only_loss`.

    Example:
    ```python
    >>> from llm_packing.batches.collator import DataCollatorWithPacking
    >>> collator = DataCollatorWithPacking(pad_token_id=0, check_model_configured=False)
    >>> batch = collator([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]},
    ...                   {"input_ids": [6, 7], "seq_lengths": [2]}])
    >>> batch["input_ids"]
    tensor([[1, 2, 3, 4, 5],
            [6, 7, 0, 0, 0]])
    >>> batch["labels"]
    tensor([[-100,    2, -100,    4,    5],
            [-100,    7, -100, -100, -100]])
    >>> batch["position_ids"]
    tensor([[0, 1, 0, 1, 2],
            [0, 1, 0, 0, 0]])
    >>> batch["attention_mask"]
    tensor([[1, 1, 2, 2, 2],
            [1, 1, 0, 0, 0]])

    ```
    """

    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    padding_free: bool = False
    return_flash_attn_kwargs: bool = False
    check_model_configured: bool = True
    return_tensors: str = "pt"
    processor: Any = None
    chat_template: str | None = None
    assistant_only_loss: bool = False

    def __post_init__(self):
        for name in _BOOLEAN_OPTIONS:
            check_bool(name, getattr(self, name))
        check_integer("pad_token_id", self.pad_token_id, minimum=0, meaning="padding is embedded like any token",
                      fix="Use the tokenizer's: `tokenizer.pad_token = tokenizer.eos_token` if it has none, then "
                      "`pad_token_id=tokenizer.pad_token_id`.")
        for name in ("max_length", "pad_to_multiple_of"):
            check_integer(name, getattr(self, name), optional=True)
        if self.return_tensors != "pt":
            raise PackingValueError(
                f"`return_tensors` must be 'pt', got {self.return_tensors!r}: packed batches are built as torch "
                "tensors only."
            )
        if self.processor is not None:
            check_processor("processor", self.processor)
        if self.processor is not None and (self.padding_free or self.return_flash_attn_kwargs):
            raise PackingValueError(
                "`padding_free` / `return_flash_attn_kwargs` are for text rows; with a `processor`, image-text rows "
                "are laid out with an indexed `attention_mask`. Leave both off."
            )
        _keep_trainer_columns(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled: `_configured_when_sent` speaks for the process that unpickles it (a worker as it starts), not for
        one that inherits a copy made earlier (a `fork`ed worker, whose registry is the main process's own)."""
        self.__dict__.update(state, _unpickled_in=os.getpid())

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into a DataLoader worker started by `spawn` (macOS, Windows) or `forkserver`, whose hook registry is
        fresh and says nothing of the model in the main process: the collator carries whether packing is configured
        there as the workers start. (A `fork`ed worker inherits the registry itself.)"""
        state = self.__dict__.copy()
        if torch.utils.data.get_worker_info() is None:
            state["_configured_when_sent"] = _hook_configured()
        return state

    def torch_call(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if self.processor is not None:
            return self._image_text_call(features)
        rows = self._rows(features)
        doc_lengths = np.concatenate([lengths for _, _, lengths in rows])
        docs_per_row = np.array([len(lengths) for _, _, lengths in rows])
        row_lengths = np.array([len(ids) for ids, _, _ in rows])
        input_ids = np.concatenate([ids for ids, _, _ in rows])
        labels = ignore_document_starts(np.concatenate([labels for _, labels, _ in rows]), doc_lengths)
        positions = position_ids(doc_lengths)
        uses_mask = not (self.padding_free or self.return_flash_attn_kwargs)
        if uses_mask and self.check_model_configured and docs_per_row.max() > 1:
            self._check_model_configured()
        if self.padding_free:
            row_lengths, docs_per_row = row_lengths.sum(keepdims=True), docs_per_row.sum(keepdims=True)
        width = int(row_lengths.max())
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        tokens = np.arange(width)[None, :] < row_lengths[:, None]
        batch = {
            "input_ids": _padded(tokens, input_ids, self.pad_token_id),
            "labels": _padded(tokens, labels, IGNORE_INDEX),
            "position_ids": _padded(tokens, positions, 0),
        }
        if uses_mask:
            document_index = segment_aranges(np.ones(1, np.int64), docs_per_row)  # 1, 2, ... in each row
            batch["attention_mask"] = _padded(tokens, np.repeat(document_index, doc_lengths), 0)
        if self.return_flash_attn_kwargs:
            # Each row's trailing padding is one segment: padding adds one entry to `cu_seq_lens`, not one per token.
            row_ends = np.cumsum(docs_per_row)
            segments = np.insert(doc_lengths, row_ends, width - row_lengths)
            segments = segments[segments > 0]
            cu_seq_lens = torch.from_numpy(np.concatenate([[0], np.cumsum(segments)]).astype(np.int32))
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu_seq_lens
            batch["max_length_q"] = batch["max_length_k"] = int(segments.max())
        return batch

    def _image_text_call(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        from .packed_conversations import collate_conversations

        batch, documents_per_row = collate_conversations(
            features, self.processor, chat_template=self.chat_template, assistant_only_loss=self.assistant_only_loss,
            pad_to_multiple_of=self.pad_to_multiple_of, max_length=self.max_length, pad_token_id=self.pad_token_id)
        if self.check_model_configured and documents_per_row > 1:
            self._check_model_configured()
        return batch

    def _rows(self, features: list[dict[str, Any]]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(input_ids, labels, seq_lengths) of each row, validated; raw examples packed into rows first."""
        if isinstance(features, Mapping) or not all(isinstance(feature, Mapping) for feature in features):
            kinds = sorted({type(feature).__name__ for feature in features})
            got = type(features).__name__ if isinstance(features, Mapping) else f"a list of {kinds}"
            raise PackingTypeError(
                f"`features` must be a list of dicts (one per example), got {got}. Pass `[dataset[i] for i in "
                "indices]`, as the Trainer's dataloader does, not a batch slice `dataset[:n]`."
            )
        if not features:
            raise PackingValueError("`features` is empty: a batch needs at least one example.")
        packed = ["seq_lengths" in feature for feature in features]
        if any(packed) and not all(packed):
            raise PackingValueError(
                f"Features {[i for i, p in enumerate(packed) if not p]} have no 'seq_lengths' but the others do: a "
                "batch mixes packed rows and raw examples. Pack the whole dataset with `pack_dataset`, or none of it."
            )
        examples = [_example(feature, i, raw=not packed[0]) for i, feature in enumerate(features)]
        limit = "row" if packed[0] else "document"
        lengths = np.array([len(ids) for ids, _ in examples], dtype=np.int64)
        if self.max_length is not None and lengths.max() > self.max_length:
            i = int(np.argmax(lengths))
            raise SequenceTooLongError(
                f"Feature {i} has a {limit} of {lengths[i]} tokens, longer than the collator's `max_length`="
                f"{self.max_length}. Raise `max_length`, or cut long documents beforehand with "
                "`pack_dataset(..., overflow='split')` or 'truncate'."
            )
        if packed[0]:
            return [(ids, labels, _seq_lengths(feature, len(ids), i))
                    for i, ((ids, labels), feature) in enumerate(zip(examples, features, strict=True))]
        kept = np.flatnonzero(lengths)  # an empty example is no document
        if len(kept) == 0:
            raise PackingValueError("Every example in the batch has empty 'input_ids'; there is nothing to train on.")
        if self.max_length is None:
            return [(*examples[i], lengths[i : i + 1]) for i in kept]
        result = pack_sequences(lengths[kept], self.max_length)
        return [
            (
                np.concatenate([examples[kept[d]][0] for d in bin_]),
                np.concatenate([examples[kept[d]][1] for d in bin_]),
                lengths[kept[bin_]],
            )
            for bin_ in np.split(result.order, result.bin_offsets[1:-1])
        ]

    def _check_model_configured(self) -> None:
        if _hook_configured():
            return
        sent = getattr(self, "_unpickled_in", None) == os.getpid() and getattr(self, "_configured_when_sent", False)
        if sent and torch.utils.data.get_worker_info() is not None:
            return
        raise ContaminationError(
            "This batch has rows with several documents and an indexed `attention_mask` ([1, 1, 2, 2, 2, 0]), but "
            "the model hook is not applied: transformers would merge the documents into one. Call "
            "`llm_packing.configure_packing(model)` before training, or use `padding_free=True` for an "
            "unconfigured model (`check_model_configured=False` if you apply the hook yourself). In a DataLoader "
            "worker process the collator goes by whether the hook was applied in the main process when the workers "
            "started: configure the model before iterating the DataLoader."
        )


_BOOLEAN_OPTIONS = ("padding_free", "return_flash_attn_kwargs", "check_model_configured", "assistant_only_loss")


def _hook_configured() -> bool:
    try:
        from ..hook.configure import is_packing_configured
    except ImportError:  # the hook cannot even be imported, so it cannot have been applied
        return False
    return is_packing_configured()


def _keep_trainer_columns(collator) -> None:
    """A `transformers.Trainer` keeps `seq_lengths` for this collator (`llm_packing.hook.trainer_columns`; through the
    hook's registry; `unconfigure_packing` undoes it, then keeps it again while this collator lives). Where nothing is
    configured it still does, without making packing configured: with its default `remove_unused_columns=True` the
    rows of `pack_dataset` would otherwise arrive whole, each taken as one document, instead of being refused for the
    unconfigured model."""
    from ..hook import trainer_columns

    trainer_columns.keep_packing_columns_for(collator)


def _example(feature: dict[str, Any], index: int, raw: bool) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of a feature, with -100 where a mask column is 0; `raw`: one unpacked document."""
    if "input_ids" not in feature:
        raise PackingValueError(f"Feature {index} has no 'input_ids' (keys: {sorted(feature)}).")
    input_ids = _integers(feature["input_ids"], "input_ids", index)
    if raw and feature.get("attention_mask") is not None:
        if not _integers(feature["attention_mask"], "attention_mask", index, len(input_ids)).all():
            raise padding_error(f"'attention_mask' of feature {index}")
    labels = input_ids.copy() if feature.get("labels") is None else \
        _integers(feature["labels"], "labels", index, len(input_ids))
    for name in MASK_COLUMNS:
        if feature.get(name) is not None:
            ignore_masked(labels, _integers(feature[name], name, index, len(input_ids)))
    return input_ids, labels


def _seq_lengths(feature: dict[str, Any], num_tokens: int, index: int) -> np.ndarray:
    seq_lengths = _integers(feature["seq_lengths"], "seq_lengths", index)
    if len(seq_lengths) and seq_lengths.min() > 0 and seq_lengths.sum() > num_tokens:
        raise PackingValueError(
            f"Feature {index} has {num_tokens} 'input_ids' but `seq_lengths` summing to {seq_lengths.sum()}: the row "
            "was cut after packing, as trl.SFTTrainer does to rows longer than `SFTConfig.max_length` when it "
            "prepares the dataset. Train with `llm_packing.PackedSFTTrainer`, or pass "
            "`dataset_kwargs={'skip_prepare_dataset': True}` to the SFTConfig."
        )
    if len(seq_lengths) == 0 or seq_lengths.min() <= 0 or seq_lengths.sum() != num_tokens:
        raise PackingValueError(
            f"Feature {index} has `seq_lengths`={seq_lengths.tolist()!r}, which must be positive and sum to its "
            f"{num_tokens} 'input_ids'. Build packed rows with `pack_dataset` rather than by hand."
        )
    return seq_lengths


def _integers(values, name: str, index: int, expected_length: int | None = None) -> np.ndarray:
    where = f"{name!r} of feature {index}"
    array = flat_integers(values.numpy(force=True) if isinstance(values, torch.Tensor) else values, where,
                          booleans=name in (*MASK_COLUMNS, "attention_mask"))
    if expected_length is not None and len(array) != expected_length:
        raise length_error(name, where, len(array), expected_length)
    if name in ("input_ids", "labels"):  # `seq_lengths` are checked against the row; masks hold any integer
        check_tokens(array, name, where)
    return array.astype(np.int64)


def _padded(tokens: np.ndarray, values: np.ndarray, fill: int) -> torch.Tensor:
    out = np.full(tokens.shape, fill, dtype=np.int64)
    out[tokens] = values
    return torch.from_numpy(out)
