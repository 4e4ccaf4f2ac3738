"""A behavioural check that packing isolates documents in a given model: patches existing is not proof.

`verify_packing` runs a tiny packed batch (two rows, six documents, a long one followed by short ones, trailing
padding) and each document alone through the model, and compares the logits of every real token. The limit is
calibrated on the model's own floating-point noise in its dtype, measured by one more forward that needs no isolation
at all (`hook.verify_limits`). Cost: eight forwards of at most 6 x 16 tokens. Given the processor of an image-text
model, it also packs a document with two images between two text documents (`hook.media.verify_images`).
`measure_packing` is the same comparison on any layout of packed rows, and can compare the gradients of a per-document
loss too (`llm-packing verify` runs it).
"""

import contextlib
import logging
import threading
import weakref
from collections.abc import Sequence

import torch

from ..core.checks import check_integer
from ..errors import ContaminationError, PackingTypeError, PackingValueError
from . import guards, rotary
from .autocast import computed_dtype
from .media.image_text import causal_through_token_types
from .media.verify_images import image_row_difference, includes_video
from .verify_limits import PackingMeasurement, compare


logger = logging.getLogger(__name__)


COLUMNS = 16
# `verify_packing`'s rows: [9, 1, 2, 4] and [11, 3, 2 pads]. A long document followed by short ones carries the most
# state into its neighbours' first tokens, where a leaking mixer shows most, and four of the six documents follow
# another: on the injected leaks of `benchmarks/verify_leaks.py` the differences are 1 to 2 times those of the earlier
# rows [9, 7], [11, 5 pads]. The noise floor, a maximum over more documents, can rise too: SmolLM2-135M unconfigured in
# bfloat16 exceeds its limit 2.4-10.9 times on sdpa seeds 0-7 but 4 and 7, whose floor of 24-26 logits (one unstable
# token) hides it, and 7.8-14.3 times on eager (benchmarks/results/verify_noise_floor.md). 16
# columns, because compiled flex_attention on CPU (torch 2.13) miscomputes some lengths such as 8 or 24 whatever the
# mask.
ROWS = ((9, 1, 2, 4), (11, 3))
# The text documents around the image document of `verify_packing(model, processor=...)`.
IMAGE_ROW_TEXT_LENGTHS = (9, 7)


def verify_packing(model, *, atol: float | None = None, seed: int = 0, processor=None) -> float:
    """
    Check that a packed batch gives the same logits as its documents run one by one.

    Attention kernels (sdpa) round differently for different sequence lengths, so a document's logits change when
    anything follows it, even under plain causal attention where nothing can leak into it. On SmolLM2-135M with sdpa
    (logits up to 35) that noise is 7e-5 to 7e-4 in float32, 0.09-0.38 in float16 and 0.7-2.5 in bfloat16, 24-26 on
    two of eight seeds (`benchmarks/verify_noise_floor.py`). It is measured on the spot: each document is run followed
    by unrelated tokens, plain causal attention and no packing, and compared with the document alone. The packed
    logits may then differ from the alone ones by `max(base, NOISE_MARGIN * floor)` (`NOISE_MARGIN` is 3), the base
    being `1e-6` (float32/float64) or `2**-6` (float16/bfloat16) times the largest logit alone (`hook.verify_limits`).
    Contamination is far above that: documents that attend to their neighbour differ by 13 to 34 logits on
    SmolLM2-135M in every dtype. Small leaks are caught too: a fraction `eps` of a document's state carried into the
    next one is caught in float32 from `eps` = 1e-5 (attention, SmolLM2-135M) and, on tiny models, wherever the parity
    matrix's 1e-5 catches it (`benchmarks/results/verify_leaks.md`).

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A causal LM (or a base model, whose last hidden states are compared), usually after
            [`configure_packing`]. It is put in eval mode for the check and restored.
        atol (`float`, *optional*):
            Largest accepted absolute logit difference, used as given instead of the calibrated limit.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the random token ids.
        processor ([`~transformers.ProcessorMixin`], *optional*):
            The image-text model's own processor. If given, a packed row also holds a document with two images of
            different shapes between two text documents (placeholders, pixels and grids as the processor makes
            them), checked against the same limit; for a type that packs videos whose processor has a video
            processor, that document holds a video too. Without it only text documents are checked.

    Returns:
        `float`: the largest absolute logit difference found.

    Raises:
        `ContaminationError`: the difference exceeds the limit, i.e. documents attend across their boundaries.

    Cost: eight forwards: the packed batch (2 x 16 tokens), the six documents alone, and the noise floor (6 x 16);
    with a `processor`, four more: the row with images, the image document and the two text documents alone.
    """
    logits = measure_packing(model, atol=atol, seed=seed).logits
    difference = logits.difference
    if processor is not None:
        difference = max(difference, _image_row_difference(model, processor, seed))
    if not difference <= logits.limit:
        raise ContaminationError(
            f"Packed documents differ from the same documents run alone by {difference:.3g} "
            f"({logits.explained}) for model_type {model.config.model_type!r} on attention backend "
            f"{getattr(model.config, '_attn_implementation', None)!r}: documents attend across boundaries. Call "
            "`configure_packing(model)` before training on packed batches, or train unpacked."
        )
    return difference


