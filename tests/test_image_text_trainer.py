"""PackedSFTTrainer on TRL's vision format (messages + images, a processor as processing_class): its first-step loss is
the loss TRL's own SFTTrainer gets on the same conversations unpacked (one per row, its vision collator), within 1e-5
in float32, with the same label mask, also with `assistant_only_loss` on a real template without `{% generation %}`
markers (TRL's training template swapped in); a processor that does not match the model is refused before training;
a plain Trainer that drops the conversation columns is told which setting keeps them."""

import copy
import tempfile

import datasets
import pytest
import torch
import transformers
from tiny_processors import IMAGE_SIZES, make_processor, photo_bytes, tiny_image_text_model, tiny_processor
from trl import SFTConfig, SFTTrainer, chat_template_utils

from llm_packing import DataCollatorWithPacking, PackedSFTTrainer, configure_packing, pack_dataset
from llm_packing.batches.packed_conversations import media_token_ids
from llm_packing.errors import PackingValueError


FAMILY = "qwen2_5_vl"


def conversations() -> datasets.Dataset:
    """Eight conversations of 0, 1 and 2 images of different sizes, and answers of different lengths."""
    rows = []
    for i in range(8):
        sizes = [IMAGE_SIZES[(i + k) % len(IMAGE_SIZES)] for k in range(i % 3)]
        rows.append({
            "messages": [{"role": "user", "content": f"Question {i}: what is " + "this " * (1 + i % 4) + "?"},
                         {"role": "assistant", "content": "It is a photo" + " of a thing" * (i % 5) + "."}],
            "images": [photo_bytes(i + k, size) for k, size in enumerate(sizes)],
        })
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
    })
    return datasets.Dataset.from_list(rows, features=features)


def config(batch_size: int, **kwargs) -> SFTConfig:
    return SFTConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, bf16=False,
                     per_device_train_batch_size=batch_size, activation_checkpointing=False, seed=0, **kwargs)


def first_step(trainer) -> tuple[float, dict]:
    """The loss of the trainer's first batch before any update, and the batch."""
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item(), batch


def trained_labels(batch: dict) -> list[list[int]]:
    """The labels each document is trained on, in the order of their first token ids' values (a canonical order)."""
    labels, mask = batch["labels"], batch["attention_mask"]
    documents = []
    for row in range(len(labels)):
        for document in range(1, int(mask[row].max()) + 1):
            where = mask[row] == document
            documents.append((batch["input_ids"][row, where].tolist(), labels[row, where][1:].tolist()))
    return [trained for _, trained in sorted(documents)]


@pytest.mark.parametrize("family, assistant_only_loss", [(FAMILY, False), (FAMILY, True), ("gemma3", True),
                                                         ("llava", False)])
def test_first_step_loss_equals_trls_unpacked_training(family, assistant_only_loss, unconfigure_after):
    processor = tiny_processor(family)
    model = tiny_image_text_model(family, processor)
    data = conversations()
    reference = SFTTrainer(model=copy.deepcopy(model), args=config(len(data), max_length=None,
                                                                    assistant_only_loss=assistant_only_loss),
                           train_dataset=data, processing_class=processor)
    trl_collator = reference.data_collator

    def placeholders_masked(examples):  # our one deliberate label difference: image placeholders are not trained on
        batch = trl_collator(examples)
        batch["labels"][torch.isin(batch["input_ids"], torch.tensor(media_token_ids(processor)))] = -100
        return batch

    reference.data_collator = placeholders_masked
    expected, unpacked = first_step(reference)
    packed_trainer = PackedSFTTrainer(model=model, args=config(8, max_length=192,
                                                               assistant_only_loss=assistant_only_loss),
                                      train_dataset=data, processing_class=processor)
    rows = len(packed_trainer.train_dataset)
    assert rows < len(data) and max(len(lengths) for lengths in packed_trainer.train_dataset["seq_lengths"]) > 1
    loss, packed = first_step(packed_trainer)
    assert packed["attention_mask"].max() > 1 and packed["pixel_values"].shape == unpacked["pixel_values"].shape
    assert abs(loss - expected) <= 1e-5, (loss, expected)
    assert trained_labels(packed) == trained_labels(unpacked)


@pytest.mark.parametrize("family", [FAMILY, "gemma3"])
def test_assistant_only_loss_on_a_template_without_generation_markers_trains_what_trl_trains(family,
                                                                                             unconfigure_after):
    # The model's real template (TRL's copy of it) has no {% generation %} markers: TRL's SFTTrainer swaps in its
    # training template; before the fix PackedSFTTrainer trained 0 tokens here (loss 0.0) without a word.
    processor = make_processor(family)
    processor.chat_template = getattr(chat_template_utils, f"{family}_chat_template")
    assert not chat_template_utils.has_generation_markers(processor.chat_template)
    model = tiny_image_text_model(family, processor)
    data = conversations()
    reference = SFTTrainer(model=copy.deepcopy(model), args=config(len(data), max_length=None,
                                                                    assistant_only_loss=True),
                           train_dataset=data, processing_class=processor)
    assert reference.chat_template is not None
    expected, unpacked = first_step(reference)
    packed_trainer = PackedSFTTrainer(model=model, args=config(8, max_length=256, assistant_only_loss=True),
                                      train_dataset=data, processing_class=processor)
    assert packed_trainer.data_collator.chat_template == reference.chat_template
    loss, packed = first_step(packed_trainer)
    assert packed["attention_mask"].max() > 1
    trained = int((packed["labels"] != -100).sum())
    assert trained == int((unpacked["labels"] != -100).sum()) > 0
    assert trained_labels(packed) == trained_labels(unpacked)
    assert abs(loss - expected) <= 1e-5, (loss, expected)


