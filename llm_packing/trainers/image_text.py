"""`PackedSFTTrainer` on TRL's vision datasets: `messages` with `images` (or `image`), a processor as
`processing_class`.

[`prepare_image_text`] runs before `SFTTrainer.__init__`: it checks that the processor matches the model, packs raw
conversations with `pack_dataset(..., processor=...)` at `SFTConfig.max_length` (their true token counts, images
expanded, planned without decoding pixels; the trainer's `overflow`, `"error"` unless given, so nothing is cut or
dropped unasked), and builds the collator, [`~llm_packing.batches.collator.DataCollatorWithPacking`] with the
processor, which processes each document as TRL's vision collator does. `assistant_only_loss` goes to that collator
(TRL's own never runs), so it is taken off the config TRL sees; with it, a processor template without
`{% generation %}` markers is replaced, for planning and collating alike, by TRL's training template for it, as
`SFTTrainer` does ([`training_chat_template`]). A stream of conversations (`IterableDataset`) is packed as it is read,
in bounded memory (`pack_dataset` on a stream); train it with `max_steps`.
"""

import contextlib
import copy
import dataclasses

from datasets import Dataset, IterableDataset
from trl.chat_template_utils import get_training_chat_template, has_generation_markers

from ..batches.collator import DataCollatorWithPacking
from ..batches.packed_conversations import media_token_ids, placeholder_ids
from ..core.checks import check_processor
from ..data.pack import pack_dataset
from ..data.pack_image_text import is_image_text
from ..data.streaming_image_text import is_image_text_stream
from ..errors import PackingTypeError, PackingValueError
from .sft_data import column_names


# The columns a packed image-text row carries, which TRL's column pruning must keep.
PACKED_COLUMNS = ["messages", "images", "videos", "seq_lengths", "seq_starts", "conversation_lengths"]


@dataclasses.dataclass
class ImageTextSetup:
    """What `PackedSFTTrainer` trains image-text rows with: the config TRL sees, the packed datasets, the collator."""

    args: object
    train_dataset: object
    eval_dataset: object
    data_collator: DataCollatorWithPacking


def prepare_image_text(args, model, processing_class, data_collator, train_dataset, eval_dataset, *,
                       overflow: str = "error"):
    """The [`ImageTextSetup`] for a vision `train_dataset` (memory-mapped or a stream), or `None` for a text one (left
    to the text path)."""
    if not _is_vision(train_dataset, processing_class):
        return None
    processor = processing_class
    check_processor("processing_class", processor, why="`train_dataset` holds images")
    check_processor_matches_model(processor, model)
    if data_collator is not None and getattr(data_collator, "processor", None) is None:
        raise PackingTypeError(
            f"`data_collator` must be a DataCollatorWithPacking with a `processor` for image-text rows, got "
            f"{type(data_collator).__name__}. Leave `data_collator` out: PackedSFTTrainer builds one."
        )
    if args.max_length is None:
        raise PackingValueError(
            "`max_length` in the SFTConfig is None, but image-text conversations are packed into rows of "
            "`max_length` tokens. Set it (e.g. `SFTConfig(max_length=2048)`)."
        )
    if args.chat_template_path is not None:
        raise PackingValueError(
            f"`chat_template_path`={args.chat_template_path!r} with image-text rows: TRL would set the template after "
            "the conversations were planned with the processor's. Set `processor.chat_template` before building the "
            "trainer, and leave `chat_template_path` out."
        )
    chat_template = training_chat_template(processor, args.assistant_only_loss)
    packed = {name: _packed(dataset, args.max_length, processor, overflow, chat_template)
              for name, dataset in (("train", train_dataset), *_evals(eval_dataset))}
    evals = {name[5:]: value for name, value in packed.items() if name.startswith("eval/")}
    eval_packed = evals if isinstance(eval_dataset, dict) else evals.get("")
    if data_collator is None:
        data_collator = DataCollatorWithPacking(
            pad_token_id=_pad_token_id(processor.tokenizer), max_length=args.max_length,
            pad_to_multiple_of=args.pad_to_multiple_of, processor=processor,
            assistant_only_loss=bool(args.assistant_only_loss), chat_template=chat_template)
    args = copy.copy(args)
    args.assistant_only_loss = False  # applied by our collator; TRL's check is for its own dataset preparation
    return ImageTextSetup(args, packed["train"], eval_packed, data_collator)


