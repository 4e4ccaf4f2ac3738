"""What the hook reads of a model's shape from its config (no imports: any hook module may use it)."""


def attention_head_dim(config) -> int:
    """The width of the attention heads of `config` (its text model's): `head_dim`, else hidden size over heads.

    Example:
    ```python
    >>> from transformers import Qwen2Config
    >>> attention_head_dim(Qwen2Config(hidden_size=1536, num_attention_heads=12))
    128

    ```
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    return getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 1 << 30)
