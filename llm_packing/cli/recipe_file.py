"""The recipe file of `llm-packing train`: where the command line names it, its YAML read as a mapping, and the
checks a recipe's values get before a parser converts them."""

import difflib
import os
import sys

import yaml

from ..errors import PackingValueError
from .main import UsageError


def command_name() -> str:
    """How the user ran training, for messages: `llm-packing train` or `python -m llm_packing.train`."""
    return "llm-packing train" if os.path.basename(sys.argv[0]) == "llm-packing" else "python -m llm_packing.train"


def config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config":
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise PackingValueError("`--config` needs a recipe path, e.g. `--config recipes/tiny-cpu.yaml`.")
            return argv[i + 1]
    return None


def read_recipe(path: str) -> dict:
    """The recipe at `path`: a `UsageError` if the file cannot be read, a `PackingValueError` if it is not a YAML
    mapping."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = (f"not UTF-8 text ({error.reason} at byte {error.start})" if isinstance(error, UnicodeDecodeError)
                  else error.strerror or str(error))
        missing = isinstance(error, FileNotFoundError) and not os.path.isabs(path)
        where = f" (relative to {os.getcwd()})" if missing else ""
        raise UsageError(f"`--config` {path!r} cannot be read: {reason}{where}. Give the path of a YAML recipe file, "
                         "e.g. `--config recipes/tiny-cpu.yaml`.") from None
    try:
        recipe = yaml.safe_load(text)  # plain data only: no tags that construct Python objects
    except yaml.YAMLError as error:
        raise PackingValueError(f"The recipe {path!r} is not valid YAML: {error}") from None
    if not isinstance(recipe, dict):
        raise PackingValueError(f"The recipe {path!r} must be a YAML mapping of `key: value`, got {recipe!r}.")
    return recipe


def check_recipe_number(parser, key: str, value, path: str) -> None:
    """The parser converts a recipe's strings by the key's type, but keeps a YAML list, mapping or bool as it is: a
    wrong type would otherwise fail minutes later, deep in torch."""
    action = parser._option_string_actions.get(f"--{key}")
    # TRL wraps the type of a `T | None` key in a converter that keeps the name of `T`
    number = getattr(getattr(action, "type", None), "__name__", None)
    if number not in ("int", "float") or value is None or isinstance(value, str):
        return
    if isinstance(value, (int,) if number == "int" else (int, float)) and not isinstance(value, bool):
        return
    kind = "a whole number" if number == "int" else "a number"
    example = f", e.g. `{key}: {action.default}`" if isinstance(action.default, (int, float)) else ""
    raise PackingValueError(f"`{key}` must be {kind}, got {value!r} in {path!r}. Write {kind}{example}.")


def did_you_mean(key: str, valid_keys: list[str]) -> str:
    close = difflib.get_close_matches(key, valid_keys, n=1)
    hint = f": did you mean {close[0]!r}?" if close else "."
    return (f"{hint} Valid keys are the fields of ScriptArguments, SFTConfig, ModelConfig and PackingArguments; "
            f"`{command_name()} --help_all` lists them.")
