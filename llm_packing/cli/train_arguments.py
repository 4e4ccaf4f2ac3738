"""The recipe of `llm-packing train`: its dataclasses (TRL's `SFTConfig` and `ModelConfig`, [`ScriptArguments`],
[`~llm_packing.cli.arguments.PackingArguments`]), the parser that reads a YAML recipe and flags into them, the short
`--help`, and the settings refused before any model is loaded."""

import argparse
import json
import os
import sys
import textwrap
from dataclasses import dataclass, field

import torch
from trl import ModelConfig, SFTConfig, TrlParser

from ..core.checks import check_choice, check_integer
from ..errors import PackingError, PackingValueError, UnsupportedSetupError
from .arguments import PackingArguments
from .documents import check_dataset_name
from .main import UsageError
from .recipe_file import check_recipe_number, command_name, config_path, did_you_mean, read_recipe


TRAINERS = ("sft", "dpo", "grpo")


@dataclass
class PackedSFTConfig(SFTConfig):
    """
    TRL's `SFTConfig` minus the keys that [`~llm_packing.cli.arguments.PackingArguments`] owns (`packing_strategy`,
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
            built-in demo conversations, see [`~llm_packing.demo.chitchat.load_chitchat_conversations`]).
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
        processor_name_or_path (`str`, *optional*):
            The processor of an image-text model (a hub id or local path, or `"demo-qwen2.5-vl"`, the built-in tiny
            Qwen2.5-VL one): trains TRL's vision format (`messages` + `images`), packed by the processor's token
            counts (see [`~llm_packing.cli.train_image_text.train_image_text`]).
        model_config (`dict` or `str`, *optional*):
            Build a randomly initialised model from this config (a mapping, or JSON on the command line) instead of
            loading `model_name_or_path`: `model_type` (default `"llama"`) and that config class's keys;
            `vocab_size` defaults to the tokenizer's.
        sample_prompt (`str`, *optional*):
            Log the model's greedy reply to this prompt before and after training.
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
    processor_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Processor of an image-text model (TRL's messages + images data); 'demo-qwen2.5-vl' is the "
                          "built-in tiny Qwen2.5-VL one. Turns on image-text training."},
    )
    sample_prompt: str | None = field(
        default=None, metadata={"help": "Log the model's greedy reply to this prompt before and after training."},
    )
    trainer: str = field(
        default="sft",
        metadata={"help": "sft (packed documents), or dpo / grpo: TRL's DPOTrainer / GRPOTrainer with their forwards "
                          "packed, taking DPOConfig / GRPOConfig keys (see llm_packing.cli.train_preference).",
                  "choices": list(TRAINERS)},
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
        check_integer("max_samples", self.max_samples, optional=True,
                      fix="Write `max_samples: null` in the recipe to train on every example.")
        # argparse checks the `choices` of a flag, not of a recipe value
        check_choice("trainer", self.trainer, TRAINERS, fix="Write e.g. `trainer: sft` in the recipe.")


def make_parser(trainer: str = "sft"):
    """The `TrlParser` for recipes: `ScriptArguments`, `PackedSFTConfig` (or `trainer`'s TRL config), `ModelConfig`,
    `PackingArguments`."""
    from .train_preference import TRAINING_CONFIGS

    training_config = TRAINING_CONFIGS.get(trainer, PackedSFTConfig)
    # No abbreviated flags, so that a typo is reported rather than matched to some other option.
    parser = TrlParser((ScriptArguments, training_config, ModelConfig, PackingArguments), allow_abbrev=False,
                       prog=command_name())
    for action in parser._actions:  # HfArgumentParser gives `--no_X` the help of `--X` and "(default: False)"
        if action.option_strings and action.option_strings[0].startswith("--no_"):
            action.help, action.default = f"Same as `--{action.dest} false`.", argparse.SUPPRESS
    return parser


def parse_args(argv: list[str] | None = None):
    """
    Parse `--config recipe.yaml` and command-line flags (which override the recipe) into the four dataclasses.

    Returns:
        `tuple`: `(ScriptArguments, SFTConfig, ModelConfig, PackingArguments)`.

    Raises:
        `PackingValueError`: a recipe key or flag that no dataclass has (naming the closest valid one), a recipe that
            is not a mapping, or a combination this entry point cannot train.
        `UsageError`: no recipe (and no model flag), a recipe file that cannot be read, or settings that TRL's or
            transformers' own checks refuse (bf16 without a GPU).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--config=path` as `--config path`, the only form TrlParser reads.
    argv = [part for token in argv for part in (token.split("=", 1) if token.startswith("--config=") else [token])]
    path = config_path(argv)
    recipe = None if path is None else read_recipe(path)
    parser = make_parser(_trainer_name(argv, recipe))
    valid_keys = sorted({action.dest for action in parser._actions} - {"help"})
    if "--help_all" in argv:
        parser.print_help()
        raise SystemExit(0)
    if "-h" in argv or "--help" in argv:
        print(short_help(parser))
        raise SystemExit(0)
    if path is None and not {"--model_name_or_path", "--model_config"} & {token.split("=", 1)[0] for token in argv}:
        raise UsageError("`--config` is missing: give a training recipe, e.g. `--config recipes/tiny-cpu.yaml` (the "
                         f"repository's recipes/ folder holds ready ones); `{command_name()} --help` lists its keys.")
    for key, value in (recipe or {}).items():
        if key != "env" and key not in valid_keys:
            raise PackingValueError(f"Unknown key {key!r} in {path!r}{did_you_mean(key, valid_keys)}")
        check_recipe_number(parser, key, value, path)
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag != "--config" and flag not in parser._option_string_actions:
            raise PackingValueError(f"Unknown flag {flag!r}{did_you_mean(flag[2:].replace('-', '_'), valid_keys)}")
    try:
        script_args, training_args, model_args, packing_args = parser.parse_args_and_config(argv)
    except PackingError:
        raise
    except ValueError as error:  # TrainingArguments' and TRL's own checks: bf16 (SFTConfig's default) without a GPU
        raise UsageError(_training_arguments_refusal(str(error))) from None
    _resolve_beside_recipe(training_args, "chat_template_path", path)
    _check_supported(script_args, training_args, model_args)
    check_dataset_name(script_args.dataset_name)  # before minutes of model loading, not after
    return script_args, training_args, model_args, packing_args


def short_help(parser) -> str:
    """`--help`: the recipe flag, the packing and data keys, and where the other keys come from."""
    lines = [f"usage: {command_name()} --config RECIPE.yaml [--KEY VALUE ...]", "",
             "Fine-tune a causal LM on packed documents: no attention across documents, positions restarting per "
             "document.", "Every recipe key is also a flag (`--max_steps 5`); flags override the recipe.", "",
             "  --config PATH", "      A YAML recipe of `key: value` lines, e.g. recipes/tiny-cpu.yaml."]
    for title, dataclass_type in (("packing keys", PackingArguments), ("data keys", ScriptArguments)):
        lines += ["", f"{title}:"]
        if dataclass_type is PackingArguments:
            lines += ["  --max_length INT (an SFTConfig key)", "      Tokens per packed row."]
        for name, item in dataclass_type.__dataclass_fields__.items():
            choices = item.metadata.get("choices")
            value = "{" + ",".join(choices) + "}" if choices else type(item.default).__name__.upper()
            shown = str(item.default).lower() if isinstance(item.default, bool) else item.default
            default = "" if item.default is None else f" (default: {shown})"
            lines += [f"  --{name} {value if item.default is not None else 'VALUE'}",
                      textwrap.fill(item.metadata.get("help", "") + default, 110, initial_indent=" " * 6,
                                    subsequent_indent=" " * 6)]
    count = len({action.dest for action in parser._actions} - {"help"})
    lines += ["", textwrap.fill(
        "All other keys are those of TRL's SFTConfig (training: output_dir, learning_rate, max_steps, "
        "per_device_train_batch_size, ...) and ModelConfig (model: model_name_or_path, attn_implementation, dtype, "
        f"use_peft, lora_r, ...), with the meanings TRL documents. `--help_all` lists all {count} keys. "
        "`llm-packing stats` shows how a dataset packs before training.", 116)]
    return "\n".join(lines)


def _trainer_name(argv: list[str], recipe: dict | None) -> str:
    """The `trainer` of the flags, else of the recipe: it decides which TRL config parses the other keys (a name
    that is not one is left for the parser to refuse)."""
    for i, token in enumerate(argv[:-1]):
        if token == "--trainer":
            return argv[i + 1]
    trainer = (recipe or {}).get("trainer", "sft")
    return trainer if isinstance(trainer, str) else "sft"


def _training_arguments_refusal(message: str) -> str:
    message = " ".join(message.split()).rstrip(".")
    hint = ("This machine has no GPU: set `use_cpu: true` and `bf16: false` in the recipe (or pass `--use_cpu true "
            "--bf16 false`)." if "bf16" in message and not torch.cuda.is_available() else
            "Change that key in the recipe, or pass it as a flag.")
    return f"The recipe and flags are refused by TRL / transformers: {message}. {hint}"


def _resolve_beside_recipe(arguments, key: str, recipe_path: str | None) -> None:
    """A relative file path that is not in the working directory but beside the recipe is taken from there: recipes
    name their companion files (a chat template) relative to themselves, whatever folder they are run from."""
    value = getattr(arguments, key, None)
    if recipe_path is None or not value or os.path.isabs(value) or os.path.exists(value):
        return
    beside = os.path.join(os.path.dirname(os.path.abspath(recipe_path)), value)
    if os.path.exists(beside):
        setattr(arguments, key, beside)


def _check_supported(script_args, training_args, model_args) -> None:
    if getattr(training_args, "packing", False):
        raise PackingValueError(
            "`packing: true` turns on TRL's own packing, which this entry point replaces. Remove it and keep "
            "`block_diag_attn: true` (the default) to pack with per-document attention."
        )
    # Here, not after loading the model and tokenizing. GRPOConfig has no max_length: one packed row per batch.
    check_integer("max_length", getattr(training_args, "max_length", 1), meaning="tokens per packed row",
                  fix="Set e.g. `max_length: 2048` in the recipe, or pass `--max_length 2048`.")
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
