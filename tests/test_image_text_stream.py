"""pack_dataset on a stream of image-text conversations: the map-style rows where the packing is the same (a stream
shorter than the buffer), each buffer packed as a text stream of the same token counts otherwise, images as stored,
memory bounded by the buffer, bad input refused naming the parameter or row, and rows the collator takes."""

import tracemalloc

import datasets
import pytest
from test_image_text_pack import FAMILY, conversation, dataset, number_of
from tiny_processors import IMAGE_SIZES, photo_bytes, tiny_processor

from llm_packing import DataCollatorWithPacking, pack_dataset
from llm_packing.errors import PackingTypeError, PackingValueError, SequenceTooLongError


def conversations(count: int) -> list[dict]:
    """0 to 2 images each, texts of 2 to 17 words, and every ninth long enough to be cut at 96 tokens."""
    return [conversation(i, words=150 if i % 9 == 4 else 2 + 5 * (i % 4), images=i % 3) for i in range(count)]


def untyped_stream(rows: list[dict]) -> datasets.IterableDataset:
    """A stream whose features are unknown until read (a generator, as web-scale loaders often give)."""
    def examples():
        yield from rows

    return datasets.IterableDataset.from_generator(examples)


@pytest.mark.parametrize("overflow", ["truncate", "split", "drop"])
@pytest.mark.parametrize("form", ["typed", "untyped", "single image"])
def test_a_stream_shorter_than_the_buffer_packs_to_the_map_style_rows(overflow, form):
    processor = tiny_processor(FAMILY)
    rows = conversations(20)
    if form == "single image":
        rows = [{"messages": row["messages"], "image": row["images"][0] if row["images"] else None} for row in rows]
        source = datasets.Dataset.from_list(rows, features=datasets.Features({
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
            "image": datasets.Image()}))
    else:
        source = dataset(rows)
    stream = untyped_stream(rows) if form == "untyped" else source.to_iterable_dataset()
    options = {"processor": processor, "overflow": overflow, "max_docs_per_bin": 3}
    mapped, stats = pack_dataset(source, 96, return_stats=True, **options)
    streamed = pack_dataset(stream, 96, buffer_size=64, **options)
    assert isinstance(streamed, datasets.IterableDataset)
    assert list(streamed) == mapped.to_list()  # rows, documents, token counts and image references, in order
    assert len(mapped) > 5 and stats.truncated_tokens + stats.split_sequences + stats.dropped_sequences > 0
    if form != "untyped":
        assert streamed.features == mapped.features  # images undecoded, as the map-style path stores them


