"""Checks of arguments, one wording per kind, so that every entry point refuses a bad count, seed or processor."""

import numpy as np

from ..errors import PackingTypeError, PackingValueError


def check_integer(name: str, value, *, minimum: int = 1, optional: bool = False, meaning: str | None = None,
                  fix: str | None = None) -> None:
    """
    Raise [`~llm_packing.errors.PackingValueError`] unless `value` is an integer (not a bool) of at least `minimum`,
    or `None` when `optional`. The message names `name`, says what is allowed (and what the number counts, `meaning`),
    shows `value`, then gives `fix`.

    Example:
    ```python
    >>> check_integer("max_length", 8, meaning="tokens per packed row")
    >>> check_integer("max_length", 0, meaning="tokens per packed row")
    Traceback (most recent call last):
    ...
    llm_packing.errors.PackingValueError: `max_length` must be a positive integer (tokens per packed row), got 0.
    >>> check_integer("seed", -1, minimum=0, optional=True)
    Traceback (most recent call last):
    ...
    llm_packing.errors.PackingValueError: `seed` must be a non-negative integer or None, got -1.

    ```
    """
    if optional and value is None:
        return
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum:
        return
    allowed = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
    raise PackingValueError(
        f"`{name}` must be {allowed}{' or None' if optional else ''}{f' ({meaning})' if meaning else ''}, got "
        f"{value!r}.{f' {fix}' if fix else ''}"
    )


def check_choice(name: str, value, allowed: tuple, *, fix: str | None = None) -> None:
    """
    Raise [`~llm_packing.errors.PackingValueError`] unless `value` is one of `allowed`; the message names `name`,
    lists `allowed`, shows `value`, then gives `fix`.

    Example:
    ```python
    >>> check_choice("overflow", "wrap", ("error", "split"), fix="Use 'split'.")
    Traceback (most recent call last):
    ...
    llm_packing.errors.PackingValueError: `overflow` must be one of ('error', 'split'), got 'wrap'. Use 'split'.

    ```
    """
    if value not in allowed:
        raise PackingValueError(f"`{name}` must be one of {tuple(allowed)}, got {value!r}.{f' {fix}' if fix else ''}")


def check_bool(name: str, value, *, optional: bool = False) -> None:
    """
    Raise [`~llm_packing.errors.PackingTypeError`] unless `value` is a bool (numpy's too), or `None` when `optional`:
    a string such as `"false"` is true, so taking truthiness would do the opposite of what was asked.

    Example:
    ```python
    >>> check_bool("verify_packing", False)
    >>> from llm_packing.errors import PackingTypeError
    >>> try:
    ...     check_bool("verify_packing", "false")
    ... except PackingTypeError as error:
    ...     print(str(error).split(". ")[0])
    `verify_packing` must be a bool (True or False), got 'false' of type str

    ```
    """
    if isinstance(value, (bool, np.bool_)) or (optional and value is None):
        return
    raise PackingTypeError(
        f"`{name}` must be a bool (True or False){' or None' if optional else ''}, got {value!r} of type "
        f"{type(value).__name__}. Pass `{name}=True` or `{name}=False`, not a string or a number."
    )


def check_processor(name: str, value, *, why: str | None = None) -> None:
    """
    Raise [`~llm_packing.errors.PackingTypeError`] unless `value` is an image-text processor (a `ProcessorMixin` with a
    `tokenizer` and an `image_processor`): a tokenizer alone would count each image as its one placeholder token. The
    message says `why` a processor is needed, names `name`, shows what `value` is, then gives the fix.

    Example:
    ```python
    >>> from llm_packing.errors import PackingTypeError
    >>> try:
    ...     check_processor("processor", "Qwen/Qwen2.5-VL-3B-Instruct")
    ... except PackingTypeError as error:
    ...     print(str(error).split(", got ")[1])
    the str 'Qwen/Qwen2.5-VL-3B-Instruct'. Pass `AutoProcessor.from_pretrained('Qwen/Qwen2.5-VL-3B-Instruct')`.

    ```
    """
    if hasattr(value, "tokenizer") and hasattr(value, "image_processor"):
        return
    shown, source = (f"the str {value!r}", repr(value)) if isinstance(value, str) else (type(value).__name__, "...")
    raise PackingTypeError(
        f"{f'{why}, so ' if why else ''}`{name}` must be the model's processor (a ProcessorMixin with a tokenizer and "
        f"an image processor), got {shown}. Pass `AutoProcessor.from_pretrained({source})`."
    )
