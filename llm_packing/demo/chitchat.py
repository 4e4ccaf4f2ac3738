"""Built-in demo data: real conversations and a real tokenizer, both read from installed packages, no network.

- Conversations: the Chit-Chat Challenge corpus of the `chitchat-dataset` package (7,168 human-human chats, MIT).
  Chats with two speakers are kept; turns alternate `user` / `assistant` from the first speaker on.
- Tokenizer: Mistral-7B v0.1's SentencePiece model (32,000 tokens, Llama-2 style) from the `mistral-common` package
  (Apache-2.0), as a transformers `LlamaTokenizer` with an `[INST]` chat template that marks assistant turns.

Install both with `pip install "llm_packing[demo]"`.
"""

import functools
import importlib.util
import json
import os

from ..core.checks import check_integer
from ..errors import PackingValueError


DEMO_DATASET_NAME = "chitchat"

# Mistral / Llama-2 instruct layout: `<s>[INST] user [/INST] assistant</s>[INST] ...`. The `{% generation %}` block
# makes `apply_chat_template(..., return_assistant_tokens_mask=True)` mark each answer and its `</s>`, so that the
# model is trained to answer and to stop, and never on the user's words.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %}"
    "{% generation %} {{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ raise_exception('The demo chat template knows the roles user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
)


def _package_file(package: str, *parts: str) -> str:
    """Path of a data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The demo needs the {package!r} package, which is not installed. Install the demo extra: "
            '`pip install "llm_packing[demo]"`.'
        )
    return os.path.join(spec.submodule_search_locations[0], *parts)


def load_chitchat_conversations(max_conversations: int | None = None) -> list[list[dict[str, str]]]:
    """
    Two-speaker conversations of the Chit-Chat Challenge corpus, as chat messages.

    Each turn (the consecutive messages of one speaker) becomes one message, its whitespace collapsed to single
    spaces; empty turns are skipped. The first speaker is the `user`, the other the `assistant`. Order is the
    corpus file's, so the first `max_conversations` are the same on every run and every rank.

    Args:
        max_conversations (`int`, *optional*):
            Keep only the first this many conversations (4,017 in all).

    Returns:
        `list[list[dict[str, str]]]`: one list of `{"role", "content"}` messages per conversation.

    Example:
    ```python
    >>> conversations = load_chitchat_conversations(max_conversations=2)
    >>> [message["role"] for message in conversations[0]][:4]
    ['user', 'assistant', 'user', 'assistant']

    ```
    """
    check_integer("max_conversations", max_conversations, optional=True)
    with open(_package_file("chitchat_dataset", "dataset.json"), encoding="utf-8") as file:
        chats = json.load(file)
    conversations = []
    for chat in chats.values():
        turns = [(turn[0]["sender"], " ".join(" ".join(m["text"] for m in turn).split())) for turn in chat["messages"]]
        turns = [(sender, text) for sender, text in turns if text]
        speakers = list(dict.fromkeys(sender for sender, _ in turns))
        if len(speakers) != 2:
            continue
        # Skipping empty turns can leave one speaker twice in a row: merge those into one message.
        messages = []
        for sender, text in turns:
            role = "user" if sender == speakers[0] else "assistant"
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += " " + text
            else:
                messages.append({"role": role, "content": text})
        conversations.append(messages)
        if max_conversations is not None and len(conversations) == max_conversations:
            break
    return conversations


def load_chitchat_dataset(max_conversations: int | None = None):
    """The conversations of [`load_chitchat_conversations`] as a `datasets.Dataset` with one `messages` column."""
    import datasets

    return datasets.Dataset.from_dict({"messages": load_chitchat_conversations(max_conversations)})


@functools.cache
def _mistral_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    import sentencepiece
    from transformers.tokenization_utils_base import generate_merges

    model_file = _package_file("mistral_common", "data", "tokenizer.model.v1")
    model = sentencepiece.SentencePieceProcessor(model_file=model_file)
    vocab = {model.id_to_piece(i): i for i in range(model.get_piece_size())}
    return vocab, generate_merges(vocab)


def load_demo_tokenizer():
    """
    Mistral-7B v0.1's tokenizer (32,000 tokens) as a transformers `LlamaTokenizer`, with the demo chat template.

    Built from the SentencePiece file in `mistral-common` (vocabulary and merges read with `sentencepiece`), so it
    needs neither the network nor `protobuf`. On text without runs of whitespace it gives SentencePiece's ids; the
    demo conversations have their whitespace collapsed. Padding uses `<unk>` (id 0), which no text encodes to.

    Example:
    ```python
    >>> tokenizer = load_demo_tokenizer()
    >>> tokenizer.encode("Hello world", add_special_tokens=False)
    [22557, 1526]
    >>> tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    ...                               tokenize=False)
    '<s>[INST] Hi [/INST] Hello</s>'

    ```
    """
    from transformers import LlamaTokenizer

    vocab, merges = _mistral_vocab_and_merges()
    tokenizer = LlamaTokenizer(vocab=dict(vocab), merges=list(merges), pad_token="<unk>")
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    return tokenizer


def load_chitchat_preference_pairs(max_pairs: int | None = None) -> list[dict[str, list[dict[str, str]]]]:
    """
    Preference pairs built offline from the demo conversations, in TRL's conversational format.

    Each user turn of conversation `i` followed by an assistant reply is a `prompt`; that real reply is `chosen`, and
    the reply at the same exchange (modulo its length) of conversation `i + 1` is `rejected`: fluent text, but an
    answer to another message. Order is the corpus file's, so the pairs are the same on every run and every rank.

    Args:
        max_pairs (`int`, *optional*):
            Keep only the first this many pairs.

    Example:
    ```python
    >>> pair = load_chitchat_preference_pairs(max_pairs=1)[0]
    >>> pair["prompt"][0]["content"], pair["chosen"][0]["content"]
    ('Hello How are you doing today?', 'whats up MD im doing good how are you doing?')
    >>> pair["rejected"][0]["role"]
    'assistant'

    ```
    """
    if max_pairs is not None and max_pairs < 1:
        raise PackingValueError(f"`max_pairs` must be at least 1 or None, got {max_pairs!r}.")
    conversations = load_chitchat_conversations()
    exchanges = [
        [(chat[k], chat[k + 1]) for k in range(len(chat) - 1) if chat[k]["role"] == "user"]
        for chat in conversations
    ]
    exchanges = [chat for chat in exchanges if chat]
    pairs = []
    for i, chat in enumerate(exchanges):
        other = exchanges[(i + 1) % len(exchanges)]
        for k, (prompt, reply) in enumerate(chat):
            rejected = other[k % len(other)][1]
            if rejected["content"] != reply["content"]:
                pairs.append({"prompt": [prompt], "chosen": [reply], "rejected": [rejected]})
            if max_pairs is not None and len(pairs) == max_pairs:
                return pairs
    return pairs
