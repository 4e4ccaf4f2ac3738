"""`PackedRewardTrainer`: TRL's `RewardTrainer` with each batch of chosen and rejected sequences scored packed.

A reward model (a `*ForSequenceClassification` head with one label) scores each sequence at its last real token.
`RewardTrainer` runs it on a padded batch of `[chosen..., rejected...]` sequences; here the real tokens of the batch go
into one packed row ([`~llm_packing.batches.padded_forward.pack_padded_batch`]), the backbone runs once with every
sequence isolated by [`~llm_packing.configure_packing`], and the head scores each sequence at the token transformers
would
pick in the padded batch (the rightmost token that is not `pad_token_id`). The loss and metrics code is TRL's own.
"""

import functools

import torch
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from trl import RewardTrainer

from ..batches.padded_forward import PaddedToPacked, pack_padded_batch
from ..core.checks import check_bool
from ..errors import ContaminationError, PackingValueError, UnsupportedSetupError
from ..hook import registry
from ..hook.configure import is_packing_configured
from ..hook.verify import configure_and_verify


class PackedRewardTrainer(RewardTrainer):
    """
    TRL's [`~trl.RewardTrainer`] whose reward model scores each batch packed: the chosen and rejected sequences of a
    padded batch become the documents of one packed row, and each gets the score of its own last real token.

    Takes the same arguments as `RewardTrainer`. On top of it, [`~llm_packing.configure_packing`] is applied to the
    model (process-wide), its forward is replaced by [`pack_sequence_scores`], and
    [`~llm_packing.verify_packing`] checks its backbone, unless `verify_packing=False`. TRL drops pairs longer than
    `RewardConfig.max_length` before training, as it does unpacked.

    Args:
        verify_packing (`bool`, *optional*, defaults to `True`):
            Run [`~llm_packing.verify_packing`] on the model's backbone after configuring the hook.
        model, args, **kwargs:
            As for [`~trl.RewardTrainer`].
    """

    def __init__(self, model, args=None, *positional, verify_packing: bool = True, **kwargs):
        check_bool("verify_packing", verify_packing)
        super().__init__(model, args, *positional, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        scorer = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the head model
        pack_sequence_scores(scorer)
        # The backbone's hidden states are what the head scores: verified there.
        configure_and_verify(model, verify=verify_packing, checked=getattr(scorer, scorer.base_model_prefix),
                             compared="hidden states", autocast=self.accelerator.autocast)


def pack_sequence_scores(model, *, max_length: int | None = None):
    """
    Make a transformers sequence classification model (`LlamaForSequenceClassification`, ...) score every padded
    batch packed: `model(input_ids=..., attention_mask=...)` packs the real tokens of each row as one document, runs
    the backbone once, and returns the `(batch_size, num_labels)` logits of each row's scored token, the one the
    unpacked model scores (the rightmost token that is not `config.pad_token_id`). Idempotent.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            A sequence classification model whose head is `model.score` (transformers' decoder classifiers).
        max_length (`int`, *optional*):
            Tokens per packed row; `None` packs each batch into one row.

    [`~llm_packing.unconfigure_packing`] gives the model back its own forward.

    Raises (on each call): `ContaminationError` if [`~llm_packing.configure_packing`] is not in effect,
    `PackingValueError` for a row scored at a padding position or a mask the packed layout cannot reproduce,
    `UnsupportedSetupError` for inputs it does not handle (labels, embeddings, a cache).

    Example:
    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForSequenceClassification
    >>> from llm_packing import packing_configured
    >>> from llm_packing.trainers.reward import pack_sequence_scores
    >>> config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = LlamaForSequenceClassification(config).eval()
    >>> input_ids, attention_mask = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> padded = model(input_ids=input_ids, attention_mask=attention_mask).logits
    >>> with packing_configured(model):
    ...     packed = pack_sequence_scores(model)(input_ids=input_ids, attention_mask=attention_mask).logits
    >>> packed.shape, bool((packed - padded).abs().max() < 1e-5)
    (torch.Size([2, 1]), True)

    ```
    """
    if getattr(model.forward, "_packs_padded_batches", False):
        return model
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None)
    if not isinstance(backbone, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        raise UnsupportedSetupError(
            f"`model` ({type(model).__name__}) is not a transformers decoder sequence classifier (a backbone under "
            "`base_model_prefix` and a `score` head). Load the reward model with "
            "`AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)`."
        )
    original = model.forward

    @functools.wraps(original)
    def packed_scores(input_ids=None, attention_mask=None, use_cache=None, **kwargs):
        given = sorted(name for name, value in kwargs.items() if value is not None and name not in _IGNORED)
        if given or use_cache or input_ids is None or attention_mask is None:
            raise UnsupportedSetupError(
                f"A packed reward forward got inputs it cannot pack: {given or ''} use_cache={use_cache}, "
                f"input_ids={'given' if input_ids is not None else None}, "
                f"attention_mask={'given' if attention_mask is not None else None}. It takes `input_ids` and a 0/1 "
                "`attention_mask` of a padded batch, `use_cache=False`. Use TRL's own RewardTrainer for other inputs."
            )
        if not is_packing_configured():
            raise ContaminationError(
                "A packed reward forward ran without `configure_packing`: the packed sequences would attend to each "
                "other. Call `llm_packing.configure_packing(model)` first (PackedRewardTrainer does)."
            )
        packing = pack_padded_batch(input_ids, attention_mask, max_length=max_length)
        hidden = backbone(input_ids=packing.input_ids, attention_mask=packing.attention_mask,
                          position_ids=packing.position_ids, use_cache=False).last_hidden_state
        scored = _packed_index_of_scored_tokens(packing, input_ids, attention_mask, model.config)
        return SequenceClassifierOutputWithPast(logits=head(hidden.flatten(0, 1).index_select(0, scored)))

    packed_scores._packs_padded_batches = True
    with registry.lock:  # undone by `unconfigure_packing`, which leaves an ordinary model behind
        registry.replace_attribute(model, "forward", packed_scores, configures=False)
    return model


# Keywords the model forward ignores: `margin` is a column of TRL's preference batches (RewardTrainer passes the whole
# batch to the model and reads the margin in its loss).
_IGNORED = ("return_dict", "margin")


def _packed_index_of_scored_tokens(packing: PaddedToPacked, input_ids, attention_mask, config) -> torch.Tensor:
    """Flat index in the packed batch of the token the padded classifier scores in each row: transformers' rule, the
    rightmost token that is not `pad_token_id` (the last column without one)."""
    batch_size, length = input_ids.shape
    pad_token_id = config.get_text_config().pad_token_id
    if pad_token_id is None:
        scored = torch.full((batch_size,), length - 1, device=input_ids.device)
    else:
        columns = torch.arange(length, device=input_ids.device)
        scored = (columns * (input_ids != pad_token_id)).argmax(-1)
    packed_of_padded = torch.full((batch_size * length,), -1, dtype=torch.long, device=input_ids.device)
    packed_of_padded[packing.padded_index] = packing.packed_index
    packed = packed_of_padded[torch.arange(batch_size, device=input_ids.device) * length + scored]
    if bool((packed < 0).any()):
        row = int((packed < 0).nonzero()[0])
        raise PackingValueError(
            f"Row {row} of the reward batch is scored at column {int(scored[row])}, a padding position "
            f"(`attention_mask` {attention_mask[row].tolist()[:32]}, pad_token_id {pad_token_id}): the packed batch "
            "has no hidden state there. Set `model.config.pad_token_id` to the tokenizer's pad token id and pad "
            "with it, as TRL's RewardTrainer does."
        )
    return packed