def _image_row_difference(model, processor, seed: int) -> float:
    """`hook.media.verify_images`' check, with two text documents around the image document."""
    device = next(model.parameters()).device
    texts = _random_documents(model.config, IMAGE_ROW_TEXT_LENGTHS, seed, device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [_model_logits(model, **_inputs(model, text[None])) for text in texts]
            return image_row_difference(model, processor, texts, [logits[0] for logits in alone], seed,
                                        _model_logits)
    finally:
        model.train(was_training)


def measure_packing(model, rows: Sequence[Sequence[int]] = ROWS, columns: int = COLUMNS, *, gradients: bool = False,
                    atol: float | None = None, seed: int = 0) -> PackingMeasurement:
    """
    Run packed rows of random documents and each document alone through `model`; compare their logits and, with
    `gradients`, the gradients of a per-document loss. Raises nothing on a difference: see `.exact`.

    The loss of a document is the mean cross-entropy of its logits against its own next tokens (its first token
    after its last), or the mean square of a base model's hidden states; the packed side sums every document's loss
    in one backward, the alone side sums the gradients of each document's own backward. Gradients are compared
    relative to the largest alone gradient entry, over every parameter that requires a gradient. Both limits are
    calibrated as in [`verify_packing`], the gradients' on the same noise-floor rows.

    Args:
        model ([`~transformers.PreTrainedModel`]): As in [`verify_packing`].
        rows (`Sequence[Sequence[int]]`, *optional*, defaults to `((9, 1, 2, 4), (11, 3))`):
            Document lengths per packed row, e.g. `[[93, 1, 32, 1], [128]]`; each row's documents are followed by
            padding up to `columns`.
        columns (`int`, *optional*, defaults to `16`): Tokens per packed row.
        gradients (`bool`, *optional*, defaults to `False`): Compare gradients too (a backward per forward).
        atol (`float`, *optional*): Limit for both comparisons instead of the calibrated ones.
        seed (`int`, *optional*, defaults to `0`): Seed of the random token ids.

    Returns:
        [`PackingMeasurement`]

    Example:
    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from llm_packing import packing_configured
    >>> from llm_packing.hook.verify import measure_packing
    >>> _ = torch.manual_seed(0)
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=1, num_attention_heads=2))
    >>> with packing_configured(model):
    ...     measured = measure_packing(model, [[5, 1, 7], [16]], 16, gradients=True)
    >>> measured.exact, measured.gradients.limit
    (True, 1e-05)
    >>> measured.logits.explained  # the base: 1e-6 of the largest logit alone; the noise floor here is below it
    'limit 3.3e-07 = max(1e-06 x the largest alone |logit| 0.33, 3 x the noise floor 5.96e-08 of float32)'
    >>> measure_packing(model, [[5, 1, 7], [16]], 16).exact  # unconfigured: the documents attend to each other
    False

    ```
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise PackingTypeError(
            f"`model` must be a transformers model (a torch.nn.Module with a `config`), got {type(model).__name__}. "
            "Pass the model itself, e.g. `verify_packing(model)`, not its config."
        )
    if atol is not None and (isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0):
        raise PackingValueError(f"`atol` must be a non-negative number or None (calibrated), got {atol!r}.")
    check_integer("columns", columns, minimum=1)
    _check_rows(rows, columns)
    parameter = next(model.parameters())
    if gradients and not any(p.requires_grad for p in model.parameters()):
        raise PackingValueError(f"`gradients=True` needs parameters that require gradients; every parameter of "
                                f"{type(model).__name__} is frozen. Unfreeze some, or pass `gradients=False`.")
    documents = _random_documents(model.config, [n for row in rows for n in row], seed, parameter.device)
    packed_run = _packed_run(documents, rows, columns, parameter.device)
    alone_runs = [(document[None], None, None, {k: (0, 0)}) for k, document in enumerate(documents)]
    followed_runs = _followed_runs(model.config, noise_floor_rows(documents, columns), documents)

    with _one_check_at_a_time(model):  # threads checking one model: each restores the mode it found, no mixed grads
        was_training = model.training
        model.eval()
        try:
            with guards.unpacked_forwards():
                alone, alone_gradients = _through(model, alone_runs, documents, gradients)
                packed, packed_gradients = _through(model, [packed_run], documents, gradients)
                followed, followed_gradients = (_through(model, followed_runs, documents, gradients)
                                                if atol is None else (None, None))
        finally:
            model.train(was_training)
    dtype = computed_dtype(parameter)  # under autocast, the limits of its half precision
    logits = compare("logits", packed, followed, alone, atol, dtype=dtype)
    if not gradients:
        return PackingMeasurement(logits)
    scale = max(gradient.abs().max().item() for gradient in alone_gradients) or 1.0
    relative = [[gradient / scale for gradient in side] if side is not None else None
                for side in (packed_gradients, followed_gradients, alone_gradients)]
    return PackingMeasurement(logits, compare("gradients", *relative, atol, dtype=dtype))


_checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the lock its checks take
_checks_lock = threading.Lock()


def _one_check_at_a_time(model: torch.nn.Module) -> threading.Lock:
    """The lock of `model`'s checks: two threads checking it at once left it in eval mode (the second saved the mode
    the first had set)."""
    with _checks_lock:
        return _checks.setdefault(model, threading.Lock())


def noise_floor_rows(documents: list[torch.Tensor], columns: int) -> torch.Tensor:
    """The rows the noise floor is measured on, one per document: the document first, then the other documents'
    tokens (repeated where they are fewer than `columns`), no mask: nothing can reach the document, so its logits
    differ from it alone only by the kernels' rounding."""
    repeats = -(-columns // sum(map(len, documents)))
    return torch.stack([torch.cat(documents[k:] + documents[:k]).repeat(repeats)[:columns]
                        for k in range(len(documents))])


def _followed_runs(config, followed_ids: torch.Tensor, documents) -> list[tuple]:
    """The noise floor rows as forwards: one batch of them, except where the rope's frequencies follow the sequence
    length (`longrope`, `dynamic`). There each row is its own forward whose positions run 0 to its document's length
    and start again, so that the document is rotated for its own length, as alone, with or without the rotary patch:
    transformers rotates a batch for its largest position, so over whole rows the floor would grow by the very
    difference the patch removes, and `verify` would not see the patch undone."""
    if not rotary.length_dependent_rope_types(config):
        return [(followed_ids, None, None, {k: (k, 0) for k in range(len(documents))})]
    row = torch.arange(followed_ids.shape[1], device=followed_ids.device)
    return [(ids[None], None, (row % len(document))[None], {k: (0, 0)})
            for k, (ids, document) in enumerate(zip(followed_ids, documents, strict=True))]


def _check_rows(rows, columns: int) -> None:
    for row in rows:
        if not row or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in row) or sum(row) > columns:
            raise PackingValueError(
                f"`rows` must hold, per row, positive document lengths summing to at most `columns` ({columns}), got "
                f"row {list(row)!r}. Shorten the documents, or raise `columns`."
            )


