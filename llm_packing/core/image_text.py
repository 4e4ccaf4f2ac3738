"""Image-text conversations as a dataset holds them: TRL's `messages` + `images` rows.

An image is a path, the file's bytes, a `datasets.Image(decode=False)` value (`{"bytes": ..., "path": ...}`) or an
already decoded `PIL.Image`.

`image_size` reads (width, height) from the file header without decoding pixels (0.12-0.23 ms per JPEG), as the image
will be seen once decoded: an EXIF orientation that `open_image` applies swaps the sides. `open_image` decodes one
image as `datasets.Image` decodes it (`exif_transpose` when the file has an orientation), so that packed and unpacked
training see the same pixels. Both name the row and the path of a missing or unreadable file. Pillow is imported on
first use.

`structured_messages` places a row's images in its messages as TRL's `prepare_multimodal_messages` does, so that the
planner and the collator render the same text as TRL's vision collator.
"""

import io
import os

from ..errors import PackingTypeError, PackingValueError


# EXIF orientations that rotate by 90 or 270 degrees (transpose, rotate 270, transverse, rotate 90): width and height
# swap once applied.
_SIDES_SWAPPED = {5, 6, 7, 8}
_ORIENTATION_TAG = 0x0112


def image_size(image, where: str) -> tuple[int, int]:
    """
    (width, height) of `image` as it will be decoded, from the file header; `where` names it in errors
    (e.g. `"image 0 of row 3"`).

    Example:
    ```python
    >>> import io
    >>> from PIL import Image
    >>> file = io.BytesIO()
    >>> Image.new("RGB", (40, 30)).save(file, format="PNG")
    >>> image_size({"bytes": file.getvalue(), "path": None}, "image 0 of row 0")
    (40, 30)

    ```
    """
    if _is_decoded(image):
        return image.size
    with _opened(image, where) as opened:
        width, height = opened.size
        # A PNG's EXIF chunk may follow its pixels, and Pillow decodes them to find it: only one seen before them
        # is read (an orientation in a late chunk, which `datasets` would apply, is missed).
        if opened.format == "PNG" and "exif" not in opened.info:
            return width, height
        try:
            orientation = opened.getexif().get(_ORIENTATION_TAG)
        except Exception:  # a corrupt EXIF block: datasets would fail on it too, when decoding
            raise _unreadable(image, where, "its EXIF block cannot be read") from None
    return (height, width) if orientation in _SIDES_SWAPPED else (width, height)


def open_image(image, where: str):
    """`image` decoded as `datasets.Image().decode_example` decodes it (an already decoded image is returned as is)."""
    if _is_decoded(image):
        return image
    from PIL import ImageOps

    opened = _opened(image, where)
    try:
        opened.load()
    except Exception as error:
        raise _unreadable(image, where, f"its pixels cannot be decoded ({type(error).__name__}: {error})") from None
    if opened.getexif().get(_ORIENTATION_TAG) is not None:
        opened = ImageOps.exif_transpose(opened)
    return opened


def describe(image) -> str:
    """How an image reference is named in messages: its path, else its size in bytes."""
    path, data = _path_and_bytes(image)
    return repr(path) if path else f"<{len(data)} bytes>"


def _is_decoded(image) -> bool:
    return hasattr(image, "size") and hasattr(image, "getexif")


def _path_and_bytes(image) -> tuple[str | None, bytes | None]:
    if isinstance(image, (str, os.PathLike)):
        return os.fspath(image), None
    if isinstance(image, (bytes, bytearray, memoryview)):
        return None, bytes(image)
    if isinstance(image, dict) and ("bytes" in image or "path" in image):
        return image.get("path"), image.get("bytes")
    return None, None


