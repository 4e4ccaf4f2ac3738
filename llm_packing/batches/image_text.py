"""The packed batch of image-text documents: per-document processor outputs laid out in rows, as the hook expects them.

Each document is what the model's own processor returns for one conversation (batch size 1): `input_ids` with the
image placeholders already expanded, and the media tensors (`pixel_values`, `image_grid_thw`, `image_sizes`, ...).
[`pack_image_text_documents`] lays documents end to end in rows:
- token columns (`input_ids`, `mm_token_type_ids`, `token_type_ids`, `labels`) side by side, padding 0 (-100 for
  labels) after the last document of a row; a document without a column another has gets 0 there (text);
- `attention_mask`: the indexed mask (`[1, 1, 2, 2, 2, 0]`), `position_ids`: 2-D, restarting at 0 per document (the
  hook computes an mRoPE model's 3-D positions from them, per document, in its forward pre-hook);
- `labels`: the document's own `labels` if it has them (a completion-only mask), else its `input_ids`; -100 on each
  document's first token (the model shifts labels: it must not learn to predict a document from the one before) and
  on padding;
- media: each key's tensors concatenated in packed order (row 0's documents, then row 1's, ...), the order in which
  every supported model scatters image features into placeholder tokens. A dimension the processor pads per call
  (LLaVA-NeXT's patches per image, Pixtral's image sides) is padded to the largest among the documents, as one
  processor call over all of them would. Per-document values (LLaVA-OneVision's `batch_num_images`) stay one per
  document.

What differs per model family is data, in `MEDIA_LAYOUTS`: media whose documents are concatenated along another axis
(Idefics' `(batch, images, ...)` pixels), padding values other than 0, and Mllama's per-row image slots (its
`cross_attention_mask` says which slots each token sees: a document's tokens see only its own images).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import PackingTypeError, PackingValueError
from ..hook.masks import document_position_ids


# Columns with one value per token, laid out like `input_ids`.
TOKEN_COLUMNS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "labels")


@dataclass(frozen=True)
class MediaLayout:
    """How a model family's media tensors go into a packed batch.

    Attributes:
        axis (`dict[str, int]`): media key -> the axis along which documents' tensors are concatenated (0 if absent).
        pad_values (`dict[str, float]`): media key -> the value a dimension padded per call is filled with (0 if
            absent).
        slots_per_row (`bool`): the images of a row are slots of that row (`(batch, images, ...)`), and a token
            column `cross_attention_mask` `(batch, length, images, tiles)` says which slots each token sees (Mllama).
        required_columns (`tuple[str, ...]`): token columns every document must bring; any other missing column is
            0 (text) in the packed batch.
        same_shape (`tuple[str, ...]`): media keys the model reads at their full shape (LLaVA-OneVision's
            `pixel_values_videos` `(videos, frames, ...)`: a padded frame would be a frame); documents must agree.
    """

    axis: dict[str, int] = field(default_factory=dict)
    pad_values: dict[str, float] = field(default_factory=dict)
    slots_per_row: bool = False
    required_columns: tuple[str, ...] = ()
    same_shape: tuple[str, ...] = ()


_IMAGES_ON_AXIS_1 = MediaLayout(axis={"pixel_values": 1, "pixel_attention_mask": 1})

# model_type -> its layout; every other type concatenates media along axis 0, padding with 0.
MEDIA_LAYOUTS: dict[str, MediaLayout] = {
    # `(batch, images, channels, height, width)`: the model flattens batch and images and drops all-zero images.
    "idefics2": _IMAGES_ON_AXIS_1,
    "idefics3": _IMAGES_ON_AXIS_1,
    "smolvlm": _IMAGES_ON_AXIS_1,
    # Patch positions of padding patches are -1 (the processor pads each image to `max_patches` this way).
    "gemma4": MediaLayout(pad_values={"image_position_ids": -1}),
    "mllama": MediaLayout(slots_per_row=True),
    # Every frame of a video gives tokens, so videos of one batch must have as many frames (and the same size).
    "llava_onevision": MediaLayout(same_shape=("pixel_values_videos",)),
    # 0 is prefix (image and prompt, attended both ways), 1 suffix: no value is right for a document without them.
    "paligemma": MediaLayout(required_columns=("token_type_ids",)),
}
_MLLAMA_MEDIA = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")


def pack_image_text_documents(
    documents: Sequence[Mapping[str, torch.Tensor]],
    rows: Sequence[Sequence[int]],
    row_length: int,
    *,
    model_type: str,
) -> dict[str, torch.Tensor]:
    """
    Lay processed image-text documents out as a packed batch (see the module docstring for every column).

    Args:
        documents (`Sequence[Mapping[str, torch.Tensor]]`):
            One processor output per document, batch size 1: `input_ids` of shape `(1, length)` (or `(length,)`),
            optional `labels`, `mm_token_type_ids`, `token_type_ids` of the same shape, and the document's media
            tensors. A document without images has no media keys. Its `attention_mask`, if given, must be all ones.
        rows (`Sequence[Sequence[int]]`):
            For each row of the batch, the indices into `documents` it holds, in order (e.g. the bins of
            `llm_packing.pack_sequences` over the documents' token counts).
        row_length (`int`):
            Length of every row; the rest after the last document is padding.
        model_type (`str`):
            The model's `config.model_type`: selects its entry of `MEDIA_LAYOUTS`.

    Returns:
        `dict[str, torch.Tensor]`: `input_ids`, `attention_mask`, `position_ids`, `labels` of shape
        `(len(rows), row_length)`, the token columns the documents have, and each media key, ready for
        `model(**batch)` once packing is configured.

    Raises:
        `PackingValueError`: a row longer than `row_length`, an index outside `documents`, an `attention_mask`
            that is not all ones, a token column of another length than the document's `input_ids`, a column the
            family requires missing (PaliGemma's `token_type_ids`).
        `PackingTypeError`: a document value that is not a tensor.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.batches.image_text import pack_image_text_documents
    >>> documents = [
    ...     {"input_ids": torch.tensor([[5, 9, 9, 6]]), "pixel_values": torch.ones(1, 3, 2, 2)},
    ...     {"input_ids": torch.tensor([[7, 8]])},
    ...     {"input_ids": torch.tensor([[5, 9, 6]]), "pixel_values": torch.zeros(1, 3, 2, 2)},
    ... ]
    >>> batch = pack_image_text_documents(documents, [[0, 1], [2]], 6, model_type="llava")
    >>> batch["attention_mask"]
    tensor([[1, 1, 1, 1, 2, 2],
            [1, 1, 1, 0, 0, 0]])
    >>> batch["position_ids"]
    tensor([[0, 1, 2, 3, 0, 1],
            [0, 1, 2, 0, 0, 0]])
    >>> batch["labels"]
    tensor([[-100,    9,    9,    6, -100,    8],
            [-100,    9,    6, -100, -100, -100]])
    >>> batch["pixel_values"].shape
    torch.Size([2, 3, 2, 2])

    ```
    """
    layout = MEDIA_LAYOUTS.get(model_type, MediaLayout())
    documents = [_as_document(document, index) for index, document in enumerate(documents)]
    _check_rows(rows, [document["input_ids"].shape[-1] for document in documents], row_length)
    _check_required_columns(documents, layout, model_type)
    batch_size = len(rows)
    input_ids = torch.zeros(batch_size, row_length, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, row_length, dtype=torch.long)
    labels = torch.full((batch_size, row_length), -100, dtype=torch.long)
    present = [key for key in ("mm_token_type_ids", "token_type_ids") if any(key in d for d in documents)]
    columns = {key: torch.zeros(batch_size, row_length, dtype=torch.long) for key in present}
    media: dict[str, list[torch.Tensor]] = {}
    spans: list[list[tuple[int, int, int]]] = []
    for row, indices in enumerate(rows):
        start, row_spans = 0, []
        for number, index in enumerate(indices, start=1):
            document = documents[index]
            length = document["input_ids"].shape[-1]
            end = start + length
            input_ids[row, start:end] = document["input_ids"]
            attention_mask[row, start:end] = number
            labels[row, start + 1 : end] = document.get("labels", document["input_ids"])[1:]
            for key, column in columns.items():
                if key in document:
                    column[row, start:end] = document[key]
            for key, value in document.items():
                if key not in TOKEN_COLUMNS and not (layout.slots_per_row and key in _MLLAMA_MEDIA):
                    media.setdefault(key, []).append(value)
            row_spans.append((index, start, length))
            start = end
        spans.append(row_spans)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": document_position_ids(attention_mask),
        **columns,
    }
    for key, values in media.items():
        if key in layout.same_shape:
            _check_same_shape(key, values, model_type)
        batch[key] = _concatenate(values, layout.axis.get(key, 0), layout.pad_values.get(key, 0))
    if layout.slots_per_row:
        batch.update(_images_in_row_slots(documents, spans, row_length))
    batch["labels"] = labels
    return batch


def _check_rows(rows, lengths: list[int], row_length: int) -> None:
    if isinstance(row_length, bool) or not isinstance(row_length, int) or row_length < 1:
        raise PackingValueError(f"`row_length` must be a positive int, got {row_length!r}.")
    for row, indices in enumerate(rows):
        outside = [index for index in indices if not 0 <= index < len(lengths)]
        if outside:
            raise PackingValueError(
                f"`rows[{row}]` holds document indices {outside} outside 0..{len(lengths) - 1} (`documents` has "
                f"{len(lengths)}). Pass the bins of the same documents list."
            )
        tokens = sum(lengths[index] for index in indices)
        if tokens > row_length:
            raise PackingValueError(
                f"`rows[{row}]` holds {tokens} tokens (documents {list(indices)}), more than `row_length`="
                f"{row_length}. Pack the documents by their token counts with placeholders expanded (`input_ids` of "
                "the processor output)."
            )


def _check_required_columns(documents, layout: MediaLayout, model_type: str) -> None:
    for key in layout.required_columns:
        missing = [index for index, document in enumerate(documents) if key not in document]
        if missing:
            raise PackingValueError(
                f"`documents` {missing} have no `{key}`, which every {model_type} document needs: its processor "
                "returns them; for a text-only document, tokenize prompt and suffix with `return_token_type_ids=True`."
            )


def _as_document(document: Mapping, index: int) -> dict[str, torch.Tensor]:
    """The document with its token columns 1-D, checked."""
    if not isinstance(document, Mapping) or "input_ids" not in document:
        found = f"keys {list(document)}" if isinstance(document, Mapping) else type(document).__name__
        raise PackingTypeError(
            f"`documents[{index}]` must be a mapping with `input_ids` (a processor output of one conversation), got "
            f"{found}."
        )
    out = {}
    for key, value in document.items():
        if not isinstance(value, torch.Tensor):
            raise PackingTypeError(
                f"`documents[{index}][{key!r}]` is {type(value).__name__}, not a torch.Tensor. Call the processor "
                "with `return_tensors='pt'` and pass only its tensors."
            )
        out[key] = value
    length = out["input_ids"].shape[-1]
    if out["input_ids"].dim() > 2 or out["input_ids"].numel() != length:
        raise PackingValueError(
            f"`documents[{index}]['input_ids']` has shape {tuple(out['input_ids'].shape)}: one document per entry, "
            "of shape (1, length) or (length,). Process each conversation on its own."
        )
    for key in TOKEN_COLUMNS:
        if key in out:
            if out[key].shape[-1] != length or out[key].numel() != length:
                raise PackingValueError(
                    f"`documents[{index}][{key!r}]` has shape {tuple(out[key].shape)}, not that of its `input_ids` "
                    f"({tuple(out['input_ids'].shape)})."
                )
            out[key] = out[key].reshape(length)
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool((mask == 1).all()):
        raise PackingValueError(
            f"`documents[{index}]['attention_mask']` is not all ones ({mask.tolist()}): a document is packed "
            "without padding. Process each conversation on its own, without `padding`."
        )
    return out


def _check_same_shape(key: str, values: list[torch.Tensor], model_type: str) -> None:
    shapes = sorted({tuple(value.shape[1:]) for value in values})
    if len(shapes) > 1:
        raise PackingValueError(
            f"The documents' `{key}` have shapes {shapes} (after the first axis); {model_type} reads every frame of "
            "a packed batch's videos at one shape, so padding would add frames. Sample the same number of frames "
            "from every video (the video processor's `num_frames`, `do_sample_frames=True`), or put the videos of "
            "different lengths in different batches."
        )


def _concatenate(values: list[torch.Tensor], axis: int, pad_value: float) -> torch.Tensor:
    """Concatenate along `axis`, padding every other dimension to the largest among `values`."""
    shape = [max(value.shape[d] for value in values) for d in range(values[0].dim())]
    padded = []
    for value in values:
        widths = []
        for d in reversed(range(value.dim())):
            widths += [0, 0 if d == axis else shape[d] - value.shape[d]]
        padded.append(torch.nn.functional.pad(value, widths, value=pad_value) if any(widths) else value)
    return torch.cat(padded, dim=axis)


def _images_in_row_slots(documents, spans, row_length: int) -> dict[str, torch.Tensor]:
    """Mllama: `pixel_values` `(batch, images, tiles, channels, height, width)`, `aspect_ratio_ids`
    `(batch, images)`, `aspect_ratio_mask` `(batch, images, tiles)` hold a row's images in slots, documents one after
    another; `cross_attention_mask` `(batch, length, images, tiles)` gives each document's tokens its own slots only,
    so no token can attend to another document's images."""
    with_images = [d for d in documents if "pixel_values" in d]
    if not with_images:
        return {}
    slots = max(sum(documents[i]["pixel_values"].shape[1] for i, _, _ in row if "pixel_values" in documents[i])
                for row in spans)
    tiles = max(d["pixel_values"].shape[2] for d in with_images)
    template = with_images[0]["pixel_values"]
    batch_size = len(spans)
    pixel_values = torch.zeros(batch_size, slots, tiles, *template.shape[3:], dtype=template.dtype)
    aspect_ratio_ids = torch.zeros(batch_size, slots, dtype=torch.long)
    aspect_ratio_mask = torch.zeros(batch_size, slots, tiles, dtype=torch.long)
    cross_attention_mask = torch.zeros(batch_size, row_length, slots, tiles, dtype=torch.long)
    for row, row_spans in enumerate(spans):
        slot = 0
        for index, start, length in row_spans:
            document = documents[index]
            if "pixel_values" not in document:
                continue
            n, t = document["pixel_values"].shape[1:3]
            pixel_values[row, slot : slot + n, :t] = document["pixel_values"][0]
            aspect_ratio_ids[row, slot : slot + n] = document["aspect_ratio_ids"][0]
            aspect_ratio_mask[row, slot : slot + n, :t] = document["aspect_ratio_mask"][0]
            tokens = slice(start, start + length)
            cross_attention_mask[row, tokens, slot : slot + n, :t] = document["cross_attention_mask"][0]
            slot += n
    return {
        "pixel_values": pixel_values,
        "aspect_ratio_ids": aspect_ratio_ids,
        "aspect_ratio_mask": aspect_ratio_mask,
        "cross_attention_mask": cross_attention_mask,
    }
