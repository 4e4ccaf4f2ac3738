"""Planning image-text conversations without pixels: the planned token count of a conversation is what the processor
really gives (TRL's vision-collator call), for every processor family in `HEADER_RULES` and for the stand-in path;
image headers are read without decoding; images sit in messages as TRL puts them."""

import io

import pytest
from PIL import Image, ImageFile
from tiny_processors import FAMILIES, IMAGE_SIZES, make_processor, photo, photo_bytes, tiny_processor
from trl.data_utils import prepare_multimodal_messages

from llm_packing.core.image_text import image_size, open_image, structured_messages
from llm_packing.data.image_text import HEADER_RULES, ConversationPlanner, header_rule
from llm_packing.errors import PackingTypeError, PackingValueError


MESSAGES = [
    {"role": "system", "content": "Answer briefly.\n"},
    {"role": "user", "content": "What is in the picture?\n\n"},
    {"role": "assistant", "content": "A photo of\n\n a thing."},
    {"role": "user", "content": "And the colours?"},
    {"role": "assistant", "content": "Blue, mostly.\n"},
]


def real_tokens(processor, messages, images) -> list[int]:
    """The processor's own token ids for one conversation, by the call TRL's vision collator makes."""
    decoded = [open_image(image, "test image") for image in images]
    output = processor.apply_chat_template(structured_messages(messages, decoded, "row 0"), tokenize=True,
                                           return_dict=True, processor_kwargs={"add_special_tokens": False})
    return list(output["input_ids"][0])


def conversations(count_images: int):
    """Image lists of `count_images` images of every size, as bytes: each starting at another size."""
    for start in range(len(IMAGE_SIZES) if count_images else 1):
        sizes = [IMAGE_SIZES[(start + k) % len(IMAGE_SIZES)] for k in range(count_images)]
        yield [{"bytes": photo_bytes(start + k, size), "path": None} for k, size in enumerate(sizes)]


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_tokens_equal_the_processors_expansion(family):
    processor = tiny_processor(family)
    planner = ConversationPlanner(processor)
    assert planner.rule is not None, f"{family} is planned from headers"
    for count_images in (0, 1, 2, 3):
        for images in conversations(count_images):
            tokens, images_end = planner.plan(MESSAGES, images, "row 0")
            ids = real_tokens(processor, MESSAGES, images)
            assert tokens == len(ids), (family, [image_size(image, "") for image in images])
            last_media = max((i for i, token in enumerate(ids) if token == processor.image_token_id), default=-1)
            # The plan's end of the last image covers its last placeholder token and stays before the answer.
            assert last_media < images_end <= len(ids) if count_images else images_end == 0
            if count_images:
                assert images_end <= ids.index(processor.tokenizer.convert_tokens_to_ids("<|assistant|>"))


@pytest.mark.parametrize("family, setting", [("llava", {"do_center_crop": False}),
                                             ("gemma3", {"do_pan_and_scan": True})])
def test_settings_without_a_header_rule_are_planned_with_stand_ins(family, setting):
    processor = make_processor(family)
    for name, value in setting.items():
        setattr(processor.image_processor, name, value)
    planner = ConversationPlanner(processor)
    for images in conversations(2):
        assert planner.plan(MESSAGES, images, "row 0")[0] == len(real_tokens(processor, MESSAGES, images))


def test_a_processor_class_takes_its_base_class_rule():
    processor = tiny_processor("qwen2_vl")  # a subclass without the video processor
    assert type(processor).__name__ == "Qwen2VLProcessorWithout"
    assert header_rule(processor) is HEADER_RULES["Qwen2VLProcessor"]


@pytest.mark.parametrize("kind", ["path", "bytes", "dict", "pil"])
def test_every_kind_of_image_reference_is_planned_alike(kind, tmp_path):
    processor = tiny_processor("qwen2_5_vl")
    data = photo_bytes(0, (112, 56))
    (tmp_path / "a.jpg").write_bytes(data)
    image = {"path": str(tmp_path / "a.jpg"), "bytes": data, "dict": {"bytes": data, "path": None},
             "pil": Image.open(io.BytesIO(data))}[kind]
    planned = ConversationPlanner(processor).plan(MESSAGES, [image], "row 0")[0]
    assert planned == len(real_tokens(processor, MESSAGES, [image]))


@pytest.mark.parametrize("format", ["PNG", "JPEG"])
def test_header_sizes_leave_pixels_undecoded(tmp_path, monkeypatch, format):
    path = tmp_path / "a.img"
    photo(0, (30, 20)).save(path, format=format)
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self, *a: decoded.append(self))
    assert image_size(str(path), "image 0 of row 0") == (30, 20)
    assert decoded == []
    open_image(str(path), "image 0 of row 0")
    assert decoded  # the check sees a decode


def test_an_exif_rotation_swaps_the_sides_as_decoding_does(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 40 x 20, shown 20 x 40
    photo(0, (40, 20)).save(path, exif=exif)
    assert image_size(str(path), "image") == (20, 40) == open_image(str(path), "image").size


def test_a_missing_or_unreadable_file_names_the_row_and_the_path(tmp_path):
    planner = ConversationPlanner(tiny_processor("qwen2_5_vl"))
    with pytest.raises(PackingValueError, match=r"image 0 of row 7: the file '.*nowhere\.jpg' does not exist"):
        planner.plan(MESSAGES, [str(tmp_path / "nowhere.jpg")], "row 7")
    (tmp_path / "text.jpg").write_text("not an image")
    with pytest.raises(PackingValueError, match=r"image 0 of row 3 \('.*text\.jpg'\) cannot be read"):
        planner.plan(MESSAGES, [str(tmp_path / "text.jpg")], "row 3")
    with pytest.raises(PackingTypeError, match=r"image 0 of row 1 is int 5, not an image"):
        planner.plan(MESSAGES, [5], "row 1")


def test_a_placeholder_typed_in_the_text_is_refused_with_its_count():
    processor = tiny_processor("qwen2_5_vl")
    messages = [{"role": "user", "content": "Look: <|image_pad|>"}, {"role": "assistant", "content": "Yes."}]
    expected = r"row 4: its chat text holds 2 image placeholder\(s\) '<\|image_pad\|>' for 1 image\(s\)"
    with pytest.raises(PackingValueError, match=expected):
        ConversationPlanner(processor).plan(messages, [photo_bytes(0, (56, 56))], "row 4")


def test_images_without_parts_to_go_in_are_refused():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    with pytest.raises(PackingValueError, match=r"row 2 has 1 image\(s\) in `images` but 0 image part\(s\)"):
        structured_messages(messages, ["a.jpg"], "row 2")


@pytest.mark.parametrize("messages, images", [
    (MESSAGES, ["a", "b"]),
    (MESSAGES, []),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]},
      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "image"}]}], ["a", "b"]),
])
def test_images_are_placed_as_trl_places_them(messages, images):
    assert structured_messages(messages, images, "row 0") == prepare_multimodal_messages(messages, images)
