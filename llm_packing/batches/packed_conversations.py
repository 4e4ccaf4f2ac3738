"""Image-text rows (`pack_dataset(..., processor=...)`) to the batch the model hook expects.

Each document is processed alone, by the call TRL's vision collator makes (`processor.apply_chat_template(...,
tokenize=True, return_dict=True)` on the messages with the images put in them, no special tokens added, here neither
padded nor truncated), its images decoded from the row as `datasets` decodes them (only that row's). Its token count
is checked against the plan `pack_dataset` packed it by, then the documents are laid out with
[`~llm_packing.batches.image_text.pack_image_text_documents`]: token columns end to end, the indexed `attention_mask`,
`position_ids` restarting per document (2-D: the hook computes the 3-D positions of mRoPE models per document), the
pixel tensors and grids of the images in packed order.

Labels are the `input_ids` with -100 on each document's first token (no document learns to predict the next one's
start), on padding, on the image placeholder tokens (`placeholder_ids`: a prediction of them trains nothing), and,
with `assistant_only_loss`, outside the assistant turns (the chat template's `{% generation %}` blocks). TRL's
vision collator trains on the placeholders too; that and the first tokens, which no loss reads, are the only
differences from its labels.
"""

from collections.abc import Mapping

import torch

from ..core.image_text import open_image, structured_messages
from ..core.rows import IGNORE_INDEX
from ..errors import PackingTypeError, PackingValueError


# Columns of a processor's output laid out along the tokens of a document (the rest are media: pixels, grids).
# Mllama's `cross_attention_mask` is `(batch, tokens, images, tiles)`.
TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids",
                 "cross_attention_mask")
_PLAN_COLUMNS = ("seq_lengths", "seq_starts", "conversation_lengths")
_MEDIA = ("image", "video", "audio")


def placeholder_ids(processor, kind: str = "image") -> set[int]:
    """
    The ids of the placeholder tokens of `kind` (`"image"`, `"video"`, `"audio"`): the processor's `{kind}_token_id`
    (the token its text path expands) and its tokenizer's (the token an expansion repeats, where they differ: Gemma 3's
    processor names `<start_of_image>`, its tokenizer `<image_soft_token>`, the token the model fills).
    """
    sources = (processor, getattr(processor, "tokenizer", None))
    ids = {getattr(source, f"{kind}_token_id", None) for source in sources if source is not None}
    return {int(token) for token in ids if isinstance(token, int)}


def media_token_ids(processor) -> list[int]:
    """The ids of every image, video and audio placeholder token of the processor (see [`placeholder_ids`])."""
    return sorted(set().union(*(placeholder_ids(processor, kind) for kind in _MEDIA)))


def collate_conversations(features: list[dict], processor, *, chat_template=None, assistant_only_loss=False,
                          pad_to_multiple_of=None, max_length=None, pad_token_id=0) -> tuple[dict, int]:
    """The batch of the image-text rows `features`, and the most documents a row holds."""
    from .image_text import pack_image_text_documents

    documents, rows = [], []
    for index, feature in enumerate(_checked(features)):
        row = []
        for number, plan in enumerate(_plans(feature, index)):
            where = f"document {number} of feature {index}"
            document = _processed(processor, feature, number, where, chat_template, assistant_only_loss)
            row.append(len(documents))
            documents.append(_piece(document, plan, where, processor))
        rows.append(row)
    row_lengths = [sum(documents[d]["input_ids"].shape[1] for d in row) for row in rows]
    if max_length is not None and max(row_lengths) > max_length:
        feature = row_lengths.index(max(row_lengths))
        raise PackingValueError(
            f"Feature {feature} has a row of {row_lengths[feature]} tokens, longer than the collator's `max_length`="
            f"{max_length}. Pack with `pack_dataset(..., max_length={max_length}, processor=...)`."
        )
    width = max(row_lengths)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    batch = pack_image_text_documents(documents, rows, width, model_type=model_type_of(processor))
    batch["input_ids"][batch["attention_mask"] == 0] = pad_token_id
    return batch, max(len(row) for row in rows)


