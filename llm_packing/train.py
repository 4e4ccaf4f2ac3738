"""Training entry point: a flat YAML recipe in, a fine-tuned model out, documents packed without contamination.

    python -m llm_packing.train --config recipes/tiny-cpu.yaml
    accelerate launch -m llm_packing.train --config recipes/tiny-cpu.yaml
    llm-packing train --config recipes/tiny-cpu.yaml --max_steps 5

Each recipe key goes to the dataclass that has a field of that name: TRL's `SFTConfig` (training) and `ModelConfig`
(model, LoRA), our [`ScriptArguments`] (data, tiny model) and [`~llm_packing.config.PackingArguments`]. Flags on the
command line override the recipe. Flow: tokenizer and model, documents tokenized with the chat template (labels -100
outside assistant turns with `assistant_only_loss: true`), `pack_dataset`, `configure_packing` + `verify_packing`,
`DataCollatorWithPacking`, TRL's `SFTTrainer` (its own packing and dataset preparation off), train, save.
"""

import contextlib
import difflib
import json
import logging
import sys
from dataclasses import dataclass, field

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, set_seed
from trl import ModelConfig, SFTConfig, SFTTrainer, TrlParser, get_peft_config

from .collator import DataCollatorWithPacking
from .config import PackingArguments
from .dataset import pack_dataset
from .documents import load_documents, load_tokenizer, tokenize_documents
from .errors import PackingValueError, UnsupportedSetupError
from .patch import packing_configured
from .verify import verify_packing


logger = logging.getLogger("llm_packing.train")  # not __name__, which is "__main__" under `python -m`


@dataclass
class PackedSFTConfig(SFTConfig):
    """
    TRL's `SFTConfig` minus the keys that [`~llm_packing.config.PackingArguments`] owns (`packing_strategy`,
    `padding_free`: same meaning, applied by `pack_dataset` and our collator). Here they stay off, as TRL would
    otherwise pack or flatten the batches itself and refuse our collator.
    """

    packing_strategy: str = field(default="bfd", init=False)
    padding_free: bool = field(default=False, init=False)


