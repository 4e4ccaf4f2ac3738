"""The dtype a tensor is computed in under torch's autocast."""

import torch


def computed_dtype(tensor: torch.Tensor) -> torch.dtype:
    """
    The dtype in which autocast-eligible operations (matrix products, `scaled_dot_product_attention`) compute on
    `tensor`: autocast's where autocast is on for its device (it casts every floating tensor but float64), else the
    tensor's own.

    Example:
    ```python
    >>> import torch
    >>> from llm_packing.hook.autocast import computed_dtype
    >>> computed_dtype(torch.zeros(2))
    torch.float32
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     computed_dtype(torch.zeros(2)), computed_dtype(torch.zeros(2, dtype=torch.float64))
    (torch.bfloat16, torch.float64)

    ```
    """
    device_type = tensor.device.type
    if tensor.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype
