"""What every training entry point does first (`llm_packing.train` for SFT, `llm_packing.cli.train_preference` for DPO
and GRPO): set up the package's logging and load the model a recipe names."""

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..demo.pretrained import BUNDLED_MODEL_NAME, load_bundled_model


def setup_logging(training_args) -> None:
    """The `llm_packing` logger to stderr, at INFO on rank 0 and ERROR on the other ranks."""
    package_logger = logging.getLogger("llm_packing")
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    # Every rank does the same work: one of them tells it. The others speak up only for errors.
    package_logger.setLevel(logging.INFO if training_args.process_index == 0 else logging.ERROR)


def load_model(script_args, model_args, training_args, tokenizer):
    """`model_name_or_path` loaded, or a randomly initialised model built from `model_config`."""
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    if model_args.model_name_or_path == BUNDLED_MODEL_NAME:
        model = load_bundled_model(dtype=torch.float32 if dtype == "auto" else dtype,
                                   attn_implementation=model_args.attn_implementation)
    elif script_args.model_config is None:
        kwargs = dict(revision=model_args.model_revision, dtype=dtype,
                      trust_remote_code=training_args.trust_remote_code,
                      attn_implementation=model_args.attn_implementation, **(training_args.model_init_kwargs or {}))
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
    else:
        block = dict(script_args.model_config)
        block.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            block.setdefault(name, getattr(tokenizer, name))
        config = AutoConfig.for_model(block.pop("model_type", "llama"), **block)
        model = AutoModelForCausalLM.from_config(config, dtype=None if dtype == "auto" else dtype,
                                                 attn_implementation=model_args.attn_implementation)
    # With a cache, transformers stops detecting packed documents from `position_ids`; training needs none.
    model.config.use_cache = False
    return model
