"""`PackedDPOTrainer`: TRL's `DPOTrainer` with every chosen/rejected forward run packed, the loss code unchanged.

`DPOTrainer` runs the policy and the reference on one padded batch of `[chosen..., rejected...]` sequences, through the
fused LM head TRL adds to both (`model(..., labels=labels, fused_lm_head=True)`). This subclass makes that head pack
the real tokens of the batch ([`~llm_packing.batches.padded_forward.pack_fused_lm_head`]), so padding costs no compute,
while each sequence attends only to itself with positions from 0: the per-token log-probs, and so the loss of every
`loss_type` and every logged metric, are TRL's own.
"""

import pyarrow.compute as pc
import torch
from datasets import Dataset
from trl import DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from ..batches.padded_forward import pack_trainer_models
from ..core.checks import check_bool
from ..errors import PackingValueError, SequenceTooLongError


class PackedDPOTrainer(DPOTrainer):
    """
    TRL's [`~trl.DPOTrainer`] whose policy and reference forwards run packed: the real tokens of each padded batch of
    chosen and rejected sequences go into one packed row per batch, isolated by
    [`~llm_packing.configure_packing`], and the per-token log-probs come back in TRL's padded layout.

    Takes the same arguments as `DPOTrainer`. On top of it:
    - [`~llm_packing.configure_packing`] is applied to the policy and the reference model (process-wide) and
      [`~llm_packing.verify_packing`] checks the policy, unless `verify_packing=False`;
    - no sequence is cut: TRL's collator truncates a prompt + completion longer than `max_length`, this trainer
      refuses it (before training for map-style datasets, at the batch otherwise);
    - an empty chosen or rejected completion is refused (its log-prob would be 0, whatever the model).

    With `precompute_ref_log_probs=True`, TRL computes the reference log-probs inside its constructor, before the
    packing is installed: they are exact, just not packed.

    Args:
        verify_packing (`bool`, *optional*, defaults to `True`):
            Run [`~llm_packing.verify_packing`] on the policy after configuring the hook.
        model, ref_model, args, **kwargs:
            As for [`~trl.DPOTrainer`].

    Example:
    ```python
    >>> import copy, tempfile
    >>> from datasets import Dataset
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from trl import DPOConfig
    >>> from llm_packing import PackedDPOTrainer
    >>> from llm_packing.demo.chitchat import load_demo_tokenizer
    >>> pairs = Dataset.from_dict({"prompt": ["Hello, how are", "Good"], "chosen": [" you?</s>", " morning</s>"],
    ...                            "rejected": [" things going today?</s>", " bye</s>"]})
    >>> model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32_768, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, bf16=False, max_length=32)
    >>> trainer = PackedDPOTrainer(model, copy.deepcopy(model), args=args, train_dataset=pairs,
    ...                            processing_class=load_demo_tokenizer())
    >>> batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    >>> batch["attention_mask"].shape  # TRL's padded batch: 2 chosen rows, then 2 rejected rows
    torch.Size([4, 9])
    >>> round(trainer.compute_loss(trainer.model, batch).item(), 4)  # packed: one row; policy == reference: ln 2
    0.6931
    >>> from llm_packing import unconfigure_packing
    >>> unconfigure_packing()  # the trainer configured the hook process-wide; it stays until undone

    ```
    """

    def __init__(self, model, ref_model=None, args=None, *positional, verify_packing: bool = True, **kwargs):
        check_bool("verify_packing", verify_packing)
        super().__init__(model, ref_model, args, *positional, **kwargs)
        max_length = self.args.max_length
        for name, dataset in _named_datasets(self.train_dataset, self.eval_dataset):
            _check_pairs(name, dataset, max_length)
        if isinstance(self.data_collator, DataCollatorForPreference):
            # The packed forward refuses an over-long sequence; TRL's collator would cut it first.
            self.data_collator.max_length = None
        # One packed row per batch: the varlen route keeps attention per sequence, and no row is left part empty.
        pack_trainer_models(self, max_length=None, verify=verify_packing)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _check_batch(inputs, self.args.max_length)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _named_datasets(train_dataset, eval_dataset):
    yield "train_dataset", train_dataset
    if isinstance(eval_dataset, dict):
        yield from ((f"eval_dataset[{name!r}]", dataset) for name, dataset in eval_dataset.items())
    elif eval_dataset is not None:
        yield "eval_dataset", eval_dataset


def _check_pairs(name: str, dataset, max_length: int | None) -> None:
    """Refuse empty completions and over-long sequences of a tokenized map-style dataset, before any training."""
    if not isinstance(dataset, Dataset) or not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.features):
        return
    table = dataset.with_format("arrow")[:]
    prompt = pc.list_value_length(table["prompt_ids"]).to_numpy(zero_copy_only=False)
    for column in ("chosen_ids", "rejected_ids"):
        completion = pc.list_value_length(table[column]).to_numpy(zero_copy_only=False)
        if (completion == 0).any():
            row = int((completion == 0).argmax())
            raise PackingValueError(
                f"{name} row {row} has an empty `{column}` (0 tokens): its log-prob would be 0 whatever the model, "
                "and DPO would train on that. Drop such pairs before training, e.g. "
                f"`dataset.filter(lambda pair: len(pair['{column}']) > 0)`."
            )
        total = prompt + completion
        if max_length is not None and total.max() > max_length:
            row = int(total.argmax())
            raise SequenceTooLongError(
                f"{name} row {row}: prompt + {column.removesuffix('_ids')} is {int(total[row])} tokens, more than "
                f"`max_length`={max_length}. TRL would cut it; packing refuses to train on a cut sequence. Raise "
                f"`DPOConfig.max_length` to at least {int(total.max())} or drop the long pairs."
            )


def _check_batch(inputs: dict, max_length: int | None) -> None:
    """The same refusals at the batch, for datasets that could not be checked up front (iterable, untokenized)."""
    input_ids, completion_mask = inputs["input_ids"], inputs["completion_mask"]
    longest = int(inputs["attention_mask"].sum(dim=1).max())
    if max_length is not None and longest > max_length:
        raise SequenceTooLongError(
            f"A batch holds a prompt + completion of {longest} tokens, more than `max_length`={max_length}. TRL would "
            f"cut it; packing refuses to train on a cut sequence. Raise `DPOConfig.max_length` to at least {longest} "
            "or drop the long pairs."
        )
    if input_ids.shape != completion_mask.shape or input_ids.shape[0] % 2:
        raise PackingValueError(
            f"A DPO batch needs as many chosen as rejected rows and one `completion_mask` per token: got `input_ids` "
            f"{tuple(input_ids.shape)} and `completion_mask` {tuple(completion_mask.shape)}. Collate with TRL's "
            "`DataCollatorForPreference`."
        )
    empty = completion_mask.sum(dim=1) == 0
    if bool(empty.any()):
        row = int(torch.nonzero(empty)[0])
        half = "chosen" if row < input_ids.shape[0] // 2 else "rejected"
        raise PackingValueError(
            f"Batch row {row} ({half}) has an empty completion (0 tokens in `completion_mask`): its log-prob would be "
            "0 whatever the model. Drop pairs with an empty completion before training."
        )
