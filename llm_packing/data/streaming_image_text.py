"""`pack_dataset` for a stream of image-text conversations (an `IterableDataset` in TRL's vision format).

Each conversation is planned as it arrives (see `image_text.py`: from its text and its images' file headers, no pixel
decoded), cut per `overflow` as `pack_image_text.py` cuts it (never inside an image), and packed over a bounded buffer
by the rounds that pack a text stream (see `core/buffered.py`). Memory holds the buffer's documents and their image
references, never the stream. Images are read with the stream's decoding off and carried as the stream holds them.

The rows have the map-style path's columns and features, built the same way, and its rows where the packing is the
same: a stream of fewer than `buffer_size` documents (conversations, or their pieces with `overflow="split"`) is
packed in one round, one `pack_sequences` call over all of them as the map-style path makes it, and gives the
map-style rows, in the same order (with `seed=None`: each round of a stream draws `seed_from_components(seed, round)`).
A longer stream packs each buffer as a text stream of the same token counts would.
"""

import dataclasses
import logging
from collections.abc import Iterator
from typing import NamedTuple

import datasets
import numpy as np

from ..core.binpack import pack_sequences
from ..core.buffered import buffered_bins
from ..core.checks import check_integer, check_processor
from ..core.overflow import OverflowPolicy, check_max_length, check_overflow_policy
from ..core.stats import PackingStats
from ..errors import PackingValueError
from .image_text import ConversationPlanner
from .pack_image_text import (
    IMAGE_COLUMNS,
    VIDEO_COLUMN,
    check_format,
    conversation_pieces,
    image_column,
    packed_features,
    require_processor,
)
from .stream_epochs import epoch_following_stream


__all__ = ["is_image_text_stream", "pack_image_text_stream"]

logger = logging.getLogger(__name__)


class _Document(NamedTuple):
    """A packed document but its length: its conversation, that conversation's images as stored, where in the
    conversation it starts, and the conversation's planned tokens."""

    messages: list[dict]
    images: list | None
    start: int
    conversation_length: int


def is_image_text_stream(dataset: datasets.IterableDataset, processor) -> bool:
    """
    Whether the stream `dataset` is in TRL's vision format (an `images`, `image` or `videos` column), as
    `is_image_text` tells a map-style dataset. A stream whose features are unknown is told by its first example, read
    only when a `processor` is given (a text stream needs none).
    """
    if dataset.features is not None:
        return any(name in dataset.features for name in (*IMAGE_COLUMNS, VIDEO_COLUMN))
    if processor is None:
        return False
    first = next(iter(_as_stored(dataset).take(1)), {})
    return any(name in first for name in (*IMAGE_COLUMNS, VIDEO_COLUMN))


def pack_image_text_stream(
    dataset: datasets.IterableDataset,
    max_length: int,
    *,
    processor,
    chat_template: str | None = None,
    buffer_size: int = 10_000,
    strategy: str = "bfd",
    seed: int | None = None,
    overflow: OverflowPolicy = "error",
    max_docs_per_bin: int | None = None,
) -> datasets.IterableDataset:
    """
    Pack a stream of image-text conversations lazily, from a buffer of `buffer_size` documents: rows of `messages`,
    `images` (as the stream holds them, never decoded), `seq_lengths`, `seq_starts` and `conversation_lengths`, as
    [`~llm_packing.data.pack.pack_dataset`] writes for a map-style dataset.

    Args:
        dataset ([`~datasets.IterableDataset`]):
            Conversations in TRL's vision format: `messages` with `images` (a list per conversation) or `image`.
        max_length (`int`):
            Tokens per packed row, image placeholders expanded.
        processor (`ProcessorMixin`):
            The processor training will use: it gives each conversation's token count.
        chat_template (`str`, *optional*):
            A chat template other than the processor's.
        buffer_size (`int`, *optional*, defaults to `10000`):
            Documents packed together. Larger buffers pack tighter and hold more conversations (with their image
            references) in memory.
        strategy, seed, overflow, max_docs_per_bin:
            As for [`~llm_packing.data.pack.pack_dataset`]; errors about a conversation (too long, a missing image)
            are raised when the stream reaches it, naming its row.

    Returns:
        [`~datasets.IterableDataset`]: packed rows; the stats are logged on the `llm_packing` logger once the stream
        has been consumed.

    Example:
    ```python
    >>> from llm_packing.demo.photos import load_demo_processor, load_photo_conversations
    >>> stream = load_photo_conversations(6).to_iterable_dataset()
    >>> rows = list(pack_image_text_stream(stream, 512, processor=load_demo_processor(), buffer_size=64))
    >>> [row["seq_lengths"] for row in rows]
    [[187, 115, 101, 97], [71, 45]]
    >>> sorted(rows[0]["images"][0][0])  # the first image of the first conversation, as stored
    ['bytes', 'path']

    ```
    """
    check_max_length(max_length)
    check_overflow_policy(overflow)
    check_integer("buffer_size", buffer_size, minimum=2, meaning="documents per buffer",
                  fix="Pass `buffer_size=10_000` (the default), or as many conversations as fit in memory.")
    # Packing nothing checks `strategy` and `max_docs_per_bin` now rather than once the stream is iterated.
    pack_sequences(np.zeros(0, np.int64), max_length, strategy=strategy, seed=seed, max_docs_per_bin=max_docs_per_bin)
    features = None
    if dataset.features is not None:
        require_processor(dataset, processor)
        check_format(dataset)
        features = packed_features(dataset, image_column(dataset))
    elif processor is None:
        raise PackingValueError(
            "`processor` is None, but the stream holds images, so packing it needs the token count of each "
            "conversation once the processor has expanded its image placeholders. Pass the processor you train with: "
            "`pack_dataset(dataset, max_length, processor=processor)`."
        )
    else:
        check_processor("processor", processor, why="the stream holds images")
    options = {"max_length": max_length, "buffer_size": buffer_size, "strategy": strategy, "seed": seed,
               "overflow": overflow, "max_docs_per_bin": max_docs_per_bin}
    return epoch_following_stream(_packed_rows, dataset, features,
                                  planner=ConversationPlanner(processor, chat_template), options=options)


