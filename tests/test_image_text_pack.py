"""pack_dataset on image-text conversations: every conversation and image kept (or dropped and counted), rows within
max_length by the processor's real counts, overflow never cutting an image, bad input refused before packing."""

import datasets
import numpy as np
import pytest
from tiny_processors import IMAGE_SIZES, photo_bytes, tiny_processor
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from llm_packing import PackedDatasetEpochs, pack_dataset
from llm_packing.errors import PackingTypeError, PackingValueError, SequenceTooLongError


FAMILY = "qwen2_5_vl"


def conversation(number: int, words: int = 3, images: int = 1) -> dict:
    """Conversation `number` (its number in the user's text, so that it can be found in a packed row)."""
    sizes = [IMAGE_SIZES[(number + k) % len(IMAGE_SIZES)] for k in range(images)]
    return {
        "messages": [{"role": "user", "content": f"conversation {number}: " + "look " * words},
                     {"role": "assistant", "content": "It shows a photo."}],
        "images": [{"bytes": photo_bytes(number + k, size), "path": f"photo-{number}-{k}.jpg"}
                   for k, size in enumerate(sizes)],
    }


def dataset(rows: list[dict]) -> datasets.Dataset:
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
    })
    return datasets.Dataset.from_list(rows, features=features)


def real_lengths(rows: list[dict], processor) -> list[int]:
    """Each conversation's token count as TRL's vision collator tokenizes it alone."""
    collator = DataCollatorForVisionLanguageModeling(processor)
    decoded = dataset(rows)
    return [int(collator([decoded[i]])["input_ids"].shape[1]) for i in range(len(rows))]


def number_of(messages: list[dict]) -> int:
    return int(messages[0]["content"].split(":")[0].split()[1])


def test_every_conversation_and_image_is_kept_in_rows_within_max_length():
    processor = tiny_processor(FAMILY)
    rows = [conversation(i, words=2 + 5 * (i % 4), images=i % 3) for i in range(14)]
    packed, stats = pack_dataset(dataset(rows), 96, processor=processor, return_stats=True)
    lengths = real_lengths(rows, processor)
    seen = {}
    for row in packed:
        assert sum(row["seq_lengths"]) <= 96
        for messages, images, length, start, total in zip(row["messages"], row["images"], row["seq_lengths"],
                                                          row["seq_starts"], row["conversation_lengths"], strict=True):
            number = number_of(messages)
            assert number not in seen
            seen[number] = images
            assert (start, length, total) == (0, lengths[number], lengths[number])
            assert messages == rows[number]["messages"]
    assert sorted(seen) == list(range(14))  # nothing dropped, nothing twice
    for number, images in seen.items():  # the images as stored (bytes and paths), in order, undecoded
        assert images == rows[number]["images"]
    assert stats.num_sequences == 14 and stats.num_tokens == sum(lengths)
    assert packed.features["images"].feature.feature.decode is False


def test_a_single_image_column_becomes_a_list_per_conversation(tmp_path):
    processor = tiny_processor(FAMILY)
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"{i}.jpg"))
        with open(paths[-1], "wb") as file:
            file.write(photo_bytes(i, IMAGE_SIZES[i]))
    rows = [{"messages": conversation(i)["messages"], "image": paths[i]} for i in range(3)]
    packed = pack_dataset(datasets.Dataset.from_list(rows), 200, processor=processor)
    kept = {number_of(messages): images for row in packed for messages, images in zip(row["messages"], row["images"],
                                                                                       strict=True)}
    assert kept == {i: [paths[i]] for i in range(3)}


def test_overflow_error_names_the_row_and_its_tokens_with_images_expanded():
    processor = tiny_processor(FAMILY)
    rows = [conversation(0), conversation(1, words=60, images=2), conversation(2)]
    tokens = real_lengths(rows, processor)[1]
    expected = (rf"1 conversation\(s\) are longer than `max_length`=64 once their image placeholders are expanded; "
                rf"the longest has {tokens} tokens \(row 1\)")
    with pytest.raises(SequenceTooLongError, match=expected):
        pack_dataset(dataset(rows), 64, processor=processor)


