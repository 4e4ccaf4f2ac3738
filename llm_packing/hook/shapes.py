"""What the hook reads of a model's shape from its config (no imports: any hook module may use it)."""


def attention_head_dims(config) -> tuple[int, ...]:
    """The widths of the attention heads of `config` (its text model's), one per distinct width: `head_dim`, else
    hidden size over heads; per layer where the config varies it by layer (Gemma 4's heterogeneous configs refuse a
    global `head_dim`).

    Example:
    ```python
    >>> from transformers import Qwen2Config
    >>> attention_head_dims(Qwen2Config(hidden_size=1536, num_attention_heads=12))
    (128,)

    ```
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        head_dim = getattr(text, "head_dim", None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: the width varies by layer
        return tuple(sorted({attention_head_dims(layer)[0] for layer in text.per_layer_config}))
    if head_dim:
        return (head_dim,)
    heads = getattr(text, "num_attention_heads", None)
    return (text.hidden_size // heads,) if heads else ()