@dataclass
class ScriptArguments:
    """
    The data and, for recipes without a checkpoint, the randomly initialised model to build.

    Args:
        dataset_name (`str`, *optional*, defaults to `"chitchat"`):
            A hub dataset, a local `.json`/`.jsonl`/`.parquet`/`.csv` file or dataset folder, or `"chitchat"` (the
            built-in demo conversations, see [`~llm_packing.demo_data.load_chitchat_conversations`]).
        dataset_config (`str`, *optional*):
            Configuration name of a hub dataset.
        dataset_train_split (`str`, *optional*, defaults to `"train"`):
            Split to train on.
        dataset_messages_field (`str`, *optional*, defaults to `"messages"`):
            Column of chat messages, tokenized with the chat template. Without it, `dataset_text_field` (an
            `SFTConfig` key) is tokenized as plain text.
        max_samples (`int`, *optional*):
            Train on the first this many examples only.
        tokenizer_name_or_path (`str`, *optional*):
            Tokenizer to load; defaults to `model_name_or_path`. `"demo"` is Mistral-7B's tokenizer with an `[INST]`
            chat template, read from the `mistral-common` package.
        model_config (`dict` or `str`, *optional*):
            Build a randomly initialised model from this config (a mapping, or JSON on the command line) instead of
            loading `model_name_or_path`: `model_type` (default `"llama"`) and that config class's keys;
            `vocab_size` defaults to the tokenizer's.
    """

    dataset_name: str = field(
        default="chitchat",
        metadata={"help": "Hub dataset, local json/jsonl/parquet/csv file or folder, or 'chitchat' (built-in demo)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of a hub dataset."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_messages_field: str = field(
        default="messages", metadata={"help": "Column of chat messages, tokenized with the chat template."}
    )
    max_samples: int | None = field(default=None, metadata={"help": "Train on the first this many examples only."})
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer to load (defaults to model_name_or_path); 'demo' is the built-in Mistral one."},
    )
    model_config: dict | str | None = field(
        default=None,
        metadata={"help": "Config of a randomly initialised model (mapping in YAML, JSON on the command line)."},
    )

    def __post_init__(self):
        if isinstance(self.model_config, str):
            try:
                self.model_config = json.loads(self.model_config)
            except json.JSONDecodeError as error:
                raise PackingValueError(
                    f"`model_config` must be a mapping (JSON on the command line), got {self.model_config!r}: {error}."
                ) from None
        if self.model_config is not None and not isinstance(self.model_config, dict):
            raise PackingValueError(f"`model_config` must be a mapping of config keys, got {self.model_config!r}.")
        if self.max_samples is not None and self.max_samples < 1:
            raise PackingValueError(f"`max_samples` must be at least 1 or null, got {self.max_samples!r}.")


def make_parser():
    """The `TrlParser` for recipes: `ScriptArguments`, `PackedSFTConfig`, `ModelConfig`, `PackingArguments`."""
    # No abbreviated flags, so that a typo is reported rather than matched to some other option.
    return TrlParser((ScriptArguments, PackedSFTConfig, ModelConfig, PackingArguments), allow_abbrev=False)


def parse_args(argv: list[str] | None = None):
    """
    Parse `--config recipe.yaml` and command-line flags (which override the recipe) into the four dataclasses.

    Returns:
        `tuple`: `(ScriptArguments, SFTConfig, ModelConfig, PackingArguments)`.

    Raises:
        `PackingValueError`: a recipe key or flag that no dataclass has (naming the closest valid one), a recipe that
            is not a mapping, or a combination this entry point cannot train.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--config=path` as `--config path`, the only form TrlParser reads.
    argv = [part for token in argv for part in (token.split("=", 1) if token.startswith("--config=") else [token])]
    parser = make_parser()
    valid_keys = sorted({action.dest for action in parser._actions} - {"help"})
    path = _config_path(argv)
    if path is not None:
        with open(path, encoding="utf-8") as file:
            try:
                recipe = yaml.safe_load(file)  # plain data only: no tags that construct Python objects
            except yaml.YAMLError as error:
                raise PackingValueError(f"The recipe {path!r} is not valid YAML: {error}") from None
        if not isinstance(recipe, dict):
            raise PackingValueError(f"The recipe {path!r} must be a YAML mapping of `key: value`, got {recipe!r}.")
        for key in recipe:
            if key != "env" and key not in valid_keys:
                raise PackingValueError(f"Unknown key {key!r} in {path!r}{_did_you_mean(key, valid_keys)}")
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag != "--config" and flag not in parser._option_string_actions:
            raise PackingValueError(f"Unknown flag {flag!r}{_did_you_mean(flag[2:].replace('-', '_'), valid_keys)}")
    script_args, training_args, model_args, packing_args = parser.parse_args_and_config(argv)
    _check_supported(script_args, training_args, model_args)
    # TRL must not pack, flatten, mask or re-tokenize the packed rows we hand it.
    training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    training_args.remove_unused_columns = False  # the collator needs `seq_lengths`
    return script_args, training_args, model_args, packing_args


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config":
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise PackingValueError("`--config` needs a recipe path, e.g. `--config recipes/tiny-cpu.yaml`.")
            return argv[i + 1]
    return None


def _did_you_mean(key: str, valid_keys: list[str]) -> str:
    close = difflib.get_close_matches(key, valid_keys, n=1)
    hint = f": did you mean {close[0]!r}?" if close else "."
    return (f"{hint} Valid keys are the fields of ScriptArguments, SFTConfig, ModelConfig and PackingArguments; "
            "`python -m llm_packing.train --help` lists them.")


def _check_supported(script_args, training_args, model_args) -> None:
    if training_args.packing:
        raise PackingValueError(
            "`packing: true` turns on TRL's own packing, which this entry point replaces. Remove it and keep "
            "`block_diag_attn: true` (the default) to pack with per-document attention."
        )
    if training_args.max_length is None:
        raise PackingValueError("`max_length` must be a positive integer (tokens per packed row), got None.")
    if (model_args.model_name_or_path is None) == (script_args.model_config is None):
        raise PackingValueError(
            f"Give exactly one of `model_name_or_path` (got {model_args.model_name_or_path!r}) and `model_config` "
            f"(got {script_args.model_config!r}): a checkpoint to fine-tune, or a config for a randomly initialised "
            "model."
        )
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise UnsupportedSetupError(
            "`load_in_4bit` / `load_in_8bit` are not supported by `llm_packing.train` yet: quantized loading is "
            "untested with the packing hook. Use `use_peft: true` on an unquantized model."
        )


def main(argv: list[str] | None = None):
    """Parse the recipe and flags in `argv` (default `sys.argv[1:]`) and train; returns the `TrainOutput`."""
    return train(*parse_args(argv))


def train(script_args, training_args, model_args, packing_args):
    """Train as configured by the four dataclasses of [`parse_args`]; returns the `TrainOutput`."""
    _setup_logging()
    rank = f"[rank {training_args.process_index}/{training_args.world_size}]"
    set_seed(training_args.seed)  # a randomly initialised model is the same on every rank and every run
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path or model_args.model_name_or_path,
                               revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                               chat_template_path=training_args.chat_template_path)
    model = load_model(script_args, model_args, training_args, tokenizer)
    with training_args.main_process_first(desc="tokenizing and packing"):
        documents = load_documents(script_args.dataset_name, config=script_args.dataset_config,
                                   split=script_args.dataset_train_split, max_samples=script_args.max_samples)
        documents = tokenize_documents(documents, tokenizer, messages_field=script_args.dataset_messages_field,
                                       text_field=training_args.dataset_text_field,
                                       assistant_only_loss=training_args.assistant_only_loss,
                                       num_proc=training_args.dataset_num_proc)
        # Unpacked training is the same pipeline with one document per row, so both see the same documents.
        max_docs_per_bin = packing_args.max_docs_per_bin if packing_args.block_diag_attn else 1
        rows, stats = pack_dataset(documents, training_args.max_length, strategy=packing_args.packing_strategy,
                                   seed=packing_args.packing_seed, overflow=packing_args.overflow,
                                   max_docs_per_bin=max_docs_per_bin, return_stats=True)
    layout = ("padding-free" if packing_args.padding_free
              else "indexed mask" if packing_args.block_diag_attn else "unpacked")
    logger.info("%s attention backend %r; layout %s; %d documents in %d rows: %s", rank,
                model.config._attn_implementation, layout, len(documents), len(rows), stats)
    # Unhooked on exit, unless the caller had configured packing already.
    configured = packing_configured(model, attention_route=packing_args.attention_route)
    with configured if packing_args.block_diag_attn else contextlib.nullcontext():
        if packing_args.block_diag_attn and packing_args.verify_packing:
            difference = verify_packing(model)
            logger.info("%s isolation verified: packed logits equal per-document logits (max abs diff %.2g)",
                        rank, difference)
        elif packing_args.block_diag_attn:
            logger.info("%s isolation not verified (`verify_packing: false`)", rank)
        collator = DataCollatorWithPacking(pad_token_id=tokenizer.pad_token_id, max_length=training_args.max_length,
                                           pad_to_multiple_of=training_args.pad_to_multiple_of,
                                           padding_free=packing_args.padding_free)
        # `assistant_only_loss` was applied when tokenizing; TRL would check for raw conversations, which we replaced.
        training_args.assistant_only_loss = False
        counter = _BatchCounter()
        trainer = SFTTrainer(model=model, args=training_args, train_dataset=rows, data_collator=collator,
                             processing_class=tokenizer, peft_config=get_peft_config(model_args), callbacks=[counter])
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        logger.info("%s trained on %d batches in %d optimizer steps; final loss %.4f", rank, counter.batches,
                    trainer.state.global_step, result.training_loss)
        trainer.save_model(training_args.output_dir)
    return result


def load_model(script_args, model_args, training_args, tokenizer):
    """`model_name_or_path` loaded, or a randomly initialised model built from `model_config`."""
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    if script_args.model_config is None:
        kwargs = dict(revision=model_args.model_revision, dtype=dtype, trust_remote_code=training_args.trust_remote_code,
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


def _setup_logging() -> None:
    package_logger = logging.getLogger("llm_packing")
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


class _BatchCounter(TrainerCallback):
    """Counts the micro-batches this rank trained on (one per substep and one per optimizer step)."""

    def __init__(self):
        self.batches = 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.batches += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.batches += 1


if __name__ == "__main__":
    main()
