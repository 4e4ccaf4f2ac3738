import functools
import os
import sys
import tempfile
import types

import pytest
import torch


# Tests never reach a model hub: everything is built from configs or shipped in registry packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed (the [test] extra) prints its accelerator guess on stdout when first imported (accelerate imports it to
# unwrap a model), which fails whichever doctest happens to import it first in a process; named, it prints nothing.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# The bundled SmolLM2's conversion (llm_packing/demo/pretrained.py), kept out of the user's own cache and shared by the
# xdist workers and the subprocesses they start: converted once per machine, not once per load.
os.environ.setdefault("LLM_PACKING_CACHE", os.path.join(tempfile.gettempdir(), "llm_packing-tests-cache"))

# Tiny models on a 2-core machine shared by 2 xdist workers: extra intra-op threads only wait on each other.
torch.set_num_threads(1)

# Stand-in kernel packages, imported only by a subprocess of test_mixers.py (their modules are not tests).
collect_ignore = ["fast_kernel_stand_ins"]

LIBRARY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "llm_packing") + os.sep


@pytest.fixture(autouse=True)
def hook_undone():
    """After every test, the packing hook must be off: a test that leaves it on changes what every later test in the
    process sees. Reports what was left, then undoes it so that one leak does not fail the tests after it."""
    yield
    _fail_if_left(_hook_state_left)
    registry = sys.modules.get("llm_packing.hook.registry")
    if registry is not None:  # what a `DataCollatorWithPacking` keeps until `unconfigure_packing`: Trainer's columns
        registry.restore_all()
        # A test's collators may outlive it in reference cycles: later tests must not keep Trainer's columns for them.
        sys.modules["llm_packing.hook.trainer_columns"]._collators.clear()


@pytest.fixture(autouse=True, scope="module")
def hook_bindings_undone():
    """After every test module, no llm_packing wrapper is bound anywhere (a scan of every loaded module and of the
    classes transformers defines: about 0.2 s with every modeling module loaded, too slow to run after each test)."""
    yield
    _fail_if_left(lambda: _hook_state_left() + _wrappers_left())


@pytest.fixture
def unconfigure_after():
    """For tests of trainers that configure the hook themselves (process-wide, in their constructor): undone after."""
    yield
    sys.modules["llm_packing.hook.configure"].unconfigure_packing()


def _fail_if_left(find):
    patch = sys.modules.get("llm_packing.hook.configure")
    if patch is None:  # never imported, so nothing was patched
        return
    left = (["is_packing_configured() is True"] if patch.is_packing_configured() else []) + find()
    if left:
        patch.unconfigure_packing()
        pytest.fail("the packing hook was not undone (call unconfigure_packing() or use packing_configured): "
                    + "; ".join(left[:10]), pytrace=False)


def _hook_state_left() -> list[str]:
    """llm_packing functions left in transformers' attention backend and mask registries."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    registries = {
        "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING": getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {}),
        "ALL_MASK_ATTENTION_FUNCTIONS": getattr(getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None),
                                                "_global_mapping", {}),
        "ALL_ATTENTION_FUNCTIONS": getattr(getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None),
                                           "_global_mapping", {}),
    }
    return [f"{registry_name}[{key!r}]" for registry_name, registry in registries.items()
            for key, value in list(registry.items()) if _is_ours(value)]


def _wrappers_left() -> list[str]:
    """llm_packing wrappers of foreign functions bound in any module namespace, or in a transformers class (mixer
    `forward`s)."""
    left = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        in_transformers = module_name.startswith("transformers")
        for attribute, value in list(namespace.items()):
            if _is_our_wrapper(value):
                left.append(f"{module_name}.{attribute}")
            elif in_transformers and type(value) is type and value.__module__ == module_name:
                left += [f"{module_name}.{attribute}.{name}" for name, member in list(vars(value).items())
                         if _is_our_wrapper(member)]
    return left


def _is_ours(value) -> bool:
    if isinstance(value, functools.partial):
        return _is_ours(value.func)
    if isinstance(value, dict):
        return any(_is_ours(item) for item in value.values())
    return type(value) is types.FunctionType and value.__code__.co_filename.startswith(LIBRARY_DIR)


def _is_our_wrapper(value) -> bool:
    """A function of llm_packing's wrapping (functools.wraps) one that is not."""
    return (
        type(value) is types.FunctionType and "__wrapped__" in value.__dict__ and _is_ours(value)
        and not _is_ours(value.__wrapped__)
    )
