"""Multimodal rotary positions (mRoPE: Qwen2/2.5/3-VL, Qwen3.5, GLM-4V) per document of a packed batch.

An mRoPE model gives each token three positions (temporal, height, width): text tokens advance all three together,
image tokens take their place in the image's grid, video tokens in the video's grid with a temporal position that
steps per temporal patch (Qwen2.5-VL: by `tokens_per_second` times the seconds a patch spans, `second_per_grid_ts`;
Qwen3-VL: per frame, the frames separated by timestamp text). Its `get_rope_index` numbers one sequence. Over a
packed row it would number the documents one after another (each later document shifted by the positions before it:
exact in exact arithmetic, drifting in floating point), and 2-D per-document positions expanded to three rows put
every image token at a text position (packed logits then differ from the documents alone by 0.004 to 0.35). So the
positions are computed by the model's own `get_rope_index` on each document alone, with that document's own image
and video grids (and its videos' `second_per_grid_ts`), and laid out as transformers' packed layout
`(4, batch, length)`: row 0 the per-document text positions (they drive the mask builder, which checks that they
restart at every document), rows 1-3 the 3-D positions.
"""

import torch

from ..documents import ForwardDocuments
from ..masks import document_position_ids


def rope_index_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module holding `get_rope_index` (the model itself, or its base model), or None for a model without
    mRoPE."""
    for module in (model, getattr(model, "model", None), getattr(model, "base_model", None)):
        if module is not None and callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def packed_mrope_position_ids(
    rope_module: torch.nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor,
    documents: ForwardDocuments,
    mm_token_type_ids: torch.Tensor | None = None,
    image_grids: list[torch.Tensor | None] | None = None,
    video_grids: list[torch.Tensor | None] | None = None,
    video_seconds: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """
    Per-document mRoPE positions of a packed batch, `(4, batch_size, length)`, 0 on padding.

    Args:
        rope_module (`torch.nn.Module`): the module with the model's `get_rope_index`.
        input_ids (`torch.Tensor`, *optional*): `(batch_size, length)`; needed only for documents with media.
        attention_mask (`torch.Tensor`): the indexed mask (`[1, 1, 2, 2, 2, 0]`).
        documents ([`ForwardDocuments`]): its documents (`documents_of(attention_mask)`).
        mm_token_type_ids (`torch.Tensor`, *optional*): 1 on image placeholders, 2 on video placeholders; needed for
            documents with media.
        image_grids (`list`, *optional*): per document (order of `documents.starts`), its rows of `image_grid_thw`,
            or None for a document without images.
        video_grids (`list`, *optional*): the same for `video_grid_thw`.
        video_seconds (`list`, *optional*): the same for `second_per_grid_ts` (Qwen2.5-VL), or None.
    """
    text = document_position_ids(attention_mask)
    positions = text.unsqueeze(0).repeat(4, 1, 1)
    length = attention_mask.shape[-1]
    n_documents = len(documents.starts)
    image_grids = image_grids or [None] * n_documents
    video_grids = video_grids or [None] * n_documents
    video_seconds = video_seconds or [None] * n_documents
    for index in range(n_documents):
        if image_grids[index] is None and video_grids[index] is None:
            continue
        row, start = divmod(int(documents.starts[index]), length)
        end = start + int(documents.lengths[index])
        media = {"video_grid_thw": video_grids[index]}
        if video_seconds[index] is not None:
            media["second_per_grid_ts"] = video_seconds[index]
        document_positions, _ = rope_module.get_rope_index(
            input_ids[row : row + 1, start:end],
            mm_token_type_ids=mm_token_type_ids[row : row + 1, start:end],
            image_grid_thw=image_grids[index],
            attention_mask=None,
            **media,
        )
        positions[1:, row, start:end] = document_positions[:, 0].to(positions.device)
    return positions
