"""`PackedSFTTrainer`: TRL's `SFTTrainer` for `pack_dataset` rows, trained exactly or refused before the first step.

Stock `SFTTrainer` given packed rows with its defaults cuts them to `SFTConfig.max_length` (1024) and collates them
with an all-ones mask, so documents attend to each other. This subclass keeps TRL's training loop, loss and logging,
and changes only what packed rows need: TRL's dataset preparation off (no truncation, no re-tokenizing), our
[`~llm_packing.batches.collator.DataCollatorWithPacking`], the hook configured and verified on the model. Every setting
that would cut or mix documents raises a [`~llm_packing.errors.PackingError`] from the constructor.
"""

import copy
import os

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset
from trl import SFTConfig, SFTTrainer

from ..batches.collator import DataCollatorWithPacking
from ..data.metadata import packed_max_length
from ..errors import PackingTypeError, PackingValueError, UnsupportedSetupError
from ..hook.verify import configure_and_verify
from .image_text import PACKED_COLUMNS, longest_row, prepare_image_text


# `SFTConfig()`'s own max_length: a value the user most likely never chose, so the packed rows' length replaces it.
_DEFAULT_MAX_LENGTH = SFTConfig.__dataclass_fields__["max_length"].default


class PackedSFTTrainer(SFTTrainer):
    """
    TRL's [`~trl.SFTTrainer`] for rows made by [`~llm_packing.data.pack.pack_dataset`]: no row is cut, every document
    attends only to itself with positions restarting at 0, and no document is trained to predict the next one's first
    token.

    Takes the same arguments as `SFTTrainer`. On top of it:
    - TRL's dataset preparation is skipped (`skip_prepare_dataset`): the rows are tokenized and packed already, and
      TRL would cut them to `SFTConfig.max_length`;
    - batches are collated by [`~llm_packing.batches.collator.DataCollatorWithPacking`] (indexed `attention_mask`,
    restarting
      `position_ids`, -100 on each document's first label) with `max_length` taken from the packed dataset;
    - when rows hold several documents, [`~llm_packing.configure_packing`] is applied to the model (process-wide; it
      stays applied after training) and [`~llm_packing.verify_packing`] checks it, unless `verify_packing=False`.

    Refused with a [`~llm_packing.errors.PackingError`] before the first step: a dataset without `seq_lengths` (not
    packed), any other collator (TRL's pads packed rows into one attention span), `packing=True` or
    `padding_free=True` in the `SFTConfig` (TRL would re-pack or flatten the rows with its own collator),
    `assistant_only_loss=True` (apply it when tokenizing, before packing), a `max_length` that differs between
    `pack_dataset`, the collator and the `SFTConfig` (`SFTConfig`'s default 1024 counts as unset), rows longer than
    that `max_length`, context or sequence parallelism, and a model the hook cannot isolate.

    Image-text conversations in TRL's vision format (`messages` + `images`, the model's processor as
    `processing_class`) are packed here, at `SFTConfig.max_length`, by their token counts with images expanded, and
    collated by the processor (`assistant_only_loss` applies); see `trainers/image_text.py` and docs/images.md.

    Args:
        verify_packing (`bool`, *optional*, defaults to `True`):
            Run [`~llm_packing.verify_packing`] on the model after configuring the hook (four forwards of at most 16
            tokens).
        model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs:
            As for [`~trl.SFTTrainer`].

    Example:
    ```python
    >>> import tempfile
    >>> from datasets import Dataset
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from trl import SFTConfig
    >>> from llm_packing import PackedSFTTrainer, pack_dataset
    >>> from llm_packing.demo.chitchat import load_demo_tokenizer
    >>> packed = pack_dataset(Dataset.from_dict({"input_ids": [[5, 6, 7], [8, 9], [10]]}), max_length=4)
    >>> model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32_000, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> args = SFTConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, bf16=False)
    >>> trainer = PackedSFTTrainer(model=model, args=args, train_dataset=packed,
    ...                            processing_class=load_demo_tokenizer())
    >>> batch = trainer.data_collator([packed[0], packed[1]])
    >>> batch["attention_mask"]
    tensor([[1, 1, 1, 2],
            [1, 1, 0, 0]])
    >>> batch["position_ids"]
    tensor([[0, 1, 2, 0],
            [0, 1, 0, 0]])
    >>> batch["labels"]
    tensor([[-100,    6,    7, -100],
            [-100,    9, -100, -100]])
    >>> from llm_packing import unconfigure_packing
    >>> unconfigure_packing()  # the trainer configured the hook process-wide; it stays until undone

    ```
    """

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, verify_packing: bool = True, **kwargs):
        args = _sft_config(args, model)
        image_text = prepare_image_text(args, model, processing_class, data_collator, train_dataset, eval_dataset)
        if image_text is not None:
            args, data_collator = image_text.args, image_text.data_collator
            train_dataset, eval_dataset = image_text.train_dataset, image_text.eval_dataset
        datasets_by_name = {"train_dataset": train_dataset, **_eval_datasets(eval_dataset)}
        _check_config(args, data_collator)
        max_length = _agreed_max_length(args, data_collator, datasets_by_name)
        # TRL mutates its config; keep the caller's untouched, as it may go on to build another trainer.
        args = copy.copy(args)
        args.max_length = max_length
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        our_collator = data_collator is None
        if our_collator:
            data_collator = DataCollatorWithPacking(max_length=max_length, pad_to_multiple_of=args.pad_to_multiple_of)
        new_output_dir = not os.path.exists(args.output_dir)
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs)
        try:
            if our_collator:
                self.data_collator.pad_token_id = _pad_token_id(self._tokenizer)
            if image_text is not None:  # TRL would prune a vision dataset to its raw columns
                self._signature_columns = PACKED_COLUMNS
            _check_parallelism(self.accelerator)
            if _several_documents_per_row(datasets_by_name):
                self._configure_model(verify_packing, processor=None if image_text is None else processing_class)
        except BaseException:
            # Trainer created the output folder; a refused setup leaves nothing behind.
            if new_output_dir and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
                os.rmdir(args.output_dir)
            raise

    def _configure_model(self, verify: bool, processor=None) -> None:
        where = f"[rank {self.args.process_index}/{self.args.world_size}] " if self.args.world_size > 1 else ""
        configure_and_verify(self.model, verify=verify, where=where, processor=processor)


def _sft_config(args, model) -> SFTConfig:
    if isinstance(args, SFTConfig):
        return args
    if args is None:  # as SFTTrainer names it
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return SFTConfig(f"{name.split('/')[-1]}-SFT")
    raise PackingTypeError(
        f"`args` must be a trl.SFTConfig, got {type(args).__name__}. Build one with the same fields: "
        "`SFTConfig(output_dir=..., ...)`."
    )


def _eval_datasets(eval_dataset) -> dict:
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {f"eval_dataset[{name!r}]": dataset for name, dataset in eval_dataset.items()}
    return {"eval_dataset": eval_dataset}


def _check_config(args: SFTConfig, data_collator) -> None:
    if args.packing:
        raise PackingValueError(
            "`packing=True` in the SFTConfig makes TRL pack the rows again, on top of pack_dataset's, and flatten "
            "them with its own collator. Set `packing=False` (recipe: `packing: false`): the rows are packed already."
        )
    if args.padding_free:
        raise PackingValueError(
            "`padding_free=True` in the SFTConfig makes TRL flatten the batches with its own collator. Set "
            "`padding_free=False`; for one flattened row per batch, pass "
            "`data_collator=DataCollatorWithPacking(padding_free=True)` (recipe: `padding_free: true`, a packing key)."
        )
    if args.assistant_only_loss:
        raise PackingValueError(
            "`assistant_only_loss=True` in the SFTConfig needs raw conversations, but the rows are tokenized and "
            "packed. Mask the labels when tokenizing (-100 outside assistant turns), before pack_dataset, and set "
            "`assistant_only_loss=False`."
        )
    if data_collator is not None and not isinstance(data_collator, DataCollatorWithPacking):
        what = type(data_collator).__name__
        if what == "DataCollatorForLanguageModeling":
            what += (" (TRL's: it ignores `seq_lengths` and sends an all-ones `attention_mask`, so the documents of a "
                     "row would attend to each other)")
        raise PackingTypeError(
            f"`data_collator` must be a DataCollatorWithPacking for packed rows, got {what}. Leave `data_collator` "
            "out: PackedSFTTrainer builds one."
        )


