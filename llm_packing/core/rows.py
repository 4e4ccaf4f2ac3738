"""The layout of a packed row, and the checks of the tokens that go into one: the one home of these rules for
`pack_dataset`, the streamed packing, the collator and the tokenizing helpers.

A packed row lays its documents end to end. With `seq_lengths` `[2, 3]`: positions restart at each document
(`[0, 1, 0, 1, 2]`) and each document's first label is -100, since the model shifts labels by one and would otherwise
train a document to predict the next one's first token. Token ids are in `[0, INT32_MAX]` (they index the embedding
matrix, and packed columns are `int32`); a label is a token id or -100; TRL's mask columns mark with 0 the tokens
that are not trained on.
"""

import numpy as np

from ..errors import PackingTypeError, PackingValueError


IGNORE_INDEX = -100  # the loss's `ignore_index`: a label that is not trained on
MASK_COLUMNS = ("completion_mask", "assistant_masks")  # TRL's: 0 marks a token that is not trained on
INT32_MAX = np.iinfo(np.int32).max


def segment_aranges(starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """
    `concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])` without a Python loop (segments of length 0
    add nothing). `starts` of size 1 starts every segment there. Written into `out` when given (its dtype must hold
    the values).

    Example:
    ```python
    >>> import numpy as np
    >>> segment_aranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    >>> segment_aranges(np.zeros(1, np.int32), np.array([2, 0, 3])).tolist()
    [0, 1, 0, 1, 2]

    ```
    """
    steps = np.empty(int(lengths.sum()), dtype=np.int64) if out is None else out
    if len(steps) == 0:
        return steps
    starts = np.broadcast_to(starts, lengths.shape)
    if not lengths.all():
        starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    steps.fill(1)
    ends = np.cumsum(lengths)[:-1]
    steps[0] = starts[0]
    steps[ends] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps, out=steps)


