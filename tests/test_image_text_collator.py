"""DataCollatorWithPacking(processor=...) on packed image-text rows: each document is what TRL's vision collator
gives for it alone, laid out packed (token columns end to end, indexed mask, positions restarting, media in packed
order); labels are TRL's with -100 on document starts, padding and image placeholders; every count is checked
against the plan."""

import io

import datasets
import pytest
import torch
from tiny_processors import IMAGE_SIZES, make_processor, photo_bytes, tiny_processor
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from llm_packing import DataCollatorWithPacking, pack_dataset
from llm_packing.batches.packed_conversations import TOKEN_COLUMNS, media_token_ids
from llm_packing.errors import ContaminationError, PackingTypeError, PackingValueError


def conversation(number: int, words: int = 3, images: int = 1) -> dict:
    sizes = [IMAGE_SIZES[(number + k) % len(IMAGE_SIZES)] for k in range(images)]
    return {
        "messages": [{"role": "user", "content": f"conversation {number}: " + "look " * words},
                     {"role": "assistant", "content": "It shows\n a photo."},
                     {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}],
        "images": [{"bytes": photo_bytes(number + k, size), "path": None} for k, size in enumerate(sizes)],
    }


def dataset(rows):
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
    })
    return datasets.Dataset.from_list(rows, features=features)


def alone(processor, row: dict, assistant_only_loss: bool = False) -> dict:
    """TRL's vision collator on one conversation: the reference each packed document must equal."""
    collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=assistant_only_loss)
    return collator([dataset([row])[0]])


def documents_of(batch: dict, row: int):
    """(start, end) of each document of `row` in the batch's indexed mask."""
    mask = batch["attention_mask"][row]
    return [(int((mask == d).nonzero()[0]), int((mask == d).nonzero()[-1]) + 1) for d in range(1, int(mask.max()) + 1)]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3", "idefics3", "llava_onevision", "internvl"])
@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_each_document_is_what_trls_vision_collator_gives_for_it_alone(family, assistant_only_loss):
    processor = tiny_processor(family)
    rows = [conversation(i, words=1 + 4 * (i % 3), images=i % 3) for i in range(6)]
    packed = pack_dataset(dataset(rows), 160, processor=processor)
    collator = DataCollatorWithPacking(processor=processor, check_model_configured=False,
                                       assistant_only_loss=assistant_only_loss)
    batch = collator([packed[i] for i in range(len(packed))])
    assert batch["attention_mask"].max() > 1, "rows hold several documents"
    media = torch.tensor(media_token_ids(processor))
    expected_media = {}
    for row in range(len(packed)):
        for (start, end), messages in zip(documents_of(batch, row), packed[row]["messages"], strict=True):
            reference = alone(processor, rows[int(messages[0]["content"].split(":")[0].split()[1])],
                              assistant_only_loss)
            for name in set(TOKEN_COLUMNS) & set(reference) - {"attention_mask", "labels"}:
                assert torch.equal(batch[name][row, start:end], reference[name][0]), name
            assert torch.equal(batch["position_ids"][row, start:end], torch.arange(end - start))
            labels = reference["labels"][0].clone()
            labels[torch.isin(reference["input_ids"][0], media)] = -100  # the one difference, besides the start
            labels[0] = -100
            assert torch.equal(batch["labels"][row, start:end], labels)
            for name, value in reference.items():
                if name not in TOKEN_COLUMNS and name != "labels":
                    expected_media.setdefault(name, []).append(value)
        padding = batch["attention_mask"][row] == 0
        assert (batch["labels"][row, padding] == -100).all() and (batch["input_ids"][row, padding] == 0).all()
    for name, values in expected_media.items():  # in packed order: row 0's documents, then row 1's
        if name == "pixel_values" and family == "idefics3":  # (batch, images, ...): documents along the image axis
            assert torch.equal(batch[name], torch.cat(values, dim=1))
        elif batch[name].shape[1:] == values[0].shape[1:] and all(v.shape[1:] == values[0].shape[1:] for v in values):
            assert torch.equal(batch[name], torch.cat(values)), name



@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_an_image_column_with_a_mode_is_converted_as_datasets_converts_it(mode):
    """`cast_column("images", Image(mode="RGB"))` on RGBA photos: `datasets` (and so TRL) converts each image to the
    column's mode; the collator decoded the stored bytes without it (pixels 3.8 off, logits 0.88, silently)."""
    from PIL import Image

    def transparent_photo(number: int) -> bytes:
        pixels = torch.randint(0, 256, (56, 56, 4), generator=torch.Generator().manual_seed(number), dtype=torch.uint8)
        encoded = io.BytesIO()
        Image.fromarray(pixels.numpy(), "RGBA").save(encoded, format="PNG")
        return encoded.getvalue()

    processor = tiny_processor("qwen2_5_vl")
    rows = [{**conversation(number, images=0), "images": [{"bytes": transparent_photo(number), "path": None}]}
            for number in range(2)]
    typed = dataset(rows).cast_column("images", datasets.List(datasets.Image(mode=mode)))
    packed = pack_dataset(typed, 400, processor=processor)
    batch = DataCollatorWithPacking(processor=processor, check_model_configured=False)([packed[0]])
    trl = DataCollatorForVisionLanguageModeling(processor)
    order = [int(messages[0]["content"].split(":")[0].split()[1]) for messages in packed[0]["messages"]]
    assert order == [0, 1]
    assert torch.equal(batch["pixel_values"], torch.cat([trl([typed[number]])["pixel_values"] for number in order]))

