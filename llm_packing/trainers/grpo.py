"""`PackedGRPOTrainer`: TRL's `GRPOTrainer` whose log-prob forwards of prompt + completion batches run packed.

GRPO scores every completion with the policy (and the old and reference policies) on a batch padded on both sides:
prompts on the left, completions on the right, and rollout lengths vary wildly. Generation stays TRL's own; the
per-token log-prob forwards (`_get_per_token_logps_and_entropies`, through TRL's fused LM head) pack the real tokens
of each row ([`~llm_packing.batches.padded_forward.pack_fused_lm_head`]), so the loss code sees TRL's padded layout
unchanged. """

from trl import GRPOTrainer

from ..batches.padded_forward import pack_trainer_models
from ..core.checks import check_bool


class PackedGRPOTrainer(GRPOTrainer):
    """
    TRL's [`~trl.GRPOTrainer`] with its log-prob forwards packed: each batch of prompt + completion rows (left- and
    right-padded) runs as one packed row, each sequence isolated by [`~llm_packing.configure_packing`], and the
    per-token log-probs and entropies come back in TRL's padded layout.

    Takes the same arguments as `GRPOTrainer`. On top of it, [`~llm_packing.configure_packing`] is applied to the
    policy and the reference model (process-wide) and [`~llm_packing.verify_packing`] checks the policy, unless
    `verify_packing=False`. Generation (transformers' `generate` or vLLM) is untouched. Inputs the packed forward does
    not handle (images, MoE router logits, context parallelism) raise an
    [`~llm_packing.errors.UnsupportedSetupError`] at the first step.

    Args:
        verify_packing (`bool`, *optional*, defaults to `True`):
            Run [`~llm_packing.verify_packing`] on the policy after configuring the hook.
        model, reward_funcs, args, **kwargs:
            As for [`~trl.GRPOTrainer`].
    """

    def __init__(self, model, reward_funcs, args=None, *positional, verify_packing: bool = True, **kwargs):
        check_bool("verify_packing", verify_packing)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        pack_trainer_models(self, max_length=None, verify=verify_packing)
