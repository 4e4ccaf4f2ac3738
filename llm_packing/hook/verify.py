"""A behavioural check that packing isolates documents in a given model: patches existing is not proof.

`verify_packing` runs a tiny packed batch (two rows, three documents, trailing padding) and each document alone through
the model, and compares the logits of every real token. The limit is calibrated on the model's own floating-point
noise in its dtype, measured by one more forward that needs no isolation at all (see `verify_packing`). Cost: five
forwards of at most 3 x 16 tokens.
"""

import logging

import torch

from ..errors import ContaminationError, PackingTypeError, PackingValueError


logger = logging.getLogger(__name__)


# Limits when the model computes each document alone and in a batch identically (float32 on tiny models, eager).
BASE_ATOL = {torch.float32: 1e-4, torch.float64: 1e-4}
HALF_BASE_ATOL = 5e-2
# Packed logits may differ from the alone ones by this many times the noise floor. On SmolLM2-135M (CPU, sdpa, seeds
# 0-7, benchmarks/verify_noise_floor.py) the configured model differs by up to 1.5 times the floor (bfloat16 seed 3),
# while the unconfigured one differs by 12 to 56 times it in bfloat16 and by over 70 times in float16 and float32.
# 3 keeps a 2x headroom against false alarms and still catches that leak by 3.9x or more.
NOISE_MARGIN = 3.0
LENGTHS = (9, 7, 11)
COLUMNS = 16


def verify_packing(model, *, atol: float | None = None, seed: int = 0) -> float:
    """
    Check that a packed batch gives the same logits as its documents run one by one.

    Attention kernels (sdpa) round differently for different sequence lengths, so a document's logits change when
    anything follows it, even under plain causal attention where nothing can leak into it. On SmolLM2-135M with sdpa
    (logits up to 35) that noise is 8e-5 in float32, 0.08-0.23 in float16 and 0.47-2.1 in bfloat16 (seeds 0-7 of
    `benchmarks/verify_noise_floor.py`). It is measured on the spot: each document is run followed by unrelated
    tokens, plain causal attention and no packing, and compared with the document alone. The packed logits may then
    differ from the alone ones by `max(base, NOISE_MARGIN * floor)` (`NOISE_MARGIN` is 3), the base being `1e-4` for
    float32/float64 weights and `5e-2` for float16/bfloat16. Contamination is far above that: documents that attend
    to their neighbour differ by 13 to 34 logits on SmolLM2-135M in every dtype, and by 0.3 to 0.6 on tiny random
    models, whose floor is near zero.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A causal LM (or a base model, whose last hidden states are compared), usually after
            [`configure_packing`]. It is put in eval mode for the check and restored.
        atol (`float`, *optional*):
            Largest accepted absolute logit difference, used as given instead of the calibrated limit.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the random token ids.

    Returns:
        `float`: the largest absolute logit difference found.

    Raises:
        `ContaminationError`: the difference exceeds the limit, i.e. documents attend across their boundaries.

    Cost: five forwards: the packed batch (2 x 16 tokens), the three documents alone, and the noise floor (3 x 16).
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise PackingTypeError(
            f"`model` must be a transformers model (a torch.nn.Module with a `config`), got {type(model).__name__}. "
            "Pass the model itself, e.g. `verify_packing(model)`, not its config."
        )
    if atol is not None and (isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0):
        raise PackingValueError(f"`atol` must be a non-negative number or None (calibrated), got {atol!r}.")
    parameter = next(model.parameters())
    device = parameter.device
    documents = _random_documents(model.config, LENGTHS, seed, device)
    # Rows: [doc 1, doc 2] and [doc 3, 5 pads]; positions restart per document. 16 columns, because compiled
    # flex_attention on CPU (torch 2.13) miscomputes some lengths such as 8 or 24 whatever the mask.
    input_ids = torch.zeros(2, COLUMNS, dtype=torch.long, device=device)
    input_ids[0] = torch.cat(documents[:2])
    input_ids[1, :11] = documents[2]
    attention_mask = torch.tensor([[1] * 9 + [2] * 7, [1] * 11 + [0] * 5], device=device)
    position_ids = torch.tensor([[*range(9), *range(7)], [*range(11), *[0] * 5]], device=device)
    # Noise floor rows: each document first, the others' tokens after it, no mask: nothing can reach the document.
    followed_ids = torch.stack([torch.cat(documents[k:] + documents[:k])[:COLUMNS] for k in range(len(documents))])

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model, input_ids, attention_mask, position_ids)
            alone = [_logits(model, document[None])[0] for document in documents]
            followed = _logits(model, followed_ids) if atol is None else None
    finally:
        model.train(was_training)
    packed_documents = [packed[0, :9], packed[0, 9:], packed[1, :11]]
    difference = max((p - a).abs().max().item() for p, a in zip(packed_documents, alone, strict=True))
    if atol is None:
        floor = max((followed[k, : len(a)] - a).abs().max().item() for k, a in enumerate(alone))
        base = BASE_ATOL.get(parameter.dtype, HALF_BASE_ATOL)
        limit = max(base, NOISE_MARGIN * floor)
        explained = (f"limit {limit:.3g} = max({base:g}, {NOISE_MARGIN:g} x the noise floor {floor:.3g} of "
                     f"{str(parameter.dtype).removeprefix('torch.')})")
    else:
        limit, explained = atol, f"atol {atol:g}"
    if not difference <= limit:
        raise ContaminationError(
            f"Packed documents differ from the same documents run alone by {difference:.3g} ({explained}) for "
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
    """The model's logits, or a base model's (a reward model's backbone) last hidden states."""
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logits = getattr(output, "logits", None)
    return (output.last_hidden_state if logits is None else logits).float()


def configure_and_verify(
    models, *, verify: bool = True, checked=None, compared: str = "logits", where: str = ""
) -> float | None:
    """
    What every packed trainer does to its models before the first step: [`~llm_packing.configure_packing`] on each,
    then [`verify_packing`] on `checked` (default: the first model; a base model's `compared` outputs are its hidden
    states), logging the outcome (`where` prefixes the line, e.g. `"[rank 0/2] "`).

    Returns the difference `verify_packing` measured, or `None` when `verify` is off.
    """
    from .configure import configure_packing

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    for model in models:
        configure_packing(model)
    if not verify:
        logger.info("%sisolation not verified (`verify_packing` off)", where)
        return None
    difference = verify_packing(models[0] if checked is None else checked)
    logger.info("%sisolation verified: packed %s equal per-document %s (max abs diff %.2g)", where, compared, compared,
                difference)
    return difference