def test_overflow_drop_leaves_out_and_counts_what_is_too_long():
    processor = tiny_processor(FAMILY)
    rows = [conversation(0), conversation(1, words=60, images=2), conversation(2)]
    lengths = real_lengths(rows, processor)
    packed, stats = pack_dataset(dataset(rows), 64, processor=processor, overflow="drop", return_stats=True)
    kept = sorted(number_of(messages) for row in packed for messages in row["messages"])
    assert kept == [0, 2]
    assert (stats.dropped_sequences, stats.dropped_tokens) == (1, lengths[1])


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_truncate_and_split_cut_after_the_last_image(overflow):
    processor = tiny_processor(FAMILY)
    rows = [conversation(0), conversation(1, words=70, images=2)]  # images first, then a long text
    lengths = real_lengths(rows, processor)
    packed, stats = pack_dataset(dataset(rows), 64, processor=processor, overflow=overflow, return_stats=True)
    pieces = sorted((start, length, total, len(images)) for row in packed
                    for messages, images, start, length, total in zip(
                        row["messages"], row["images"], row["seq_starts"], row["seq_lengths"],
                        row["conversation_lengths"], strict=True) if number_of(messages) == 1)
    starts = list(range(0, lengths[1], 64)) if overflow == "split" else [0]
    assert pieces == [(start, min(64, lengths[1] - start), lengths[1], 2) for start in starts]
    assert (stats.truncated_tokens if overflow == "truncate" else stats.split_sequences) == (
        lengths[1] - 64 if overflow == "truncate" else 1)


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_a_cut_inside_the_images_is_refused(overflow):
    processor = tiny_processor(FAMILY)
    rows = [conversation(0), conversation(1, words=1, images=5)]  # the images alone pass max_length
    with pytest.raises(SequenceTooLongError, match=rf"`overflow`='{overflow}' would cut inside an image: row 1 has "
                                                   r"\d+ tokens .* its last image ends at token \d+, past `max_length`"
                                                   r"=40"):
        pack_dataset(dataset(rows), 40, processor=processor, overflow=overflow)


def test_bad_input_is_refused_before_packing(tmp_path):
    processor = tiny_processor(FAMILY)
    rows = [conversation(0), {**conversation(1), "images": [{"bytes": None, "path": str(tmp_path / "gone.jpg")}]}]
    with pytest.raises(PackingValueError, match=r"image 0 of row 1: the file '.*gone\.jpg' does not exist"):
        pack_dataset(dataset(rows), 200, processor=processor)
    with pytest.raises(PackingValueError, match=r"Pass the processor you train with"):
        pack_dataset(dataset([conversation(0)]), 200)
    not_a_processor = r"holds images or videos \(column 'images'\), so `processor` must be the model's processor.*got "
    with pytest.raises(PackingTypeError, match=not_a_processor + r"LlamaTokenizer\. Pass `AutoProcessor"):
        pack_dataset(dataset([conversation(0)]), 200, processor=processor.tokenizer)  # counts an image as 1 token
    with pytest.raises(PackingTypeError, match=not_a_processor + r"the str 'Qwen/x'\. Pass "
                                               r"`AutoProcessor\.from_pretrained\('Qwen/x'\)`"):
        pack_dataset(dataset([conversation(0)]), 200, processor="Qwen/x")
    text_and_images = datasets.Dataset.from_dict({"text": ["hi"], "images": [[photo_bytes(0, (56, 56))]]})
    with pytest.raises(PackingValueError, match=r"has no 'messages' column"):
        pack_dataset(text_and_images, 200, processor=processor)
    with pytest.raises(PackingValueError, match=r"image-text conversations are not repacked per epoch yet"):
        PackedDatasetEpochs(dataset([conversation(0)]), 200)
    # Conversations without an image column, with a processor: it said "no 'input_ids' column, tokenize it first"
    messages_only = dataset([conversation(0)]).remove_columns("images")
    with pytest.raises(PackingValueError, match=r"`processor` was given, but `dataset` has no image or video column "
                                                r"\(columns: \['messages'\]\).*Add an `images` column"):
        pack_dataset(messages_only, 200, processor=processor)
    # A stream of conversations with videos and no image column: it said "no 'input_ids'" too
    videos_only = messages_only.add_column("videos", [[{"bytes": b"\x00", "path": None}]]).to_iterable_dataset()
    with pytest.raises(PackingValueError, match=r"holds videos \(1 in `videos`\): streams of conversations with "
                                                r"videos are not packed yet"):
        list(pack_dataset(videos_only, 200, processor=processor))


def test_packing_again_loads_the_cached_rows(tmp_path):
    processor = tiny_processor(FAMILY)
    source = dataset([conversation(i, images=i % 3) for i in range(5)])
    source.save_to_disk(str(tmp_path / "source"))
    on_disk = datasets.load_from_disk(str(tmp_path / "source"))
    first = pack_dataset(on_disk, 100, processor=processor)
    second = pack_dataset(on_disk, 100, processor=processor)
    assert first.cache_files and first.cache_files == second.cache_files
    assert first[:] == second[:]
    assert np.array_equal(np.concatenate(first["seq_lengths"]), np.concatenate(second["seq_lengths"]))
