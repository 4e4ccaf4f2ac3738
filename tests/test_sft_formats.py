"""One import from `trl.SFTTrainer`: `PackedSFTTrainer` takes the datasets `SFTTrainer` takes and trains the same
tokens, packed.

Each case trains one step on the same raw dataset twice, from the same tiny float32 model: stock
`trl.SFTTrainer(padding_free=False)` (one padded example per row, its own collator) and `PackedSFTTrainer` (several
documents per row). Both first batches hold the whole dataset, so the first-step losses must agree (within 1e-5), and
the documents must be the same token by token, with the same labels: for each document, its `input_ids` and every
label the loss reads (all but the first: the model shifts labels by one, and our collator sets each document's first
label to -100 so that no document predicts the next one's start).
"""


import pytest
import torch
from datasets import Dataset
from loss_recording import LossRecordingPackedSFTTrainer, LossRecordingSFTTrainer, first_step_loss
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig, SFTTrainer

from llm_packing import PackedSFTTrainer, SequenceTooLongError
from llm_packing.demo.chitchat import load_chitchat_conversations, load_demo_tokenizer


TINY = {"vocab_size": 32_000, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}
QUIET = {"report_to": "none", "use_cpu": True, "bf16": False, "activation_checkpointing": False, "save_strategy": "no",
         "seed": 0, "max_steps": 1, "per_device_train_batch_size": 64, "per_device_eval_batch_size": 64}
# Demo conversations of 14 to 103 tokens (308 in all): one row of 1024 holds them all. Short ones: TRL pads every row
# to the longest, and its CPU loss scores every padded position (the first 8 conversations, 24 to 981 tokens, made
# 7,848 positions; these make 618).
CHATS = (2, 3, 4, 5, 6, 9)
# Two more, of 468 and 511 tokens, for the tests of documents longer than max_length=128.
LONG_CHATS = (*CHATS, 7, 12)


def _chats(indices) -> list:
    chats = load_chitchat_conversations(max(indices) + 1)
    return [chats[index] for index in indices]


@pytest.fixture
def tokenizer():
    return load_demo_tokenizer()  # TRL sets `eos_token` and `pad_token` on it: one per test


@pytest.fixture(scope="module")
def conversations():
    return _chats(CHATS)


@pytest.fixture(scope="module")
def long_conversations():
    return _chats(LONG_CHATS)


def messages(conversations) -> Dataset:
    return Dataset.from_dict({"messages": conversations})


def prompt_completion(conversations, conversational: bool) -> Dataset:
    """Each chat's first exchange: the user's turn as the prompt, the reply as the completion."""
    if conversational:
        return Dataset.from_dict({"prompt": [chat[:1] for chat in conversations],
                                  "completion": [chat[1:2] for chat in conversations]})
    return Dataset.from_dict({"prompt": [chat[0]["content"] for chat in conversations],
                              "completion": [" " + chat[1]["content"] for chat in conversations]})


def text(conversations, field="text") -> Dataset:
    return Dataset.from_dict({field: [" ".join(message["content"] for message in chat) for chat in conversations]})


def tiny_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa")


def trained_documents(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each document of a collated batch (TRL's padded rows, or our packed rows with an indexed mask) as its
    `input_ids` and the labels the loss reads (all but the first), sorted: packing reorders documents."""
    documents = []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        for document in mask.unique().tolist():
            if document:
                where = mask == document
                documents.append((tuple(ids[where].tolist()), tuple(labels[where][1:].tolist())))
    return sorted(documents)


def only_batch(trainer) -> dict:
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 1  # the whole dataset in the first step, so the two losses cover the same tokens
    return batches[0]


def train_both(tmp_path, tokenizer, dataset, packed_kwargs=None, **config):
    """TRL's unpacked run and ours on `dataset`: (first-step losses, trained documents, our trainer)."""
    reference = LossRecordingSFTTrainer(
        model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path / "trl"), padding_free=False, **QUIET, **config),
        train_dataset=dataset, processing_class=tokenizer)
    expected_documents = trained_documents(only_batch(reference))
    expected_loss = first_step_loss(reference)
    packed = LossRecordingPackedSFTTrainer(
        model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path / "packed"), **QUIET, **config),
        train_dataset=dataset, processing_class=tokenizer, **(packed_kwargs or {}))
    batch = only_batch(packed)
    documents = trained_documents(batch)
    loss = first_step_loss(packed)
    return (expected_loss, loss), (expected_documents, documents), packed, batch


def assert_same_training(expected_documents, documents, losses):
    assert len(documents) == len(expected_documents)
    for expected, got in zip(expected_documents, documents, strict=True):
        assert got[0] == expected[0]  # the same tokens
        assert got[1] == expected[1]  # trained on at the same places
    expected_loss, loss = losses
    assert abs(loss - expected_loss) <= 1e-5, (loss, expected_loss)


def trained_fraction(documents) -> float:
    labels = [label for _, doc_labels in documents for label in doc_labels]
    return sum(label != -100 for label in labels) / len(labels)


SLOW = pytest.mark.slow