def _packed_run(documents, rows, columns: int, device):
    """The packed batch: indexed mask `[1, 1, 2, 0]` per row, positions restarting per document, pad id 0."""
    input_ids = torch.zeros(len(rows), columns, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    position_ids = torch.zeros_like(input_ids)
    spans, k = {}, 0
    for r, lengths in enumerate(rows):
        start = 0
        for index, length in enumerate(lengths, start=1):
            input_ids[r, start : start + length] = documents[k]
            attention_mask[r, start : start + length] = index
            position_ids[r, start : start + length] = torch.arange(length, device=device)
            spans[k] = (r, start)
            k, start = k + 1, start + length
    return input_ids, attention_mask, position_ids, spans


def _through(model, runs, documents, gradients: bool):
    """Each document's logits in `runs` (forwards of `(input_ids, attention_mask, position_ids, {document: (row,
    start)})`); with `gradients`, also the float32 sum over the forwards of the gradients of their documents'
    losses."""
    parameters = [p for p in model.parameters() if p.requires_grad] if gradients else []
    total = [torch.zeros_like(p, dtype=torch.float32) for p in parameters] if gradients else None
    pieces = {}
    for input_ids, attention_mask, position_ids, spans in runs:
        with torch.set_grad_enabled(gradients):
            output, is_logits = _forward(model, input_ids, attention_mask, position_ids)
            run_pieces = {k: output[row, start : start + len(documents[k])] for k, (row, start) in spans.items()}
            if total:
                loss = sum(_document_loss(piece, documents[k], is_logits) for k, piece in run_pieces.items())
                for sum_, gradient in zip(total, torch.autograd.grad(loss, parameters, allow_unused=True),
                                          strict=True):
                    if gradient is not None:
                        sum_ += gradient
        pieces.update({k: piece.detach() for k, piece in run_pieces.items()})
    return [pieces[k] for k in range(len(documents))], total


def _document_loss(output: torch.Tensor, document: torch.Tensor, is_logits: bool) -> torch.Tensor:
    if not is_logits:
        return output.pow(2).mean()
    return torch.nn.functional.cross_entropy(output, document.roll(-1))


def _random_documents(config, lengths, seed, device) -> list[torch.Tensor]:
    vocab_size = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    # Skip the lowest ids, where special tokens (pad, bos, eos) usually live, and every token id the config names
    # (an image placeholder in a text document would be an image without pixels).
    low = min(10, vocab_size - 1)
    allowed = torch.arange(low, vocab_size)
    allowed = allowed[~torch.isin(allowed, torch.tensor(sorted(_named_token_ids(config)), dtype=torch.long))]
    return [allowed[torch.randint(0, len(allowed), (n,), generator=generator)].to(device) for n in lengths]


def _named_token_ids(config) -> set[int]:
    """The token ids a config (and its text config) names: `*_token_id`, `*_token_index`."""
    named = set()
    for part in (config, getattr(config, "text_config", None)):
        for name, value in (vars(part) if part is not None else {}).items():
            if name.endswith(("_token_id", "_token_index")) and isinstance(value, int):
                named.add(value)
    return named


def _inputs(model, input_ids, attention_mask=None, position_ids=None) -> dict:
    """A text batch's inputs; PaliGemma's text is causal only through `token_type_ids`: text documents are suffix
    (1)."""
    token_types = {"token_type_ids": torch.ones_like(input_ids)} if causal_through_token_types(model.config) else {}
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, **token_types}