def test_assistant_only_loss_on_a_template_trl_has_no_training_version_of_is_refused_before_training():
    processor = make_processor(FAMILY)
    processor.chat_template = processor.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    with pytest.raises(PackingValueError, match=r"`assistant_only_loss`=True, but the chat template of "
                                                r"Qwen2_5_VLProcessor\w* .* has no `\{% generation %\}` markers, and "
                                                r"TRL has no training template for it"):
        PackedSFTTrainer(model=tiny_image_text_model(FAMILY, processor),
                         args=config(2, max_length=192, assistant_only_loss=True), train_dataset=conversations(),
                         processing_class=processor)


def test_a_plain_trainer_that_drops_the_conversation_columns_is_told_to_keep_them(unconfigure_after):
    processor = tiny_processor(FAMILY)
    model = tiny_image_text_model(FAMILY, processor)
    rows = pack_dataset(conversations(), 192, processor=processor)
    configure_packing(model)

    def trainer(**kwargs):
        args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=1, report_to="none",
                                              per_device_train_batch_size=2, use_cpu=True, save_strategy="no",
                                              **kwargs)
        return transformers.Trainer(model=model, args=args, train_dataset=rows,
                                    data_collator=DataCollatorWithPacking(processor=processor, max_length=192))

    with pytest.raises(PackingValueError, match=r"Feature 0 has no 'messages' \(keys: \['seq_lengths'\]\).* "
                                                r"default `remove_unused_columns=True` drops these columns.* "
                                                r"`TrainingArguments\(remove_unused_columns=False\)`"):
        trainer().train()
    assert trainer(remove_unused_columns=False).train().global_step == 1


def test_a_processor_whose_image_token_is_not_the_models_is_refused():
    processor = tiny_processor(FAMILY)
    model = tiny_image_text_model(FAMILY, processor)
    model.config.image_token_id = processor.image_token_id + 1
    expected = (rf"The processor's image placeholder token id is \[{processor.image_token_id}\] but the model's "
                rf"config says `image_token_id`={processor.image_token_id + 1}")
    with pytest.raises(PackingValueError, match=expected):
        PackedSFTTrainer(model=model, args=config(2, max_length=192), train_dataset=conversations(),
                         processing_class=processor)


def test_a_tokenizer_larger_than_the_embedding_is_refused():
    processor = make_processor(FAMILY)
    model = tiny_image_text_model(FAMILY, processor)
    processor.tokenizer.add_tokens(["<extra-1>", "<extra-2>"])
    with pytest.raises(PackingValueError, match=r"tokenizer has \d+ tokens but the model's embedding has \d+ rows"):
        PackedSFTTrainer(model=model, args=config(2, max_length=192), train_dataset=conversations(),
                         processing_class=processor)


def test_a_conversation_too_long_once_images_are_expanded_is_refused_before_training():
    processor = tiny_processor(FAMILY)
    with pytest.raises(PackingValueError, match=r"longer than `max_length`=40 once their image placeholders are "
                                                r"expanded"):
        PackedSFTTrainer(model=tiny_image_text_model(FAMILY, processor), args=config(2, max_length=40),
                         train_dataset=conversations(), processing_class=processor)


def test_the_trainers_overflow_reaches_image_text_packing(unconfigure_after):
    # overflow="drop": the conversations too long for 40 tokens once their images are expanded are left out, counted.
    processor = tiny_processor(FAMILY)
    trainer = PackedSFTTrainer(model=tiny_image_text_model(FAMILY, processor), args=config(2, max_length=40),
                               train_dataset=conversations(), processing_class=processor, overflow="drop",
                               verify_packing=False)
    kept = sum(len(lengths) for lengths in trainer.train_dataset["seq_lengths"])
    assert 0 < kept < len(conversations())
    assert max(sum(lengths) for lengths in trainer.train_dataset["seq_lengths"]) <= 40


@pytest.mark.parametrize("known_features", [True, False])
def test_a_stream_of_conversations_trains_as_the_memory_mapped_ones(known_features, unconfigure_after):
    """A stream of the same conversations (shorter than the packing buffer: the same rows, docs/images.md) gives the
    memory-mapped trainer's first batch and loss, and trains; features unknown, its first example tells it holds
    images."""
    processor = tiny_processor(FAMILY)
    model = tiny_image_text_model(FAMILY, processor)
    data = conversations()
    mapped = PackedSFTTrainer(model=copy.deepcopy(model), args=config(8, max_length=192), train_dataset=data,
                              processing_class=processor)
    expected, mapped_batch = first_step(mapped)
    stream = data.to_iterable_dataset()
    if not known_features:
        stream = datasets.IterableDataset.from_generator(lambda: iter(data.cast_column(
            "images", datasets.List(datasets.Image(decode=False))).to_list()))
        assert stream.features is None
    trainer = PackedSFTTrainer(model=model, args=config(8, max_length=192, max_steps=2), train_dataset=stream,
                               processing_class=processor)
    assert isinstance(trainer.train_dataset, datasets.IterableDataset)
    loss, batch = first_step(trainer)
    assert batch["attention_mask"].max() > 1
    assert torch.equal(batch["input_ids"], mapped_batch["input_ids"])
    assert abs(loss - expected) <= 1e-6, (loss, expected)
    assert trainer.train().global_step == 2