@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_cut_conversations_keep_their_images_in_the_first_piece(overflow):
    processor = tiny_processor("qwen2_5_vl")
    rows = [conversation(0, words=80, images=2)]
    packed = pack_dataset(dataset(rows), 64, processor=processor, overflow=overflow, max_docs_per_bin=1)
    collator = DataCollatorWithPacking(processor=processor)
    whole = alone(processor, rows[0])
    pieces = sorted((packed[i]["seq_starts"][0], collator([packed[i]])) for i in range(len(packed)))
    assert len(pieces) == (1 if overflow == "truncate" else -(-whole["input_ids"].shape[1] // 64))
    for start, batch in pieces:
        length = int((batch["attention_mask"] > 0).sum())
        assert torch.equal(batch["input_ids"][0, :length], whole["input_ids"][0, start : start + length])
        assert ("pixel_values" in batch) == (start == 0)
    assert torch.equal(pieces[0][1]["pixel_values"], whole["pixel_values"])
    assert torch.equal(pieces[0][1]["image_grid_thw"], whole["image_grid_thw"])


def test_a_processor_that_expands_images_otherwise_than_planned_is_refused():
    packed = pack_dataset(dataset([conversation(0, images=2)]), 200, processor=tiny_processor("qwen2_5_vl"))
    other = make_processor("qwen2_5_vl")
    other.image_processor.max_pixels = other.image_processor.size["longest_edge"] = 28 * 28 * 2  # fewer tokens
    collator = DataCollatorWithPacking(processor=other)
    with pytest.raises(PackingValueError, match=r"document 0 of feature 0: the processor gave \d+ tokens, but the "
                                                r"conversation was packed as \d+: its image placeholders expand"):
        collator([packed[0]])


def test_a_tokenizer_or_a_hub_id_in_place_of_the_processor_is_refused():
    with pytest.raises(PackingTypeError, match=r"`processor` must be the model's processor .*got LlamaTokenizer\."):
        DataCollatorWithPacking(processor=tiny_processor("qwen2_5_vl").tokenizer)
    with pytest.raises(PackingTypeError, match=r"got the str 'Qwen/x'\. Pass `AutoProcessor\.from_pretrained"):
        DataCollatorWithPacking(processor="Qwen/x")


def test_an_image_gone_since_packing_names_the_feature_and_the_path(tmp_path):
    path = tmp_path / "photo.jpg"
    path.write_bytes(photo_bytes(0, (56, 56)))
    rows = [{"messages": conversation(0)["messages"], "images": [str(path)]}]
    packed = pack_dataset(datasets.Dataset.from_list(rows), 200, processor=tiny_processor("llava"))
    path.unlink()
    with pytest.raises(PackingValueError, match=r"image 0 of document 0 of feature 0: the file '.*photo\.jpg' does "
                                                r"not exist"):
        DataCollatorWithPacking(processor=tiny_processor("llava"))([packed[0]])


def test_rows_of_several_documents_need_the_hook():
    processor = tiny_processor("llava")
    packed = pack_dataset(dataset([conversation(0), conversation(1)]), 400, processor=processor)
    assert len(packed) == 1
    with pytest.raises(ContaminationError, match="the model hook is not applied"):
        DataCollatorWithPacking(processor=processor)([packed[0]])


def test_unpacked_conversations_are_collated_one_per_row():
    processor = tiny_processor("qwen2_5_vl")
    rows = [conversation(0, images=1), conversation(1, words=9, images=2)]
    batch = DataCollatorWithPacking(processor=processor)([dataset(rows)[i] for i in range(2)])
    assert batch["attention_mask"].max() == 1
    for row in range(2):
        reference = alone(processor, rows[row])
        length = reference["input_ids"].shape[1]
        assert torch.equal(batch["input_ids"][row, :length], reference["input_ids"][0])


@pytest.mark.parametrize("case", ["template without generation markers", "conversation without an assistant turn"])
def test_assistant_only_loss_refuses_a_conversation_with_no_assistant_tokens(case):
    # Its assistant mask is all zeros: every label would be -100 and nothing would train, silently (TRL's text path
    # refuses such an example too).
    if case == "template without generation markers":
        processor, rows = make_processor("qwen2_5_vl"), [conversation(0), conversation(1)]
        for marker in ("{% generation %}", "{% endgeneration %}"):
            processor.chat_template = processor.chat_template.replace(marker, "")
    else:
        processor, rows = tiny_processor("qwen2_5_vl"), [conversation(0), {**conversation(1), "messages": [
            conversation(1)["messages"][0]]}]
    packed = pack_dataset(dataset(rows), 400, processor=processor)
    assert len(packed) == 1
    collator = DataCollatorWithPacking(processor=processor, check_model_configured=False, assistant_only_loss=True)
    with pytest.raises(PackingValueError, match=r"document \d of feature 0: `assistant_only_loss`=True, but its "
                                                r"assistant mask is all zeros \(0 of \d+ tokens in a "
                                                r"`\{% generation %\}` block\).*set `assistant_only_loss=False`"):
        collator([packed[0]])
    trained = DataCollatorWithPacking(processor=processor, check_model_configured=False)([packed[0]])["labels"]
    assert (trained != -100).any()
