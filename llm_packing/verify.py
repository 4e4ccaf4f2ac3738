"""A behavioural check that packing isolates documents in a given model: patches existing is not proof.

`verify_packing` runs a tiny packed batch (two rows, three documents, trailing padding) and each document alone through
the model, and compares the logits of every real token. Cost: four forwards of at most 16 tokens.
"""

import torch

from .errors import ContaminationError, PackingTypeError, PackingValueError


def verify_packing(model, *, atol: float | None = None, seed: int = 0) -> float:
    """
    Check that a packed batch gives the same logits as its documents run one by one.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A causal LM, usually after [`configure_packing`]. It is put in eval mode for the check and restored.
        atol (`float`, *optional*):
            Largest accepted absolute logit difference. Defaults to `1e-4` for float32/float64 weights and `5e-2` for
            float16/bfloat16 (contaminated documents differ by far more: 0.3 to 0.6 on tiny random models).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the random token ids.

    Returns:
        `float`: the largest absolute logit difference found.

    Raises:
        `ContaminationError`: the difference exceeds `atol`, i.e. documents attend across their boundaries.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise PackingTypeError(
            f"`model` must be a transformers model (a torch.nn.Module with a `config`), got {type(model).__name__}. "
            "Pass the model itself, e.g. `verify_packing(model)`, not its config."
        )
    if atol is not None and (isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0):
        raise PackingValueError(f"`atol` must be a non-negative number or None (a dtype default), got {atol!r}.")
    parameter = next(model.parameters())
    if atol is None:
        atol = 1e-4 if parameter.dtype in (torch.float32, torch.float64) else 5e-2
    device = parameter.device
    documents = _random_documents(model.config, (9, 7, 11), seed, device)
    # Rows: [doc 1, doc 2] and [doc 3, 5 pads]; positions restart per document. 16 columns, because compiled
    # flex_attention on CPU (torch 2.13) miscomputes some lengths such as 8 or 24 whatever the mask.
    input_ids = torch.zeros(2, 16, dtype=torch.long, device=device)
    input_ids[0] = torch.cat(documents[:2])
    input_ids[1, :11] = documents[2]
    attention_mask = torch.tensor([[1] * 9 + [2] * 7, [1] * 11 + [0] * 5], device=device)
    position_ids = torch.tensor([[*range(9), *range(7)], [*range(11), *[0] * 5]], device=device)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model, input_ids, attention_mask, position_ids)
            alone = [_logits(model, document[None]) for document in documents]
    finally:
        model.train(was_training)
    packed_documents = [packed[0, :9], packed[0, 9:], packed[1, :11]]
    difference = max((p - a[0]).abs().max().item() for p, a in zip(packed_documents, alone))
    if not difference <= atol:
        raise ContaminationError(
            f"Packed documents differ from the same documents run alone by {difference:.3g} (atol {atol:g}) for "
            f"model_type {model.config.model_type!r} on attention backend "
            f"{getattr(model.config, '_attn_implementation', None)!r}: documents attend across boundaries. Call "
            "`configure_packing(model)` before training on packed batches, or train unpacked."
        )
    return difference


def _random_documents(config, lengths, seed, device) -> list[torch.Tensor]:
    vocab_size = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    # Skip the lowest ids, where special tokens (pad, bos, eos, image placeholders) usually live.
    low, high = min(10, vocab_size - 1), vocab_size
    return [torch.randint(low, high, (n,), generator=generator).to(device) for n in lengths]


def _logits(model, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return output.logits.float()