def training_chat_template(processor, assistant_only_loss: bool) -> str | None:
    """
    The chat template to plan and collate image-text conversations with: `None` (the processor's own) unless
    `assistant_only_loss` is on and the processor's template has no `{% generation %}` markers, where it is TRL's
    training template for it (`trl.chat_template_utils.get_training_chat_template`), the one `SFTTrainer` swaps in.
    Without it every assistant mask would be zeros and nothing would train.

    Args:
        processor (`ProcessorMixin`):
            The model's processor, its `chat_template` set.
        assistant_only_loss (`bool`):
            Whether labels are kept only inside the assistant turns.

    Returns:
        `str` or `None`:
            The training template, or `None` when the processor's template serves as it is.

    Example:

    ```python
    >>> from trl import chat_template_utils
    >>> from llm_packing.demo.photos import load_demo_processor
    >>> processor = load_demo_processor()  # its template marks the assistant turns
    >>> training_chat_template(processor, assistant_only_loss=True) is None
    True
    >>> processor.chat_template = chat_template_utils.qwen2_5_vl_chat_template  # Qwen2.5-VL's own: no markers
    >>> template = training_chat_template(processor, assistant_only_loss=True)
    >>> template == chat_template_utils.qwen2_5_vl_training_chat_template
    True

    ```
    """
    template = getattr(processor, "chat_template", None)
    if not assistant_only_loss or (template is not None and has_generation_markers(template)):
        return None
    if template is not None:
        with contextlib.suppress(ValueError):  # TRL's refusal of a template it has no training version of
            return get_training_chat_template(processor)
    shown = f"{template[:60]!r}..." if isinstance(template, str) else repr(template)[:60]
    raise PackingValueError(
        f"`assistant_only_loss`=True, but the chat template of {type(processor).__name__} ({shown}) has no "
        "`{% generation %}` markers, and TRL has no training template for it: every assistant mask would be zeros "
        "and nothing would train. Set `processor.chat_template` to a template with `{% generation %}...{% "
        "endgeneration %}` around the assistant turns, or set `assistant_only_loss=False`."
    )


def check_processor_matches_model(processor, model) -> None:
    """Refuse a processor whose image / video token ids are not the model's, or whose tokenizer is larger than the
    model's embedding."""
    config = getattr(model, "config", None)
    for kind in ("image", "video"):
        given = placeholder_ids(processor, kind)
        expected = _config_value(config, f"{kind}_token_id")
        if given and isinstance(expected, int) and expected not in given:
            raise PackingValueError(
                f"The processor's {kind} placeholder token id is {sorted(given)} but the model's config says "
                f"`{kind}_token_id`={expected}: the model would look for its {kind} features at other tokens than the "
                "processor expands (and refuse the batch, or train on the wrong tokens). Use the processor saved with "
                "the model (`AutoProcessor.from_pretrained` of the same checkpoint), or set the config's token id to "
                "the processor's."
            )
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    if rows is not None and len(processor.tokenizer) > rows:
        raise PackingValueError(
            f"The processor's tokenizer has {len(processor.tokenizer)} tokens but the model's embedding has {rows} "
            f"rows: token ids from {rows} on (e.g. the image token {media_token_ids(processor)}) have no embedding. "
            "Use the model's own processor, or `model.resize_token_embeddings(len(processor.tokenizer))`."
        )


def longest_row(dataset: Dataset) -> int | None:
    """The tokens of the longest packed image-text row of `dataset`, from its `seq_lengths` (no image is read)."""
    return max((sum(lengths) for lengths in dataset.with_format(None)["seq_lengths"]), default=None)


def _is_vision(dataset, processor) -> bool:
    if isinstance(dataset, IterableDataset):
        return is_image_text_stream(dataset, processor)
    return isinstance(dataset, Dataset) and is_image_text(dataset)


def _packed(dataset, max_length: int, processor, overflow: str, chat_template: str | None):
    if "seq_lengths" in column_names("dataset", dataset):  # packed already, by pack_dataset(..., processor=...)
        return dataset
    return pack_dataset(dataset, max_length, processor=processor, overflow=overflow, chat_template=chat_template)


def _evals(eval_dataset):
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [(f"eval/{name}", dataset) for name, dataset in eval_dataset.items()]
    return [("eval/", eval_dataset)]


def _config_value(config, field: str):
    for part in (config, getattr(config, "text_config", None)):
        for name in (field, field.replace("_id", "_index")):
            value = getattr(part, name, None) if part is not None else None
            if isinstance(value, int):
                return value
    return None


def _pad_token_id(tokenizer) -> int:
    candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
    return next(int(token_id) for token_id in candidates if token_id is not None)