def _opened(image, where: str):
    from PIL import Image, UnidentifiedImageError

    path, data = _path_and_bytes(image)
    if data is None and path is None:
        raise PackingTypeError(
            f"{where} is {type(image).__name__} {_short(image)}, not an image: expected a file path, the file's "
            "bytes, a `datasets.Image` value ({'bytes': ..., 'path': ...}) or a PIL image. Fix that row's `images`."
        )
    try:
        return Image.open(io.BytesIO(data) if data is not None else path)
    except FileNotFoundError:
        raise PackingValueError(
            f"{where}: the file {path!r} does not exist (working directory {os.getcwd()!r}). Fix the path in that "
            "row, or drop the row before packing."
        ) from None
    except (UnidentifiedImageError, OSError) as error:
        raise _unreadable(image, where, f"it is not an image Pillow can read ({type(error).__name__})") from None


def _unreadable(image, where: str, reason: str) -> PackingValueError:
    return PackingValueError(
        f"{where} ({describe(image)}) cannot be read: {reason}. Replace or remove that image, or drop the row before "
        "packing."
    )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def structured_messages(messages: list[dict], images: list, where: str, videos: list | None = None) -> list[dict]:
    """
    `messages` with every content a list of parts and the row's `images` (and `videos`) in their parts, as TRL's
    `prepare_multimodal_messages` makes them for images: string contents become `[{"type": "text", "text": ...}]`,
    the first user message with a string content gets one `{"type": "image"}` part per image, then one
    `{"type": "video"}` part per video, before its text, and the parts without a value (in order) are filled with
    `images` and `videos`. The inputs are not modified. `where` names the row in errors.

    Unlike TRL, a part whose `"image"` (`"video"`) is `None` counts as empty: a `datasets` struct column gives every
    part every field.

    Example:
    ```python
    >>> user, assistant = structured_messages([{"role": "user", "content": "What is it?"},
    ...                                        {"role": "assistant", "content": "A cat."}], ["cat.jpg"], "row 0")
    >>> user["content"]
    [{'type': 'image', 'image': 'cat.jpg'}, {'type': 'text', 'text': 'What is it?'}]
    >>> assistant["content"]
    [{'type': 'text', 'text': 'A cat.'}]
    >>> structured_messages([{"role": "user", "content": "And this?"}], [], "row 1", ["cat.mp4"])[0]["content"]
    [{'type': 'video', 'video': 'cat.mp4'}, {'type': 'text', 'text': 'And this?'}]

    ```
    """
    media = {"image": list(images or []), "video": list(videos or [])}
    structured, placed = [], False
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise PackingValueError(
                f"{where} has a message with role {role!r}; TRL's vision collator knows 'system', 'user', 'assistant' "
                "and 'tool'. Fix that row's `messages`."
            )
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placed:
                parts = [{"type": kind} for kind, values in media.items() for _ in values] + parts
                placed = True
            message = {**message, "content": parts}
        structured.append(message)
    for kind, values in media.items():
        empty = [(m, p) for m, message in enumerate(structured) if message.get("content") and message["role"] != "tool"
                 for p, part in enumerate(message["content"]) if _is_empty_part(part, kind)]
        if len(empty) != len(values):
            raise PackingValueError(
                f"{where} has {len(values)} {kind}(s) in `{kind}s` but {len(empty)} {kind} part(s) to put them in its "
                f"`messages` (`{{'type': '{kind}'}}` parts, or one per {kind} before the first user message's text "
                "when its content is a string). Make the counts agree in that row."
            )
        for (m, p), value in zip(empty, values, strict=True):
            content = list(structured[m]["content"])
            content[p] = {**content[p], kind: value}
            structured[m] = {**structured[m], "content": content}
    return structured


def images_in(messages: list[dict], kind: str = "image") -> list:
    """The images (`kind="video"`: the videos) of structured `messages` (see [`structured_messages`]), in the order the
    processor reads them."""
    return [part[kind] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == kind
            and part.get(kind) is not None]


def _is_empty_part(part, kind: str) -> bool:
    return isinstance(part, dict) and part.get("type") == kind and part.get(kind) is None
