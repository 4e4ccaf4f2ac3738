"""Model FLOPs of a training step and the device's bf16 peak, for the MFU column of `train_throughput.py`.

MFU counts the arithmetic the model needs, not what a configuration spends: every matrix product of a forward over
the real (non-pad) tokens, times 3 for forward and backward (6 FLOPs per weight per token), plus causal attention
within each document (the `l (l + 1) / 2` query-key pairs of a document of `l` tokens, 4 FLOPs per pair per head
dimension forward, times 3). Padding, attention across documents and recomputation under gradient checkpointing are
not model FLOPs: a configuration that spends them shows a lower MFU for the same step time (PaLM's definition).
Under TRL's fused LM head the head multiplies only the positions it scores (label not -100), so the head's weights
count those positions only (`head_weights`, `scored_tokens`); its backward's recomputed tiles are not model FLOPs.
Sliding windows are not subtracted (the models measured here have none).

Example:
```python
>>> from types import SimpleNamespace
>>> config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, head_dim=16, hidden_size=64)
>>> step_flops(1_000, config, [3, 1])  # 6 * 1,000 * 4 tokens + 6 * 2 layers * 64 * (3 * 4 + 1 * 2)
34752
>>> step_flops(1_000, config, [3, 1], head_weights=400, scored_tokens=2)  # the head on 2 of 4 tokens: - 6 * 400 * 2
29952
>>> peak_bf16_flops("NVIDIA H100 80GB HBM3"), peak_bf16_flops("NVIDIA H100 PCIe"), peak_bf16_flops("a CPU")
(989000000000000.0, 756000000000000.0, None)

```
"""

# Dense bf16 tensor-core peaks by the vendors' datasheets (no sparsity), by a substring of
# `torch.cuda.get_device_name()`, most specific first. The H200 has the H100 SXM's chip rate.
PEAKS_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


def matmul_weights(model) -> int:
    """Weights that multiply every token: those of the `nn.Linear` layers (a tied LM head counted once, as the
    matrix product it is); embedding lookups are no arithmetic."""
    import torch

    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def step_flops(weights: int, config, document_lengths, head_weights: int = 0, scored_tokens: int | None = None) -> int:
    """Model FLOPs of one forward and backward over documents of `document_lengths` tokens (see the module); with
    `scored_tokens`, the `head_weights` of `weights` multiply only that many tokens."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tokens = sum(document_lengths)
    unscored = 0 if scored_tokens is None else tokens - scored_tokens
    pairs_twice = sum(length * (length + 1) for length in document_lengths)
    attention = 6 * config.num_hidden_layers * heads * head_dim * pairs_twice
    return 6 * (weights * tokens - head_weights * unscored) + attention


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the device named `device_name`, or None where it is not in `PEAKS_BF16`."""
    return next((peak for key, peak in PEAKS_BF16 if key in device_name), None)
