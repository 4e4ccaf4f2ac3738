"""What `PackedSFTTrainer`'s constructor checks before TRL sees its arguments: the SFTConfig settings that would undo
packing, the datasets and the collator it takes, the one `max_length` that packed rows, collator and config must
agree on, and the parallelism that would cut or mix documents."""

import logging

import pyarrow.compute as pc
from datasets import Dataset
from trl import SFTConfig

from ..batches.collator import DataCollatorWithPacking
from ..data.metadata import packed_max_length
from ..errors import PackingTypeError, PackingValueError, UnsupportedSetupError
from .image_text import longest_row as longest_image_text_row
from .sft_data import check_format, column_names, is_packed


logger = logging.getLogger(__name__)

# `SFTConfig()`'s own max_length: for rows packed already, a value the user most likely never chose, so the packed
# rows' length replaces it. For datasets the trainer packs, it is the row length, as it is TRL's truncation length.
DEFAULT_MAX_LENGTH = SFTConfig.__dataclass_fields__["max_length"].default


def sft_config(args, model) -> SFTConfig:
    if isinstance(args, SFTConfig):
        return args
    if args is None:  # as SFTTrainer names it
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return SFTConfig(f"{name.split('/')[-1]}-SFT")
    raise PackingTypeError(
        f"`args` must be a trl.SFTConfig, got {type(args).__name__}. Build one with the same fields: "
        "`SFTConfig(output_dir=..., ...)`."
    )


def eval_datasets(eval_dataset) -> dict:
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {f"eval_dataset[{name!r}]": dataset for name, dataset in eval_dataset.items()}
    return {"eval_dataset": eval_dataset}


def warn_if_rows_are_dropped(args, train_dataset, sequence_parallel_size: int) -> None:
    """`dataloader_drop_last=True` drops each epoch's last incomplete batch. Unpacked, that is a few documents; packed,
    it is whole rows of them, which the user should hear of."""
    if not args.dataloader_drop_last or not isinstance(train_dataset, Dataset) or "seq_lengths" not in \
            train_dataset.column_names:
        return
    rows_a_batch = args.per_device_train_batch_size * max(1, args.world_size // sequence_parallel_size)
    dropped = len(train_dataset) % rows_a_batch
    if dropped:
        lengths = train_dataset.data.column("seq_lengths")  # the whole table: a view's rows are a sample of it
        per_row = pc.list_value_length(lengths).to_numpy().sum() / max(1, len(lengths))
        logger.warning(
            "`dataloader_drop_last=True` drops %d of the %d packed rows each epoch (batches of %d rows): about %d "
            "documents (%.1f a row). Set `dataloader_drop_last=False` to train every document.", dropped,
            len(train_dataset), rows_a_batch, round(per_row * dropped), per_row)


def check_config(args: SFTConfig) -> None:
    """The SFTConfig settings that would undo or skew packing."""
    if args.packing:
        raise PackingValueError(
            "`packing=True` in the SFTConfig makes TRL pack the rows again, on top of pack_dataset's, and flatten "
            "them with its own collator. Set `packing=False` (recipe: `packing: false`): PackedSFTTrainer packs."
        )
    if args.padding_free:
        raise PackingValueError(
            "`padding_free=True` in the SFTConfig makes TRL flatten the batches with its own collator. Set "
            "`padding_free=False`; for one flattened row per batch, pass "
            "`data_collator=DataCollatorWithPacking(padding_free=True)` (recipe: `padding_free: true`, a packing key)."
        )


def check_datasets(args: SFTConfig, data_collator, datasets_by_name: dict, formatting_func) -> None:
    if datasets_by_name["train_dataset"] is None:
        raise PackingValueError(
            "`train_dataset` is required: a dataset trl.SFTTrainer takes (text, messages, prompt-completion, "
            "tokenized) or rows made by `pack_dataset`."
        )
    train_dataset = datasets_by_name["train_dataset"]
    if isinstance(train_dataset, Dataset) and not len(train_dataset):  # TRL would stop on a bare StopIteration
        packed = is_packed("train_dataset", train_dataset)
        raise PackingValueError(
            "`train_dataset` has no rows, so there is nothing to train on"
            f"{': pack_dataset left out every document (all empty, or over-long and dropped)' if packed else ''}. "
            f"Pass a dataset with examples{' that have tokens' if packed else ''}."
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
    skip_prepare = (args.dataset_kwargs or {}).get("skip_prepare_dataset", False)
    for name, dataset in datasets_by_name.items():
        if is_packed(name, dataset):
            if args.assistant_only_loss:
                raise PackingValueError(
                    f"`assistant_only_loss=True` in the SFTConfig needs the conversations, but `{name}` holds rows "
                    "packed already. Pass the `messages` dataset itself (PackedSFTTrainer tokenizes and packs it), or "
                    "mask the labels when tokenizing (-100 outside assistant turns) and set "
                    "`assistant_only_loss=False`."
                )
        elif skip_prepare:
            raise PackingValueError(
                f"`dataset_kwargs={{'skip_prepare_dataset': True}}` skips the preparation that tokenizes and packs "
                f"`{name}`, whose columns {column_names(name, dataset)} are not packed rows (`input_ids` and "
                "`seq_lengths`). Drop `skip_prepare_dataset`, or pack it first: `pack_dataset(tokenized, max_length)`."
            )
        else:
            check_format(name, dataset, text_field=args.dataset_text_field, formatting_func=formatting_func)


def agreed_max_length(args: SFTConfig, data_collator, datasets_by_name: dict) -> int | None:
    """The one `max_length` of the packed datasets, the collator and the SFTConfig; refuses rows longer than it."""
    packed = {name: dataset for name, dataset in datasets_by_name.items() if is_packed(name, dataset)}
    to_pack = [name for name in datasets_by_name if name not in packed]
    if to_pack and args.max_length is None:
        raise PackingValueError(
            f"`max_length` is None in the SFTConfig, but PackedSFTTrainer packs `{to_pack[0]}` into rows of "
            "`max_length` tokens. Set `max_length` (TRL's default is 1024): documents longer than it follow the "
            "trainer's `overflow` (default 'truncate', as trl.SFTTrainer truncates them; 'split' keeps every token)."
        )
    sources = {f"pack_dataset ({name})": packed_max_length(dataset) for name, dataset in packed.items()}
    if to_pack or args.max_length != DEFAULT_MAX_LENGTH:
        sources["SFTConfig"] = args.max_length
    if data_collator is not None:
        sources["DataCollatorWithPacking"] = data_collator.max_length
    given = {source: value for source, value in sources.items() if value is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{source} {value}" for source, value in given.items())
        packs = ", ".join(f"`{name}`" for name in to_pack)
        packs = f" (PackedSFTTrainer packs {packs} at SFTConfig's)" if to_pack else ""
        raise PackingValueError(
            f"`max_length` differs: {listed}{packs}. Use one value everywhere: pack with the length you train at, "
            "and leave `max_length` out of the collator (PackedSFTTrainer takes it from the packed dataset)."
        )
    max_length = next(iter(given.values()), None)
    for name, dataset in packed.items():
        longest = longest_row(dataset)
        if max_length is None:
            max_length = longest
        elif longest is not None and longest > max_length:
            raise PackingValueError(
                f"`{name}` has rows of {longest} tokens, longer than `max_length`={max_length}: they would be cut or "
                f"refused mid-training. Set `max_length` to at least {longest} (SFTConfig or recipe), or pack with "
                f"`pack_dataset(..., max_length={max_length})`."
            )
    if not to_pack and args.max_length == DEFAULT_MAX_LENGTH and (max_length or 0) > DEFAULT_MAX_LENGTH:
        # An explicit 1024 looks like the default: the rows, longer than it asked, may not fit the memory it meant.
        logger.warning(
            "SFTConfig's max_length is %d, TRL's default, so it was taken as unset: the packed rows' max_length %d is "
            "used. If you set %d yourself, pack with `pack_dataset(..., max_length=%d)`; otherwise pass "
            "`SFTConfig(max_length=%d)` to silence this.", DEFAULT_MAX_LENGTH, max_length, DEFAULT_MAX_LENGTH,
            DEFAULT_MAX_LENGTH, max_length,
        )
    return max_length


def longest_row(dataset) -> int | None:
    """From the Arrow offsets of `input_ids` (no token is read); `None` for a stream, whose rows come later."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return None
    if "input_ids" not in dataset.column_names:  # image-text rows: their tokens are counted in `seq_lengths`
        return longest_image_text_row(dataset)
    # The table behind any `select`/`shuffle` mapping: a superset of the rows, so never less than the longest.
    lengths = pc.list_value_length(dataset.data.column("input_ids"))
    return int(pc.max(lengths).as_py() or 0)


def several_documents_per_row(datasets: list) -> bool:
    for dataset in datasets:
        if not isinstance(dataset, Dataset):
            return True  # a stream's rows are not known yet
        if len(dataset) and pc.max(pc.list_value_length(dataset.data.column("seq_lengths"))).as_py() > 1:
            return True
    return False


def pad_token_id(tokenizer) -> int:
    # Padding is never attended to nor trained on, so any id the embedding has will do.
    candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    return next(int(token_id) for token_id in candidates if token_id is not None)


def check_parallelism(accelerator) -> None:
    config = accelerator.parallelism_config
    for kind, size in (("context", "cp_size"), ("sequence", "sp_size")):
        if config is not None and getattr(config, size.replace("size", "enabled")):
            raise UnsupportedSetupError(
                f"{kind.capitalize()} parallelism (`{size}`={getattr(config, size)}) shards rows along the sequence "
                f"and drops the per-document mask, so packed documents would attend to each other. Set `{size}` to 1."
            )
