"""The `trainer: dpo` and `trainer: grpo` flows of `python -m llm_packing.train`: TRL's trainers, forwards packed.

A recipe with `trainer: dpo` (or `grpo`) takes TRL's `DPOConfig` (`GRPOConfig`) keys instead of `SFTConfig`'s. Data:
`dataset_name: chitchat` gives the preference pairs of [`~llm_packing.demo.chitchat.load_chitchat_preference_pairs`]
(the real reply chosen, another conversation's reply rejected), and for GRPO their prompts; any other dataset needs
TRL's `prompt`/`chosen`/`rejected` (`prompt`) columns. The model trains with
[`~llm_packing.trainers.dpo.PackedDPOTrainer`] or [`~llm_packing.trainers.grpo.PackedGRPOTrainer`], which configure and
verify the hook. GRPO's reward is [`reply_length_reward`], which runs offline.
"""

import copy
import logging
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import set_seed
from trl import DPOConfig, GRPOConfig, get_peft_config

from ..demo.chitchat import DEMO_DATASET_NAME, load_chitchat_preference_pairs
from ..errors import PackingValueError
from ..hook.configure import unconfigure_packing
from .documents import load_documents, load_tokenizer
from .startup import load_model, setup_logging


logger = logging.getLogger("llm_packing.train")

@dataclass
class PackedDPOConfig(DPOConfig):
    """TRL's `DPOConfig` minus `padding_free`, which [`~llm_packing.cli.arguments.PackingArguments`] owns (TRL 1.16
    forces it off for DPO anyway; the packed forward removes the padding)."""

    padding_free: bool = field(default=False, init=False)


# `trainer` recipe key -> TRL config dataclass whose keys the recipe takes.
TRAINING_CONFIGS = {"dpo": PackedDPOConfig, "grpo": GRPOConfig}
REPLY_WORDS = 12


def reply_length_reward(completions, **kwargs) -> list[float]:
    """
    GRPO reward of the demo recipe: 0 for a reply of `REPLY_WORDS` words, down to -1 and below as it strays.

    Example:
    ```python
    >>> reply_length_reward([[{"role": "assistant", "content": "hi"}], "one two three four five six"])
    [-0.9166666666666666, -0.5]

    ```
    """
    texts = [completion[-1]["content"] if isinstance(completion, list) else completion for completion in completions]
    return [-abs(len(text.split()) - REPLY_WORDS) / REPLY_WORDS for text in texts]


def train_preference(script_args, training_args, model_args, packing_args):
    """Train with `PackedDPOTrainer` or `PackedGRPOTrainer` as the parsed recipe says; returns the `TrainOutput`."""
    from ..trainers.dpo import PackedDPOTrainer
    from ..trainers.grpo import PackedGRPOTrainer

    if not packing_args.block_diag_attn or packing_args.padding_free:
        raise PackingValueError(
            f"`trainer: {script_args.trainer}` always packs its forwards with the indexed mask; got `block_diag_attn: "
            f"{packing_args.block_diag_attn}`, `padding_free: {packing_args.padding_free}`. Remove both keys, or "
            f"train unpacked with TRL's own `trl {script_args.trainer}` command."
        )
    if packing_args.packing_engine != "local":
        raise PackingValueError(
            f"`packing_engine: {packing_args.packing_engine}` packs the documents of `trainer: sft`; "
            f"`trainer: {script_args.trainer}` packs its pairs batch by batch. Remove `packing_engine`."
        )
    setup_logging(training_args)
    set_seed(training_args.seed)
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path or model_args.model_name_or_path,
                               revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code)
    model = load_model(script_args, model_args, training_args, tokenizer)
    if script_args.dataset_name == DEMO_DATASET_NAME:
        pairs = Dataset.from_list(load_chitchat_preference_pairs(script_args.max_samples))
    else:
        pairs = load_documents(script_args.dataset_name, config=script_args.dataset_config,
                               split=script_args.dataset_train_split, max_samples=script_args.max_samples)
    peft_config = get_peft_config(model_args)
    common = {"args": training_args, "train_dataset": pairs, "processing_class": tokenizer,
              "peft_config": peft_config, "verify_packing": packing_args.verify_packing}
    try:
        if script_args.trainer == "grpo":
            pairs = pairs.select_columns(["prompt"])
            logger.info("GRPO on %d prompts; attention backend %r; log-prob forwards packed, one row per batch",
                        len(pairs), model.config._attn_implementation)
            trainer = PackedGRPOTrainer(model, reply_length_reward, **{**common, "train_dataset": pairs})
        else:
            # PEFT's reference is the model with its adapter disabled; a full fine-tune needs a frozen copy.
            precomputed = training_args.precompute_ref_log_probs
            ref_model = None if peft_config is not None or precomputed else copy.deepcopy(model)
            logger.info("DPO on %d preference pairs; attention backend %r; forwards packed into rows of %s tokens",
                        len(pairs), model.config._attn_implementation, training_args.max_length)
            trainer = PackedDPOTrainer(model, ref_model, **common)
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
    finally:
        unconfigure_packing()
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        last = f"last logged loss {logged[-1]['loss']:.4f}" if logged else "no loss logged"
        logger.info("trained %d optimizer steps; %s; mean loss over the run %.4f; model saved to %s",
                    trainer.state.global_step, last, result.training_loss, training_args.output_dir)
    return result
