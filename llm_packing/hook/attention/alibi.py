"""ALiBi biases per document: for the architectures that build them from the 2-D attention mask (bloom, falcon with
`alibi=True`), and for MPT, which builds one bias for every row.

Their `build_alibi_tensor(attention_mask, num_heads, dtype)` gives each key the bias `slope x position`, the position
read from the mask as `(cumsum(mask) - 1) * mask`. An indexed mask (`[1, 1, 2, 2, 2, 0]`) turns that into nonsense
(document 2's positions doubled), and even a 0/1 mask would give row positions, which falcon rounds through bfloat16
differently from each document's own. The hook replaces the builder with one that looks up, for every token, the bias
the original builder gives that token's position within its document: exactly what the document alone gets.

`ALIBI_MODULES` is the one table of modeling modules whose builder is replaced.

MPT gives each key the bias `slope x (position - (row length - 1))`, counted from the row's last key. Softmax ignores a
constant added to a query's scores, so a packed document gets the same attention in exact arithmetic, but not in
float32: a document at the start of a long row adds biases of the row's magnitude to its scores, which rounds them
where the document alone adds small ones (a tiny model, 2,040-token row, 32 heads: 4.7e-5 off alone in the logits;
the last document of a row is exact). MPT's attention takes one 3-D bias `(heads, 1, keys)` for the whole batch,
so the hook wraps it ([`patch_alibi`]): in a packed forward, each row runs with the bias its tokens get alone, key by
key the value MPT's own bias gives that position counted from the end of its document.
"""

import functools
import importlib

import torch

from .. import registry
from ..documents import current_documents, documents_of
from ..masks import document_lengths_per_token, document_position_ids, is_integer_mask


# model_type -> modeling module whose module-level `build_alibi_tensor(attention_mask, num_heads, dtype)` the model
# calls with its 2-D attention mask.
ALIBI_MODULES = {"bloom": "bloom", "falcon": "falcon"}
# model_type -> modeling module whose attention class `<Name>Attention` takes MPT's row bias as `position_bias`.
ROW_BIAS_MODULES = {"mpt": "mpt"}

def patch_alibi(model_type: str) -> None:
    """Replace `build_alibi_tensor` in `model_type`'s modeling module, or wrap MPT's attention, where the type has
    either (idempotent; restored through the registry)."""
    if model_type in ROW_BIAS_MODULES:
        name = ROW_BIAS_MODULES[model_type]
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        attention = getattr(module, f"{name.capitalize()}Attention")
        if not registry.is_ours(attention.forward):
            registry.replace_attribute(attention, "forward", registry.ours(_rows_per_document(attention.forward)))
    if model_type not in ALIBI_MODULES:
        return
    name = ALIBI_MODULES[model_type]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    if not registry.is_ours(module.build_alibi_tensor):
        per_document = registry.ours(_per_document(module.build_alibi_tensor))
        registry.replace_attribute(module, "build_alibi_tensor", per_document)


def _per_document(original):
    @functools.wraps(original)
    def build_alibi_per_document(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """
        `original`'s biases, each key at its position within its document.

        Example (one head, slope 1/2; documents of 2 and 3 tokens and a pad):
        ```python
        >>> import torch
        >>> from llm_packing.hook.attention.alibi import _per_document
        >>> def build(mask, num_heads, dtype):
        ...     return (0.5 * ((mask.cumsum(-1) - 1) * mask)).to(dtype)[:, None, :]
        >>> _per_document(build)(torch.tensor([[1, 1, 2, 2, 2, 0]]), 1, torch.float32)
        tensor([[[0.0000, 0.5000, 0.0000, 0.5000, 1.0000, 0.0000]]])

        ```
        """
        if not is_integer_mask(attention_mask) or not documents_of(attention_mask).is_packed:
            return original(attention_mask, num_heads, dtype)
        batch_size, length = attention_mask.shape
        # One row of ones: the bias of every position 0..length-1 per head, in the original's own arithmetic.
        biases = original(attention_mask.new_ones(1, length), num_heads, dtype).reshape(num_heads, length)
        positions = document_position_ids(attention_mask)
        per_token = biases[:, positions.reshape(-1)].view(num_heads, batch_size, length).transpose(0, 1)
        return per_token.reshape(batch_size * num_heads, 1, length)

    return build_alibi_per_document


def _rows_per_document(original):
    @functools.wraps(original)
    def attention_forward(self, hidden_states, position_bias, *args, **kwargs):
        documents = current_documents()
        batch_size, length = hidden_states.shape[:2]
        # The cache is `cache` (`past_key_values` before transformers 5.24); a packed forward never has one.
        cached = any(kwargs.get(name) is not None for name in ("cache", "past_key_values"))
        if (args or cached or position_bias is None or position_bias.dim() != 3 or documents is None
                or not documents.is_packed or documents.ids.shape != (batch_size, length)
                or position_bias.shape[-1] < length):
            return original(self, hidden_states, position_bias, *args, **kwargs)
        biases = position_bias[:, 0, _bias_columns(documents, position_bias.shape[-1])]  # (heads, batch, length)
        if batch_size == 1:
            return original(self, hidden_states, biases, **kwargs)
        mask = kwargs.pop("attention_mask", None)
        rows = [
            original(self, hidden_states[row : row + 1], biases[:, row, None],
                     attention_mask=None if mask is None else mask[row : row + 1], **kwargs)
            for row in range(batch_size)
        ]
        return tuple(torch.cat(parts) for parts in zip(*rows, strict=True))

    return attention_forward


def _bias_columns(documents, columns: int) -> torch.Tensor:
    """
    For each token of a packed forward, the column of MPT's row bias (`columns` keys, the last one at bias 0) that
    the token's key takes alone: its position counted back from its document's last token.

    Example (documents of 2 and 3 tokens and a pad, a bias of 8 columns):
    ```python
    >>> import torch
    >>> from llm_packing.hook.documents import documents_of
    >>> _bias_columns(documents_of(torch.tensor([[1, 1, 2, 2, 2, 0]])), 8)
    tensor([[6, 7, 5, 6, 7, 7]])

    ```
    """
    def build():
        positions = document_position_ids(documents.mask)
        return positions - document_lengths_per_token(positions)

    return documents.derived("MPT bias columns", build) + columns