def _agreed_max_length(args: SFTConfig, data_collator, datasets_by_name: dict) -> int | None:
    """The one `max_length` of the packed datasets, the collator and the SFTConfig; refuses rows longer than it."""
    if datasets_by_name["train_dataset"] is None:
        raise PackingValueError("`train_dataset` is required: pass the output of `pack_dataset`.")
    sources = {}
    for name, dataset in datasets_by_name.items():
        _check_packed(name, dataset)
        sources[f"pack_dataset ({name})"] = packed_max_length(dataset)
    if args.max_length != _DEFAULT_MAX_LENGTH:
        sources["SFTConfig"] = args.max_length
    if data_collator is not None:
        sources["DataCollatorWithPacking"] = data_collator.max_length
    given = {source: value for source, value in sources.items() if value is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{source} {value}" for source, value in given.items())
        raise PackingValueError(
            f"`max_length` differs: {listed}. Use one value everywhere: pack with the length you train at, and leave "
            "`max_length` out of the SFTConfig and the collator (PackedSFTTrainer takes it from the packed dataset)."
        )
    max_length = next(iter(given.values()), None)
    for name, dataset in datasets_by_name.items():
        longest = _longest_row(dataset)
        if max_length is None:
            max_length = longest
        elif longest is not None and longest > max_length:
            raise PackingValueError(
                f"`{name}` has rows of {longest} tokens, longer than `max_length`={max_length}: they would be cut or "
                f"refused mid-training. Set `max_length` to at least {longest} (SFTConfig or recipe), or pack with "
                f"`pack_dataset(..., max_length={max_length})`."
            )
    return max_length


def _check_packed(name: str, dataset) -> None:
    if isinstance(dataset, Dataset):
        columns = dataset.column_names
    elif isinstance(dataset, IterableDataset):
        columns = dataset.column_names or list(next(iter(dataset), {}))
    else:
        raise PackingTypeError(
            f"`{name}` must be a datasets Dataset or IterableDataset made by pack_dataset, got "
            f"{type(dataset).__name__}."
        )
    if ("input_ids" not in columns and "messages" not in columns) or "seq_lengths" not in columns:
        raise PackingValueError(
            f"`{name}` has columns {columns}, not packed rows (`input_ids` and `seq_lengths`). Tokenize and pack it "
            "first: `pack_dataset(tokenized, max_length)`; or train it with trl.SFTTrainer, which prepares raw data."
        )


def _longest_row(dataset) -> int | None:
    """From the Arrow offsets of `input_ids` (no token is read); `None` for a stream, whose rows come later."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return None
    if "input_ids" not in dataset.column_names:  # image-text rows: their tokens are counted in `seq_lengths`
        return longest_row(dataset)
    # The table behind any `select`/`shuffle` mapping: a superset of the rows, so never less than the longest.
    lengths = pc.list_value_length(dataset.data.column("input_ids"))
    return int(pc.max(lengths).as_py() or 0)


def _several_documents_per_row(datasets_by_name: dict) -> bool:
    for dataset in datasets_by_name.values():
        if not isinstance(dataset, Dataset):
            return True  # a stream's rows are not known yet
        if len(dataset) and pc.max(pc.list_value_length(dataset.data.column("seq_lengths"))).as_py() > 1:
            return True
    return False


def _pad_token_id(tokenizer) -> int:
    # Padding is never attended to nor trained on, so any id the embedding has will do.
    candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    return next(int(token_id) for token_id in candidates if token_id is not None)


def _check_parallelism(accelerator) -> None:
    config = accelerator.parallelism_config
    for kind, size in (("context", "cp_size"), ("sequence", "sp_size")):
        if config is not None and getattr(config, size.replace("size", "enabled")):
            raise UnsupportedSetupError(
                f"{kind.capitalize()} parallelism (`{size}`={getattr(config, size)}) shards rows along the sequence "
                f"and drops the per-document mask, so packed documents would attend to each other. Set `{size}` to 1."
            )