@pytest.mark.usefixtures("unconfigure_after")
@pytest.mark.parametrize(
    ("make", "config", "trained"),
    [
        # The done-when: PackedSFTTrainer(model, SFTConfig(assistant_only_loss=True), <messages>, tokenizer).
        pytest.param(messages, {"assistant_only_loss": True}, (0.2, 0.7), id="messages-assistant_only_loss"),
        pytest.param(messages, {}, (1.0, 1.0), id="messages", marks=SLOW),
        pytest.param(lambda chats: prompt_completion(chats, conversational=True), {}, (0.2, 0.8),
                     id="prompt_completion-conversational", marks=SLOW),  # completion_only_loss=None: True here
        pytest.param(lambda chats: prompt_completion(chats, conversational=False), {"completion_only_loss": True},
                     (0.2, 0.8), id="prompt_completion-text"),
        pytest.param(lambda chats: prompt_completion(chats, conversational=False), {"completion_only_loss": False},
                     (1.0, 1.0), id="prompt_completion-full_loss", marks=SLOW),
        pytest.param(text, {}, (1.0, 1.0), id="text", marks=SLOW),
        pytest.param(lambda chats: text(chats, "body"), {"dataset_text_field": "body", "eos_token": "<unk>"},
                     (1.0, 1.0), id="text-field-eos_token", marks=SLOW),
    ],
)
def test_packed_trains_the_tokens_trl_trains(tmp_path, tokenizer, conversations, make, config, trained):
    # SFTConfig's default max_length (1024), as a TRL user has it: no document is longer.
    losses, (expected_documents, documents), trainer, batch = train_both(tmp_path, tokenizer, make(conversations),
                                                                         **config)
    assert trainer.packing_stats["train"].truncated_sequences == 0
    assert int(batch["attention_mask"].max()) > 1  # packed: rows hold several documents
    assert len(batch["input_ids"]) < len(expected_documents)
    assert trainer.packing_stats["train"].num_sequences == len(CHATS)
    assert_same_training(expected_documents, documents, losses)
    low, high = trained
    assert low <= trained_fraction(documents) <= high  # the masks at work: some tokens trained, others not


@SLOW
@pytest.mark.usefixtures("unconfigure_after")
@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_over_long_documents_are_truncated_as_trl_truncates_them(tmp_path, tokenizer, long_conversations,
                                                                 truncation_mode, caplog):
    # Rows of 128 tokens: several chats are longer. TRL cuts them (and drops the examples left without a trained
    # token); the default `overflow="truncate"` does the same and says so.
    losses, (expected_documents, documents), trainer, _ = train_both(
        tmp_path, tokenizer, messages(long_conversations), max_length=128, assistant_only_loss=True,
        truncation_mode=truncation_mode)
    assert_same_training(expected_documents, documents, losses)
    stats = trainer.packing_stats["train"]
    assert stats.truncated_sequences >= 2 and stats.truncated_tokens > 700
    assert f"documents are longer than max_length=128 and were truncated as trl.SFTTrainer truncates them " \
           f"(truncation_mode={truncation_mode!r})" in caplog.text


@pytest.mark.usefixtures("unconfigure_after")
def test_split_keeps_every_token_and_error_refuses(tmp_path, tokenizer, long_conversations, caplog):
    dataset = messages(long_conversations)
    args = SFTConfig(output_dir=str(tmp_path), max_length=128, assistant_only_loss=True, **QUIET)
    trainer = PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer,
                               overflow="split", verify_packing=False)
    whole = [len(ids) for ids in tokenizer.apply_chat_template(long_conversations, tokenize=True, return_dict=True)[
        "input_ids"]]
    stats = trainer.packing_stats["train"]
    assert stats.num_tokens == sum(whole) and stats.split_sequences == sum(n > 128 for n in whole) > 0
    assert "split into max_length pieces trained as separate documents" in caplog.text
    with pytest.raises(SequenceTooLongError, match=r"longer than `max_length`=128.*overflow='split'"):
        PackedSFTTrainer(model=tiny_model(), args=args, train_dataset=dataset, processing_class=tokenizer,
                         overflow="error")


@SLOW
@pytest.mark.usefixtures("unconfigure_after")
def test_eval_dataset_is_packed_and_scores_as_trl_does(tmp_path, tokenizer, conversations):
    train, evaluation = messages(conversations[:4]), messages(conversations[4:])
    config = {**QUIET, "assistant_only_loss": True}
    reference = SFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path / "trl"), **config),
                           train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)
    trainer = PackedSFTTrainer(model=tiny_model(), args=SFTConfig(output_dir=str(tmp_path / "packed"), **config),
                               train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)
    assert max(map(len, trainer.eval_dataset["seq_lengths"])) > 1
    assert set(trainer.packing_stats) == {"train", "eval"}
    expected, got = reference.evaluate()["eval_loss"], trainer.evaluate()["eval_loss"]
    assert abs(got - expected) <= 1e-5, (got, expected)


@SLOW
@pytest.mark.usefixtures("unconfigure_after")
def test_a_stream_of_conversations_is_packed_as_it_is_read(tmp_path, tokenizer, conversations):
    losses, (expected_documents, documents), _, batch = train_both(
        tmp_path, tokenizer, messages(conversations).to_iterable_dataset(), assistant_only_loss=True)
    assert int(batch["attention_mask"].max()) > 1
    assert_same_training(expected_documents, documents, losses)
