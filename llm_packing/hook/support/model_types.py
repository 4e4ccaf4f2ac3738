"""The causal LM model types of the installed transformers, which of them a config belongs to, its modeling module,
and the configs nested in it.

The text config of a multimodal model (`mllama_text_model`) is listed under its package's causal LM type (`mllama`).
Used by the support table (`architectures.py`) and the hook (`patch.py`); a module of its own, so that
`architectures.py` and `multimodal.py` no longer import each other.
"""

import contextlib
import functools
import importlib


@functools.cache
def causal_lm_classes() -> dict[str, str]:
    """`model_type -> causal LM class name` of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mapping = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return {model_type: name for model_type, name in mapping.items() if isinstance(name, str)}


def causal_lm_model_type(config) -> str | None:
    """
    The model type under which the support table lists `config`'s architecture: `config.model_type` if it names a
    causal LM, else the single causal LM type of the package that defines `config` (a text config of a multimodal
    model), else `config.model_type` unchanged.

    Example:
    ```python
    >>> from transformers import MllamaTextConfig
    >>> from llm_packing.hook.support.model_types import causal_lm_model_type
    >>> MllamaTextConfig().model_type, causal_lm_model_type(MllamaTextConfig())
    ('mllama_text_model', 'mllama')

    ```
    """
    model_type = getattr(config, "model_type", None)
    if model_type in causal_lm_classes():
        return model_type
    package = _package_of(type(config))
    same_package = [t for t in causal_lm_classes() if package is not None and _module_name(t) == package]
    return same_package[0] if len(same_package) == 1 else model_type


def modeling_module(config):
    """The modeling module of `config`'s causal LM type (`transformers.models.llama.modeling_llama`), imported; None
    where the type has none."""
    model_type = causal_lm_model_type(config)
    if not model_type:
        return None
    name = _module_name(model_type)
    with contextlib.suppress(ModuleNotFoundError):
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return None


def config_parts(config) -> list:
    """`config` and the configs nested in it (an image-text model's `text_config`, `vision_config`, ...)."""
    return [config] + [value for value in vars(config).values() if hasattr(value, "to_dict")]


def _package_of(config_class) -> str | None:
    parts = config_class.__module__.split(".")
    return parts[2] if parts[:2] == ["transformers", "models"] and len(parts) > 3 else None


@functools.cache
def _module_name(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)
