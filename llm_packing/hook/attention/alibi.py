"""ALiBi biases per document, for the architectures that build them from the 2-D attention mask (bloom, falcon with
`alibi=True`).

Their `build_alibi_tensor(attention_mask, num_heads, dtype)` gives each key the bias `slope x position`, the position
read from the mask as `(cumsum(mask) - 1) * mask`. An indexed mask (`[1, 1, 2, 2, 2, 0]`) turns that into nonsense
(document 2's positions doubled), and even a 0/1 mask would give row positions, which falcon rounds through bfloat16
differently from each document's own. The hook replaces the builder with one that looks up, for every token, the bias
the original builder gives that token's position within its document: exactly what the document alone gets.

`ALIBI_MODULES` is the one table of modeling modules whose builder is replaced.
"""

import functools
import importlib

import torch

from .. import registry
from ..documents import documents_of
from ..masks import document_position_ids, is_integer_mask


# model_type -> modeling module whose module-level `build_alibi_tensor(attention_mask, num_heads, dtype)` the model
# calls with its 2-D attention mask.
ALIBI_MODULES = {"bloom": "bloom", "falcon": "falcon"}

def patch_alibi(model_type: str) -> None:
    """Replace `build_alibi_tensor` in `model_type`'s modeling module, if it has one (idempotent; restored through
    the registry)."""
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