def position_ids(seq_lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """
    The positions of documents of `seq_lengths` (each > 0) laid end to end: 0 at each document's first token. Written
    into `out` when given.

    Example:
    ```python
    >>> import numpy as np
    >>> position_ids(np.array([2, 3])).tolist()
    [0, 1, 0, 1, 2]

    ```
    """
    return segment_aranges(np.zeros(1, np.int64), seq_lengths, out=out)


def ignore_document_starts(labels: np.ndarray, seq_lengths: np.ndarray) -> np.ndarray:
    """
    Set the label of each document's first token to -100 (in place, and returned), so that no document is trained to
    predict the next one's first token.

    Example:
    ```python
    >>> import numpy as np
    >>> ignore_document_starts(np.array([1, 2, 3, 4, 5]), np.array([2, 3])).tolist()
    [-100, 2, -100, 4, 5]

    ```
    """
    labels[np.cumsum(seq_lengths) - seq_lengths] = IGNORE_INDEX
    return labels


def ignore_masked(labels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """
    Set the labels where a mask column (`completion_mask`, `assistant_masks`) is 0 to -100 (in place, and returned).

    Example:
    ```python
    >>> import numpy as np
    >>> ignore_masked(np.array([1, 2, 3]), np.array([0, 1, 1])).tolist()
    [-100, 2, 3]

    ```
    """
    labels[mask == 0] = IGNORE_INDEX
    return labels


def flat_integers(values, where: str, *, booleans: bool = False) -> np.ndarray:
    """
    `values` as a 1-D numpy array of integers (or booleans, for a mask column, with `booleans=True`), unconverted;
    raises [`~llm_packing.errors.PackingTypeError`] naming `where` (e.g. `"'labels' of example 3"`) otherwise.
    """
    try:
        array = np.asarray(values)
    except ValueError:  # lists of lists of different lengths
        raise PackingTypeError(
            f"{where} must be a flat list of integers, got nested lists of different lengths. Give each example one "
            "flat list of token ids (join or flatten the inner lists, e.g. `sum(lists, [])`)."
        ) from None
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or (booleans and array.dtype == bool)
                               or array.size == 0):
        fix = ("Give each example one flat list of token ids (join or flatten the inner lists)" if array.ndim > 1
               else "Tokenize the text and cast the values to integers first")
        raise PackingTypeError(f"{where} must be a flat list of integers, got dtype {array.dtype} and shape "
                               f"{array.shape}. {fix}.")
    return array


def length_error(name: str, where: str, count: int, expected: int) -> PackingValueError:
    """
    The error for a `labels` or mask column with another number of values than `input_ids`; `where` names the
    column and the example or row.

    Example:
    ```python
    >>> str(length_error("labels", "'labels' of feature 1", 2, 3)).split(".")[0]
    "'labels' of feature 1 has 2 values, but 'input_ids' has 3"

    ```
    """
    meaning = f" ({IGNORE_INDEX} for a token not trained on)" if name == "labels" else ""
    return PackingValueError(
        f"{where} has {count} values, but 'input_ids' has {expected}. Every token needs exactly one {name!r} "
        f"entry{meaning}; fix that example's preprocessing."
    )


def padding_error(where: str) -> PackingValueError:
    """
    The error for an `attention_mask` that holds a 0: the examples were tokenized with padding, and packing would keep
    the pad tokens as document tokens. `where` names the column and the example or row.

    Example:
    ```python
    >>> str(padding_error("'attention_mask' of feature 1")).split(":")[0]
    "'attention_mask' of feature 1 holds 0"

    ```
    """
    return PackingValueError(
        f"{where} holds 0: the examples were tokenized with padding, and packing keeps every token of `input_ids`, "
        "so the pad tokens would be attended to and trained on as part of the document (and shift its positions "
        "after left padding). Tokenize without padding (`padding=False`, the tokenizer's default), or drop the pad "
        "tokens (keep the `input_ids` where `attention_mask` is 1) before packing."
    )


def already_packed_error(where: str) -> PackingValueError:
    """
    The error for input to `pack_dataset` that carries `seq_lengths`: its rows are packed already. `where` names the
    dataset or the example.

    Example:
    ```python
    >>> str(already_packed_error("`dataset`")).split(":")[0]
    "`dataset` has a 'seq_lengths' column"

    ```
    """
    return PackingValueError(
        f"{where} has a 'seq_lengths' column: its rows are packed already (`pack_dataset` writes that column), and "
        "packing them again would take each row as one document, merging its documents and training on their first "
        "tokens. Pack the unpacked, tokenized dataset with the new `max_length` instead: `pack_dataset(tokenized, "
        "max_length)`."
    )


def invalid_tokens(values: np.ndarray, name: str) -> np.ndarray:
    """Which `values` of the column `name` (`input_ids` or `labels`) a packed row cannot hold, as a boolean array."""
    wrong = (values < 0) | (values > INT32_MAX)
    if name == "labels":
        wrong &= values != IGNORE_INDEX
    return wrong


def check_tokens(values: np.ndarray, name: str, where: str) -> None:
    """Raise [`token_error`] for the first value of `values` (the column `name`) that a packed row cannot hold."""
    if values.size == 0 or (values.min() >= 0 and values.max() <= INT32_MAX):  # the common case, without a mask
        return
    wrong = invalid_tokens(values, name)
    if wrong.any():
        raise token_error(name, where, values[np.argmax(wrong)].item())


def token_error(name: str, where: str, value: int) -> PackingValueError:
    """
    The error for a value of `input_ids` or `labels` (the column `name`) outside what a packed row holds; `where`
    names the example or row.

    Example:
    ```python
    >>> str(token_error("labels", "'labels' of feature 1", -5)).split(";")[0]
    "'labels' of feature 1 holds -5: a label is a token id in [0, 2147483647] or -100 (not trained on)"

    ```
    """
    if name == "labels":
        allowed = (f"a label is a token id in [0, {INT32_MAX}] or {IGNORE_INDEX} (not trained on); the loss fails on "
                   f"anything else. Mask tokens with {IGNORE_INDEX} in that example's preprocessing.")
    else:
        allowed = (f"token ids index the embedding matrix and must be in [0, {INT32_MAX}]; {IGNORE_INDEX} belongs in "
                   "'labels' only, and padding is added by the collator (`pad_token_id`). Fix that example's "
                   "tokenization.")
    return PackingValueError(f"{where} holds {value}: {allowed}")
