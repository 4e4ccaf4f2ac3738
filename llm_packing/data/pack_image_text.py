"""`pack_dataset` for image-text conversations (TRL's vision format: `messages` with `images` or `image`).

Each conversation's true token count, placeholders expanded as the processor expands them, is planned from its text
and its images' file headers (see `image_text.py`: no pixel is decoded), then every split is packed at once with
`pack_sequences`, as for text. Tokenizing and pixel processing happen in the collator, one row at a time, with the
processor TRL's vision collator uses: a packed row keeps its conversations (`messages`) and their images as the
dataset holds them (paths, bytes or `datasets.Image` values, never decoded here), in packed order, and says where each
document lies (`seq_lengths`, `seq_starts`, `conversation_lengths`); the collator checks every count it gets against
the plan.

Overflow never cuts inside an image: a conversation too long once its images are expanded is refused
(`overflow="error"`), left out and counted (`"drop"`), or, with `"truncate"` / `"split"`, cut at `max_length` only
when all its images end within the first `max_length` tokens (the pieces after the first are text), and refused
otherwise.
"""

import dataclasses

import datasets
import numpy as np
import pyarrow as pa
from datasets.fingerprint import Hasher

from ..core.binpack import pack_sequences
from ..core.checks import check_processor
from ..core.overflow import OverflowPolicy, cut_pieces
from ..errors import PackingValueError, SequenceTooLongError
from ._io.packed_cache import PackedWriter, destination, load_cached
from .image_text import ConversationPlanner


__all__ = ["IMAGE_COLUMNS", "conversation_pieces", "is_image_text", "pack_image_text_split", "packed_features",
           "plan_conversations", "require_processor"]

IMAGE_COLUMNS = ("images", "image")  # TRL's: a dataset is a vision dataset if its rows have either
VIDEO_COLUMN = "videos"  # a list of videos per conversation, beside or instead of the images
_ROWS_PER_CHUNK = 1000  # packed rows gathered and written at a time: a chunk's image bytes, not the corpus's, in RAM


def is_image_text(dataset) -> bool:
    """Whether `dataset` is in TRL's vision format (an `images` or `image` column, or a `videos` column)."""
    return any(name in (dataset.column_names or ()) for name in (*IMAGE_COLUMNS, VIDEO_COLUMN))


def image_column(dataset) -> str | None:
    """The dataset's image column (`images` or `image`), or None for a dataset of videos only."""
    return next((name for name in IMAGE_COLUMNS if name in dataset.column_names), None)


def media_columns(dataset) -> str:
    """The columns that make `dataset` image-text, for messages (e.g. `'images'`, `'images' and 'videos'`)."""
    return " and ".join(repr(name) for name in (*IMAGE_COLUMNS, VIDEO_COLUMN) if name in dataset.column_names)


