"""Built-in image-text demo: conversations about matplotlib's sample photos, and a tiny Qwen2.5-VL processor.

- Images: the photos matplotlib ships in `mpl-data/sample_data` (Grace Hopper's portrait, the matplotlib logo, a gift
  box), whole and cropped to their details, at two scales: real pixels, 24 images of 16 sizes from 28 x 28 to
  512 x 600, so that conversations range from a few dozen to a few hundred tokens.
- Conversations: TRL's vision format (`messages` + `images`), questions about one or two images or none, answered
  with captions written for these photos.
- Processor: Qwen2.5-VL's, around the demo tokenizer (Mistral-7B's, from `mistral-common`) with Qwen's vision and
  chat tokens added, an image processor capped at 64 image tokens per image, and a chat template that marks the
  assistant's turns (`{% generation %}`) for `assistant_only_loss`.

Nothing is downloaded; matplotlib and mistral-common are in the `demo` extra.
"""

import functools
import io
import os

from .chitchat import _mistral_vocab_and_merges


DEMO_IMAGE_TEXT_DATASET_NAME = "photos"
DEMO_PROCESSOR_NAME = "demo-qwen2.5-vl"

# (photo, crop box (left, top, right, bottom) or None for the whole photo, what it shows).
_DETAILS = [
    ("grace_hopper.jpg", None,
     "A portrait of Rear Admiral Grace Hopper in her dark navy uniform and officer's cap, with a United States flag "
     "behind her on the left and a plain blue backdrop on the right."),
    ("grace_hopper.jpg", (150, 20, 380, 330),
     "An older woman's face with large glasses, a calm smile and a navy officer's cap with a gold emblem."),
    ("grace_hopper.jpg", (170, 20, 370, 140),
     "A dark navy officer's cap with a white crown and a gold eagle and anchor emblem on the front."),
    ("grace_hopper.jpg", (0, 0, 180, 420),
     "Part of the United States flag: white stars on a dark blue field, above red and white stripes."),
    ("grace_hopper.jpg", (320, 480, 460, 535),
     "Rows of colourful service ribbons pinned to a dark uniform jacket."),
    ("grace_hopper.jpg", (70, 470, 180, 525),
     "A small name tag on a navy uniform that reads COMO HOPPER."),
    ("logo2.png", None,
     "The matplotlib logo: the word matplotlib in bold dark blue letters, with a small polar bar chart in place of "
     "the second letter o."),
    ("logo2.png", (290, 5, 375, 115),
     "A small polar bar chart with wedges in orange, yellow, green and blue on a circular grid."),
    ("logo2.png", (0, 15, 290, 120),
     "The letters matpl in a bold, slanted, dark blue typeface on a white background."),
    ("Minduka_Present_Blue_Pack.png", None,
     "A bright blue gift box tied with a silver ribbon, with a large silver bow on top."),
    ("Minduka_Present_Blue_Pack.png", (25, 0, 105, 55),
     "A shiny silver bow with two loops, tied on top of a present."),
    ("Minduka_Present_Blue_Pack.png", (0, 40, 128, 128),
     "The side of a blue box, wrapped crosswise with a silver ribbon."),
]
_SCALES = (1.0, 0.5)
_QUESTIONS = ("What is in this picture?", "Describe the image.", "What do you see here?", "Tell me about this image.")
_TEXT_ONLY = [
    ("Who was Grace Hopper?",
     "Grace Hopper was an American computer scientist and United States Navy rear admiral. She worked on the Harvard "
     "Mark I, wrote one of the first compilers, and helped create the COBOL programming language."),
    ("What is matplotlib?",
     "Matplotlib is a Python library for making plots: line charts, histograms, scatter plots, images and many "
     "more, saved to files or shown in a window."),
    ("Why do people wrap presents?",
     "Wrapping hides the gift until it is opened, which makes the moment a surprise, and a ribbon and bow show that "
     "some care went into it."),
    ("What is a polar bar chart?",
     "A bar chart drawn on a circle: each bar is a wedge whose angle marks a category and whose length marks a "
     "value."),
]

# Qwen2-VL's chat layout, with the assistant's turns in `{% generation %}` blocks.
_PARTS = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
DEMO_IMAGE_TEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}" + _PARTS + "<|im_end|>\n{% endgeneration %}"
    "{% else %}" + _PARTS + "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _sample_photo(name: str) -> str:
    import matplotlib

    return os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data", name)


@functools.cache
def demo_images() -> list[tuple[bytes, str]]:
    """Each detail of `_DETAILS` at each scale of `_SCALES`, as PNG bytes, with its caption."""
    from PIL import Image

    images = []
    for scale in _SCALES:
        for name, box, caption in _DETAILS:
            with Image.open(_sample_photo(name)) as photo:
                image = photo.convert("RGB")
            image = image.crop(box) if box else image
            image = image.resize((max(28, round(image.width * scale)), max(28, round(image.height * scale))),
                                 Image.BICUBIC)
            file = io.BytesIO()
            image.save(file, format="PNG")
            images.append((file.getvalue(), caption))
    return images


def load_photo_conversations(max_conversations: int | None = None):
    """
    The demo's image-text conversations as a `datasets.Dataset` (`messages`, `images` of `datasets.Image`): one per
    image (a question, its caption), one per pair of neighbouring images (both described), and the text-only
    questions, interleaved; the same on every run.
    """
    import datasets

    images = demo_images()
    rows = []
    for i, (data, caption) in enumerate(images):
        rows.append({"messages": [{"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)]},
                                  {"role": "assistant", "content": caption}], "images": [data]})
        if i % 3 == 1:
            other, other_caption = images[(i + 5) % len(images)]
            rows.append({"messages": [{"role": "user", "content": "What do these two pictures show?"},
                                      {"role": "assistant", "content": f"The first: {caption} The second: "
                                                                       f"{other_caption}"}], "images": [data, other]})
        if i % 6 == 5:
            question, answer = _TEXT_ONLY[(i // 6) % len(_TEXT_ONLY)]
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                         "images": []})
    rows = rows[:max_conversations]
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
    })
    return datasets.Dataset.from_list(rows, features=features)


def load_demo_processor():
    """
    A Qwen2.5-VL processor around the demo tokenizer, images capped at 64 tokens (8 x 8 merged patches of 28 px).

    Example:
    ```python
    >>> processor = load_demo_processor()
    >>> processor.image_token, processor.image_token_id, len(processor.tokenizer)
    ('<|image_pad|>', 32000, 32006)

    ```
    """
    import transformers

    class Qwen2_5_VLImageProcessor(transformers.Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor without its video processor (which needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return [name for name in super().get_attributes() if name != "video_processor"]

    vocab, merges = _mistral_vocab_and_merges()
    tokenizer = transformers.LlamaTokenizer(
        vocab=dict(vocab), merges=list(merges), pad_token="<unk>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|im_start|>"]},
                                 replace_extra_special_tokens=False)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>"})
    image_processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}, patch_size=14, merge_size=2,
        temporal_patch_size=2)
    return Qwen2_5_VLImageProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    chat_template=DEMO_IMAGE_TEXT_CHAT_TEMPLATE)