def _forward(model, input_ids, attention_mask=None, position_ids=None) -> tuple[torch.Tensor, bool]:
    """The model's float logits (and True), or a base model's (a reward model's backbone) last hidden states."""
    output = model(**_inputs(model, input_ids, attention_mask, position_ids), use_cache=False)
    logits = getattr(output, "logits", None)
    return (output.last_hidden_state if logits is None else logits).float(), logits is not None


def _model_logits(model, **inputs) -> torch.Tensor:
    """The model's float logits on `inputs`, or a base model's last hidden states."""
    output = model(**inputs, use_cache=False)
    logits = getattr(output, "logits", None)
    return (output.last_hidden_state if logits is None else logits).float()


def configure_and_verify(
    models, *, verify: bool = True, checked=None, compared: str = "logits", where: str = "", processor=None,
    autocast=contextlib.nullcontext,
) -> float | None:
    """
    What every packed trainer does to its models before the first step: [`~llm_packing.configure_packing`] on each,
    then [`verify_packing`] on `checked` (default: the first model; a base model's `compared` outputs are its hidden
    states; with an image-text model's `processor`, a row with images too) within `autocast()` (the trainer's
    `accelerator.autocast`: with `bf16=True` the check runs the kernels training runs, as the varlen route takes
    torch's FlashAttention op on CUDA under autocast), logging the outcome (`where` prefixes the line, e.g.
    `"[rank 0/2] "`).

    Returns the difference `verify_packing` measured, or `None` when `verify` is off.
    """
    from .configure import configure_packing

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    for model in models:
        configure_packing(model)
    if not verify:
        logger.info("%sisolation not verified (`verify_packing` off)", where)
        return None
    model = models[0] if checked is None else checked
    if any(hasattr(parameter, "ds_id") for parameter in model.parameters()):
        # DeepSpeed ZeRO-3 built the model partitioned (`zero.Init`): before its engine exists, a forward sees 1-D
        # shards ("'weight' must be 2-D"), and gathering every parameter on every rank would cost a whole model each.
        logger.warning(
            "%sisolation not verified: the model's parameters are partitioned by DeepSpeed ZeRO-3. The hook is "
            "configured; prove this model and backend with `llm-packing verify --model ...` on one device (ZeRO-3 "
            "itself is proven with packing in tests/test_zero3.py).", where
        )
        return None
    with autocast():
        difference = verify_packing(model, processor=processor)
    images = ""
    if processor is not None:
        video = includes_video(model.config.model_type, processor)
        images = f" (documents with images{' and a video' if video else ''} included)"
    logger.info("%sisolation verified%s: packed %s equal per-document %s (max abs diff %.2g)", where, images, compared,
                compared, difference)
    return difference