def _packed_rows(dataset, planner, options) -> Iterator[dict[str, list]]:
    max_length, buffer_size = options["max_length"], options["buffer_size"]
    counts: dict[str, int] = {}
    bin_tokens: list[int] = []
    for documents in buffered_bins(_pieces(dataset, planner, options, counts), max_length, buffer_size=buffer_size,
                                   strategy=options["strategy"], seed=options["seed"],
                                   max_docs_per_bin=options["max_docs_per_bin"]):
        bin_tokens.append(sum(length for length, _ in documents))
        yield _row(documents)
    stats = PackingStats.from_bin_token_counts(bin_tokens, num_sequences=counts.pop("pieces", 0),
                                               capacity=max_length)
    logger.info("pack_dataset (streaming image-text, buffer_size=%d):\n%s", buffer_size,
                dataclasses.replace(stats, **counts))


def _pieces(dataset, planner, options, counts: dict[str, int]):
    """Each conversation's documents as `(length, _Document)`, planned as it arrives and cut per `overflow`, counting
    what was cut."""
    for row, example in enumerate(_as_stored(dataset)):
        messages, images, stored = _conversation(example, row)
        tokens, images_end = planner.plan(messages, images, f"row {row}")
        pieces = conversation_pieces(np.array([tokens]), np.array([images_end]), options["max_length"],
                                     options["overflow"], first_row=row)
        for name, value in {**pieces.counts(), "pieces": len(pieces.length)}.items():
            counts[name] = counts.get(name, 0) + value
        yield [(int(length), _Document(messages, stored, int(start), tokens))
               for start, length in zip(pieces.start, pieces.length, strict=True)]


def _as_stored(dataset: datasets.IterableDataset) -> datasets.IterableDataset:
    """`dataset` with its images as stored (`{"bytes", "path"}`), never decoded; without features nothing is."""
    return dataset if dataset.features is None else dataset.decode(False)


def _conversation(example: dict, row: int) -> tuple[list[dict], list, list | None]:
    """`(messages, images, stored)` of one example: its images as planned, and as its packed row holds them (a single
    `image` becomes a list of one), both as in map-style packing."""
    if example.get("videos"):
        raise PackingValueError(
            f"Example {row} of the stream holds videos ({len(example['videos'])} in `videos`): streams of "
            "conversations with videos are not packed yet. Pack them as a map-style dataset (`load_dataset(..., "
            "streaming=False)` or `Dataset.from_generator`), or leave the videos out of the stream."
        )
    name = next((name for name in IMAGE_COLUMNS if name in example), None)
    if name is None or "messages" not in example:
        raise PackingValueError(
            f"Example {row} of the stream has no {'images' if name is None else 'messages'!r} (keys: "
            f"{sorted(example)}). Image-text rows are streamed in TRL's conversational format: `messages` (a list of "
            "{'role', 'content'}) beside `images` (or `image`) in every example. Fix that example, or filter the "
            "stream before packing."
        )
    value = example[name]
    if name == "image":
        return example["messages"], [] if value is None else [value], [value]
    return example["messages"], list(value or []), value


def _row(documents: list[tuple[int, _Document]]) -> dict[str, list]:
    return {"messages": [document.messages for _, document in documents],
            "images": [document.images for _, document in documents],
            "seq_lengths": [length for length, _ in documents],
            "seq_starts": [document.start for _, document in documents],
            "conversation_lengths": [document.conversation_length for _, document in documents]}