def model_type_of(processor) -> str:
    """The model type whose processor `processor` is (the first in transformers' processor mapping): it names the
    layout of its media tensors."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    names = {cls.__name__ for cls in type(processor).__mro__}
    return next((model_type for model_type, name in PROCESSOR_MAPPING_NAMES.items() if name in names), "")


def _checked(features) -> list[Mapping]:
    if isinstance(features, Mapping) or not all(isinstance(feature, Mapping) for feature in features):
        raise PackingTypeError(
            "`features` must be a list of dicts (one per row), as the Trainer's dataloader gives them, got "
            f"{type(features).__name__}."
        )
    if not features:
        raise PackingValueError("`features` is empty: a batch needs at least one row.")
    for index, feature in enumerate(features):
        if "messages" not in feature:
            raise PackingValueError(
                f"Feature {index} has no 'messages' (keys: {sorted(feature)}): a collator with a `processor` takes "
                "image-text rows, packed by `pack_dataset(..., processor=processor)` or one conversation each "
                "(`messages` and `images`). A `transformers.Trainer` with its default `remove_unused_columns=True` "
                "drops these columns before the collator sees them (the model's forward takes no `messages`): pass "
                "`TrainingArguments(remove_unused_columns=False)`, or train with `PackedSFTTrainer`, which keeps them."
            )
    return features


def _plans(feature, index: int) -> list[tuple[int, int, int] | None]:
    """`(seq_start, seq_length, conversation_length)` per document of a packed row; `[None]` for a conversation."""
    if "seq_lengths" not in feature:
        return [None]
    columns = [list(feature.get(name) or []) for name in _PLAN_COLUMNS]
    counts = {len(column) for column in columns} | {len(feature["messages"])}
    counts |= {len(feature[name] or []) for name in ("images", "videos") if name in feature}
    if len(counts) != 1:
        raise PackingValueError(
            f"Feature {index} has {len(feature['messages'])} conversations but per-document columns of other lengths "
            f"({', '.join(f'{name}: {len(column)}' for name, column in zip(_PLAN_COLUMNS, columns, strict=True))}): "
            "it was not made by `pack_dataset(..., processor=...)`, or was cut afterwards. Pack it with pack_dataset."
        )
    lengths, starts, totals = columns
    return [(int(start), int(length), int(total))
            for start, length, total in zip(starts, lengths, totals, strict=True)]


def _processed(processor, feature, number: int, where: str, chat_template, assistant_only_loss) -> dict:
    """Document `number` of `feature` through the processor, as TRL's vision collator processes a row (its videos
    decoded first: see [`_decoded_videos`])."""
    packed = "seq_lengths" in feature
    messages = feature["messages"][number] if packed else feature["messages"]
    if packed:
        images, videos = [(feature.get(name) or [None] * (number + 1))[number] for name in ("images", "videos")]
    else:
        images, videos = feature.get("images", [feature.get("image")]), feature.get("videos")
    images = [open_image(image, f"image {i} of {where}") for i, image in enumerate(images or []) if image is not None]
    frames, metadata = _decoded_videos(processor, list(videos or []), where)
    videos_kwargs = {"video_metadata": metadata, "do_sample_frames": False} if frames else {}
    output = processor.apply_chat_template(
        structured_messages(messages, images, where, frames), chat_template=chat_template, tokenize=True,
        return_dict=True, return_tensors="pt", return_assistant_tokens_mask=assistant_only_loss,
        processor_kwargs={"padding": False, "truncation": False, "add_special_tokens": False, **videos_kwargs},
    )
    masks = output.get("assistant_masks")
    if assistant_only_loss and (masks is None or not torch.as_tensor(masks).any()):
        raise PackingValueError(
            f"{where}: `assistant_only_loss`=True, but its assistant mask is all zeros (0 of "
            f"{output['input_ids'].shape[1]} tokens in a `{{% generation %}}` block), so none of its labels would "
            "train: the chat template has no `{% generation %}` markers, or the conversation has no assistant turn. "
            "Pass `chat_template=` a template that marks the assistant turns (TRL's "
            "`trl.chat_template_utils.get_training_chat_template(processor)` gives one for the templates it knows; "
            "PackedSFTTrainer uses it), or set `assistant_only_loss=False`."
        )
    if "second_per_grid_ts" in output:  # Qwen2.5-VL returns a list: the model takes it as a tensor
        output["second_per_grid_ts"] = torch.as_tensor(output["second_per_grid_ts"], dtype=torch.float32)
    return {name: value for name, value in output.items() if isinstance(value, torch.Tensor)}


def _decoded_videos(processor, videos: list, where: str) -> tuple[list, list]:
    """
    `(frames, metadata)` of `videos` (paths, bytes or `{"bytes", "path"}` values): the frames the video processor
    samples (its own `sample_frames`, as `pack_dataset` planned them from the header), decoded with PyAV, and their
    `VideoMetadata` (frames, fps, size, the sampled indices). The processor then takes them as decoded
    (`do_sample_frames=False`): what it does with a path when it decodes it itself, without torchcodec.
    """
    if not videos:
        return [], []
    from transformers.video_utils import VideoMetadata

    from ..data.video import read_frames, sampled_frames, video_header

    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        raise PackingValueError(
            f"{where} holds {len(videos)} video(s), but `processor` ({type(processor).__name__}) has no video "
            "processor. Pass the model's processor with its video processor (e.g. `AutoProcessor.from_pretrained`)."
        )
    frames, metadata = [], []
    for i, video in enumerate(videos):
        name = f"video {i} of {where}"
        header = video_header(video, name)
        indices = sampled_frames(video_processor, header, name)
        frames.append(read_frames(video, indices, name))
        metadata.append(VideoMetadata(total_num_frames=header.frames, fps=header.fps, width=header.width,
                                      height=header.height, duration=header.frames / header.fps,
                                      video_backend="pyav", frames_indices=indices))
    return frames, metadata


def _piece(document: dict, plan, where: str, processor) -> dict:
    """The planned piece of a processed document (checked against the plan), with its labels."""
    tokens = document["input_ids"].shape[1]
    start, length = 0, tokens
    if plan is not None:
        start, length, planned = plan
        if tokens != planned:
            raise PackingValueError(
                f"{where}: the processor gave {tokens} tokens, but the conversation was packed as {planned}: its "
                "image placeholders expand to another count than planned from the images' sizes (images changed since "
                "packing, or a processor other than the one given to pack_dataset, or set up differently). Pack again "
                "with the processor you train with: `pack_dataset(..., processor=processor)`."
            )
    media = torch.tensor(media_token_ids(processor), dtype=torch.long)
    is_media = torch.isin(document["input_ids"][0], media)
    kept = is_media[start : start + length].sum()
    if kept not in (0, is_media.sum()) or (kept == 0 and start == 0 and is_media.any()):
        raise PackingValueError(
            f"{where}: its piece [{start}, {start + length}) of {tokens} tokens holds {int(kept)} of its "
            f"{int(is_media.sum())} image tokens; a piece must hold all of a conversation's images or none. Pack it "
            "again with pack_dataset, which never cuts an image."
        )
    labels = document["input_ids"].clone()
    labels[0, is_media] = IGNORE_INDEX
    masks = document.pop("assistant_masks", None)
    if masks is not None:
        labels[masks == 0] = IGNORE_INDEX
    document["labels"] = labels
    if (start, length) == (0, tokens):
        return document
    piece = {name: value[:, start : start + length] for name, value in document.items() if name in TOKEN_COLUMNS}
    if kept:  # the head of a truncated or split conversation: it holds every image
        piece.update({name: value for name, value in document.items() if name not in TOKEN_COLUMNS})
    return piece