def plan_conversations(dataset: datasets.Dataset, processor, *, chat_template: str | None = None,
                       num_proc: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """
    `(tokens, images_end)` of every row of `dataset`: the conversation's token count with its images' and videos'
    placeholders expanded, and the tokens up to the end of its last image or video (0 without either), as int64
    arrays. Planned with `Dataset.map` over the Arrow rows (cached like any map, `num_proc` processes): images and
    videos are read as stored, never decoded (a video's frames from its container header).
    """
    check_format(dataset)
    images = image_column(dataset)
    single = images == "image"
    planner = ConversationPlanner(processor, chat_template)

    def plan(batch: pa.Table, indices):  # Arrow rows: images as stored ({"bytes", "path"}), never decoded
        none = [None] * len(indices)
        stored_images = batch[images].to_pylist() if images else none
        stored_videos = batch[VIDEO_COLUMN].to_pylist() if VIDEO_COLUMN in batch.column_names else none
        rows = [planner.plan(conversation, _as_list(value, single), f"row {index}", list(videos or []))
                for conversation, value, videos, index
                in zip(batch["messages"].to_pylist(), stored_images, stored_videos, indices, strict=True)]
        return {"tokens": [tokens for tokens, _ in rows], "images_end": [end for _, end in rows]}

    counts = dataset.with_format("arrow").map(
        plan, batched=True, with_indices=True, num_proc=num_proc, remove_columns=dataset.column_names,
        desc="Planning image-text token counts",
        features=datasets.Features({"tokens": datasets.Value("int64"), "images_end": datasets.Value("int64")}),
    )
    table = counts.with_format("numpy")
    return np.asarray(table["tokens"], dtype=np.int64), np.asarray(table["images_end"], dtype=np.int64)


def pack_image_text_split(dataset: datasets.Dataset, max_length: int, overflow: OverflowPolicy, options: dict,
                          storage: dict, *, processor, chat_template: str | None = None, num_proc: int | None = None):
    """One split of image-text conversations packed (or loaded from the cache): `(packed, stats)`."""
    require_processor(dataset, processor)
    tokens, images_end = plan_conversations(dataset, processor, chat_template=chat_template, num_proc=num_proc)
    pieces = conversation_pieces(tokens, images_end, max_length, overflow)
    plan_fingerprint = Hasher.hash((tokens.tobytes(), images_end.tobytes()))
    target = destination(dataset, dict(max_length=max_length, overflow=overflow, plan=plan_fingerprint, **options),
                         **storage)
    cached = load_cached(target, dataset.split)
    if cached is not None:
        return cached
    plan = pack_sequences(pieces.length, max_length, strategy=options["strategy"], seed=options["seed"],
                          max_docs_per_bin=options["max_docs_per_bin"])
    stats = dataclasses.replace(plan.stats, **pieces.counts())
    images = image_column(dataset)
    table = dataset.with_format("arrow")
    features = packed_features(dataset, images)
    writer = PackedWriter(target, features.arrow_schema, stats)
    try:
        for first in range(0, plan.num_bins, _ROWS_PER_CHUNK):
            offsets = plan.bin_offsets[first : first + _ROWS_PER_CHUNK + 1]
            order = plan.order[offsets[0] : offsets[-1]]
            writer.write(_packed_rows(table, images, pieces, order, offsets - offsets[0], tokens, features)).result()
    except BaseException:
        writer.abort()
        raise
    return writer.finish(dataset.split), stats


def require_processor(dataset, processor) -> None:
    """Refuse to pack image-text `dataset` without the processor that gives its token counts, or with something
    else in its place (a tokenizer would count each image as one placeholder token)."""
    if processor is None:
        raise PackingValueError(
            f"`dataset` holds images or videos (column {media_columns(dataset)}), so packing it needs the token count "
            "of each conversation once the processor has expanded its placeholders. Pass the processor you train "
            "with: `pack_dataset(dataset, max_length, processor=processor)`."
        )
    check_processor("processor", processor, why=f"`dataset` holds images or videos (column {media_columns(dataset)})")


def check_format(dataset) -> None:
    if "messages" not in dataset.column_names:
        raise PackingValueError(
            f"`dataset` holds images or videos (column {media_columns(dataset)}) but has no 'messages' column "
            f"(columns: {dataset.column_names}). Image-text rows are packed in TRL's conversational format: "
            "`messages` (a list of {'role', 'content'}) beside `images` or `videos`. Convert prompt-completion or "
            "text rows to `messages` first."
        )


def conversation_pieces(tokens: np.ndarray, images_end: np.ndarray, max_length: int, overflow: OverflowPolicy,
                        first_row: int = 0):
    """The documents packed from conversations of `tokens` (images ending at `images_end`), per `overflow`, never cut
    inside an image; rows are counted from `first_row` in errors."""
    too_long = np.flatnonzero(tokens > max_length)
    if len(too_long) and overflow == "error":
        index = int(too_long[np.argmax(tokens[too_long])])
        row, count = first_row + index, tokens[index]
        raise SequenceTooLongError(
            f"{len(too_long)} conversation(s) are longer than `max_length`={max_length} once their image placeholders "
            f"are expanded; the longest has {count} tokens (row {row}). Raise `max_length` to at least "
            f"{count}, use fewer or smaller images, or pass `overflow='drop'` (left out and counted), "
            "'truncate' or 'split' (cut at `max_length`, where that cuts no image)."
        )
    if overflow in ("truncate", "split"):
        uncuttable = too_long[images_end[too_long] > max_length]
        if len(uncuttable):
            index = int(uncuttable[0])
            row, count, end = first_row + index, tokens[index], images_end[index]
            raise SequenceTooLongError(
                f"`overflow`={overflow!r} would cut inside an image: row {row} has {count} tokens with its "
                f"image placeholders expanded, and its last image ends at token {end}, past `max_length`="
                f"{max_length} ({len(uncuttable)} such row(s)). A cut inside an image's tokens, or one that separates "
                f"the images of a conversation, is never made. Raise `max_length` to at least {end}, use "
                "fewer or smaller images in those rows, or pass `overflow='drop'`."
            )
    return cut_pieces(tokens, max_length, overflow, first_row=first_row)


def _undecoded(feature):
    """The packed rows' type of a media column: undecoded (the collator decodes as `datasets` would, once per batch),
    except images with a `mode` (`Image(mode="RGB")`), which `datasets` decodes: the mode conversion travels with the
    column type only, and an RGBA photo then fed the processor other pixels than TRL's (0.88 off in the logits)."""
    if isinstance(feature, datasets.Image):
        return datasets.Image(mode=feature.mode, decode=feature.mode is not None)
    if isinstance(feature, datasets.Video):
        return datasets.Video(decode=False)
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return type(feature)(_undecoded(feature.feature))
    if isinstance(feature, datasets.Sequence):
        return datasets.Sequence(_undecoded(feature.feature), length=feature.length)
    return feature


def packed_features(dataset, images: str | None) -> datasets.Features:
    lengths = datasets.List(datasets.Value("int32"))
    features = {"messages": datasets.List(dataset.features["messages"])}
    if images is not None:
        image = _undecoded(dataset.features[images])
        features["images"] = datasets.List(image if images == "images" else datasets.List(image))
    if VIDEO_COLUMN in dataset.column_names:
        features[VIDEO_COLUMN] = datasets.List(_undecoded(dataset.features[VIDEO_COLUMN]))
    return datasets.Features({**features, "seq_lengths": lengths, "seq_starts": lengths,
                              "conversation_lengths": lengths})


def _packed_rows(table, images: str, pieces, order, offsets, tokens, features) -> pa.Table:
    """The packed rows of the pieces `order` (grouped by `offsets`), gathered from the Arrow `table`."""
    sources = pieces.source[order]
    wrap = lambda values: pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)  # noqa: E731
    columns = {"messages": wrap(table["messages"].take(sources).combine_chunks())}
    if images is not None:
        document_images = table[images].take(sources).combine_chunks()
        if images == "image":  # one image per conversation: a list of one
            single = pa.array(np.arange(len(sources) + 1), pa.int32())
            document_images = pa.ListArray.from_arrays(single, document_images)
        columns["images"] = wrap(document_images)
    if VIDEO_COLUMN in features:
        columns[VIDEO_COLUMN] = wrap(table[VIDEO_COLUMN].take(sources).combine_chunks())
    columns = {**columns,
               "seq_lengths": wrap(pa.array(pieces.length[order], pa.int32())),
               "seq_starts": wrap(pa.array(pieces.start[order], pa.int32())),
               "conversation_lengths": wrap(pa.array(tokens[sources], pa.int32()))}
    return pa.Table.from_arrays([columns[name] for name in features], schema=features.arrow_schema)


def _as_list(value, single: bool) -> list:
    if single:
        return [] if value is None else [value]
    return list(value or [])