def test_a_longer_stream_packs_each_buffer_as_a_text_stream_of_the_same_token_counts():
    # 90 conversations through a buffer of 8: many rounds, each conversation meeting only its buffer's partners.
    processor = tiny_processor(FAMILY)
    rows = conversations(90)
    options = {"overflow": "split", "buffer_size": 8, "seed": 3}
    streamed = list(pack_dataset(dataset(rows).to_iterable_dataset(), 96, processor=processor, **options))
    alone = {number_of(messages): (images, total) for row in pack_dataset(dataset(rows), 96, processor=processor,
                                                                          overflow="split")
             for messages, images, total in zip(row["messages"], row["images"], row["conversation_lengths"],
                                                strict=True)}
    # The same token counts as a text stream; each token says its conversation and its place in it.
    text = datasets.Dataset.from_dict({"input_ids": [[10_000 * n + t for t in range(alone[n][1])]
                                                     for n in range(len(rows))]})
    expected = []
    for row in pack_dataset(text.to_iterable_dataset(), 96, **options):
        starts = [sum(row["seq_lengths"][:d]) for d in range(len(row["seq_lengths"]))]
        numbers = [(row["input_ids"][s] // 10_000, row["input_ids"][s] % 10_000) for s in starts]
        expected.append({"messages": [rows[n]["messages"] for n, _ in numbers],
                         "images": [alone[n][0] for n, _ in numbers], "seq_lengths": row["seq_lengths"],
                         "seq_starts": [start for _, start in numbers],
                         "conversation_lengths": [alone[n][1] for n, _ in numbers]})
    assert streamed == expected
    assert len(streamed) > 10


def test_memory_is_bounded_by_the_buffer_not_the_stream():
    # Each conversation's image carries 64 KiB of its own (bytes after the JPEG's end, which a header read skips):
    # a packing that held the stream would grow with its length.
    processor = tiny_processor(FAMILY)
    image = photo_bytes(0, IMAGE_SIZES[0])
    read = []

    def examples(count):
        for number in range(count):
            read.append(number)
            yield {**conversation(number, images=0), "images": [{"bytes": image + bytes([number % 251]) * 65_536,
                                                                  "path": None}]}

    def peak(count, buffer_size):
        read.clear()
        features = dataset([conversation(0)]).features
        stream = datasets.IterableDataset.from_generator(examples, gen_kwargs={"count": count}, features=features)
        packed, held, emitted = pack_dataset(stream, 200, processor=processor, buffer_size=buffer_size), 0, 0
        tracemalloc.start()
        try:
            for row in packed:
                emitted += len(row["messages"])
                held = max(held, len(read) - emitted)  # read from the stream but not yet in a row
                del row
            return tracemalloc.get_traced_memory()[1], held, emitted
        finally:
            tracemalloc.stop()

    short, held_short, emitted_short = peak(64, 16)
    long, held_long, emitted_long = peak(512, 16)
    print(f"peak {short / 2**20:.2f} MiB for 64 conversations, {long / 2**20:.2f} MiB for 512 (buffer 16)")
    assert (emitted_short, emitted_long) == (64, 512)
    assert held_short <= 16 and held_long <= 16
    assert long < 1.25 * short  # 8x the stream, the same peak
    assert long < 64 * 65_536  # under a quarter of what holding 512 conversations' images would take


def test_the_collator_takes_streamed_rows_as_it_takes_map_style_ones():
    processor = tiny_processor(FAMILY)
    rows = conversations(9)
    collator = DataCollatorWithPacking(processor=processor, check_model_configured=False)
    streamed = list(pack_dataset(dataset(rows).to_iterable_dataset(), 96, processor=processor, overflow="split"))
    mapped = pack_dataset(dataset(rows), 96, processor=processor, overflow="split")
    streamed_batch, mapped_batch = collator(streamed), collator([mapped[i] for i in range(len(mapped))])
    assert streamed_batch.keys() == mapped_batch.keys() and "pixel_values" in streamed_batch
    for name, value in streamed_batch.items():
        assert value.equal(mapped_batch[name]), name
    assert streamed_batch["attention_mask"].max() > 1  # rows of several documents


def test_bad_input_names_the_parameter_or_the_row():
    processor = tiny_processor(FAMILY)
    rows = [conversation(0), conversation(1)]
    typed, untyped = dataset(rows).to_iterable_dataset(), untyped_stream(rows)
    no_processor = r"holds images.*Pass the processor you train with: `pack_dataset\(dataset, max_length, processor="
    with pytest.raises(PackingValueError, match=no_processor):
        pack_dataset(typed, 200)
    with pytest.raises(PackingValueError, match=r"Example 0 of the stream " + no_processor):  # when its first is read
        list(pack_dataset(untyped, 200))
    for stream in (typed, untyped):
        with pytest.raises(PackingTypeError, match=r"so `processor` must be the model's processor .*LlamaTokenizer"):
            pack_dataset(stream, 200, processor=processor.tokenizer)
    with pytest.raises(PackingValueError, match=r"`buffer_size` must be an integer >= 2 \(documents per buffer\), "
                                                r"got 1\. Pass `buffer_size=10_000`"):
        pack_dataset(typed, 200, processor=processor, buffer_size=1)
    with pytest.raises(PackingValueError, match=r"return_stats"):
        pack_dataset(typed, 200, processor=processor, return_stats=True)
    with pytest.raises(ValueError, match=r"nope"):
        pack_dataset(typed, 200, processor=processor, strategy="nope")
    no_messages = datasets.Dataset.from_dict({"text": ["hi"], "images": [[photo_bytes(0, (56, 56))]]})
    with pytest.raises(PackingValueError, match=r"has no 'messages' column \(columns: \['text', 'images'\]\)"):
        pack_dataset(no_messages.to_iterable_dataset(), 200, processor=processor)
    with pytest.raises(PackingValueError, match=r"Example 1 of the stream has no 'messages' \(keys: \['images', "
                                                r"'text'\]\)\. .*Fix that example, or filter the stream"):
        list(pack_dataset(untyped_stream([rows[0], {"text": "hi", "images": []}]), 200, processor=processor))
    # Errors about one conversation are raised when the stream reaches it, naming its row in the stream.
    long = [conversation(i) for i in range(5)] + [conversation(5, words=60, images=2)]
    with pytest.raises(SequenceTooLongError, match=r"longer than `max_length`=64 once their image placeholders are "
                                                   r"expanded; the longest has \d+ tokens \(row 5\)"):
        list(pack_dataset(dataset(long).to_iterable_dataset(), 64, processor=processor, buffer_size=2))
    many_images = [conversation(0), conversation(1), conversation(2, words=1, images=5)]
    with pytest.raises(SequenceTooLongError, match=r"`overflow`='split' would cut inside an image: row 2 has"):
        list(pack_dataset(dataset(many_images).to_iterable_dataset(), 40, processor=processor, overflow="split"))
    gone = untyped_stream([rows[0], {**rows[1], "images": [{"bytes": None, "path": "/nonexistent/gone.jpg"}]}])
    with pytest.raises(PackingValueError, match=r"image 0 of row 1: the file '/nonexistent/gone\.jpg' does not exist"):
        list(pack_dataset(gone, 200, processor=processor))
    with pytest.raises(PackingTypeError, match=r"image 0 of row 0 is int 7, not an image"):
        list(pack_dataset(untyped_stream([{**rows[0], "images": [7]}]), 200, processor=processor))


def test_a_stream_dict_packs_each_split():
    processor = tiny_processor(FAMILY)
    rows = conversations(6)
    splits = datasets.IterableDatasetDict({"train": dataset(rows).to_iterable_dataset(),
                                           "test": dataset(rows[:2]).to_iterable_dataset()})
    packed = pack_dataset(splits, 200, processor=processor)
    assert list(packed["train"]) == pack_dataset(dataset(rows), 200, processor=processor).to_list()
    assert sorted(number_of(m) for row in packed["test"] for m in row["messages"]) == [0, 1]
