"""The FlashAttention path of every supported architecture, driven through transformers' real code with a pure-torch
reference kernel.

FlashAttention cannot run on these CPU machines, so the tests tell transformers that flash-attn is installed and hand
it a small reference implementation of `flash_attn_varlen_func` / `flash_attn_func` whichever FlashAttention kernel it
loads (flash_attn, flash_attn_interface or a hub kernel). For FlashAttention 4, transformers' own
`from flash_attn.cute import ...` runs and loads a stand-in with FA4's signatures
(tests/fast_kernel_stand_ins/flash_attention_4), so transformers passes it what it passes the real kernel
(`learnable_sink`, no dropout). Everything else (the choice of attention classes and kernels when the model is built,
the attention integration, `_flash_attention_forward`, `_upad_input`, `_get_unpad_data`, re-padding) is transformers'
own code, so the tests see exactly which `cu_seqlens` and options a real kernel would get.

The reference does what the real kernels do for these models: GQA, causal masks, inclusive `window_size`, tanh
`softcap`, attention sinks (`s_aux`, as vllm-flash-attn3 takes them; transformers picks such a kernel for the
architectures with sinks) and dropout 0. That it leaves nothing out is checked per architecture: each document run
alone through it gives the logits of eager attention (`FLASH_DIFFERS_FROM_EAGER` lists where transformers' own FA path
departs from eager, packed or not).
"""

import importlib.util
import itertools
import os
import sys

import pytest
import torch
from flash_reference import attend
from tiny_models import PACKED_DOCUMENT_LENGTHS, packed_batch, tiny_model
from transformers import masking_utils, modeling_flash_attention_utils as flash_utils, modeling_utils
from transformers.integrations import flash_attention, hub_kernels, msa_attention

from llm_packing.batches.collator import DataCollatorWithPacking
from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support.architectures import (
    FLASH_ATTENTION_3_RUN,
    FLASH_ATTENTION_4_RUN,
    FLASH_BACKENDS,
    REFUSED_BACKENDS,
    backend_available,
    supported_model_types,
)
from llm_packing.hook.support.releases import backend_too_old


TOLERANCE = 1e-5
# flash_attention_3 and flash_attention_4 differ from flash_attention_2 only in the kernel transformers loads (asserted
# by `test_flash_attention_3_and_4_take_the_flash_attention_2_path`), so they run for a sample (the support table marks
# the other cells as inferred): plain, sliding windows, softcap, attention sinks, and falcon's own FlashAttention
# class; on FA4 also the architectures that name it among their own kernels.
FLASH_MATRIX = [(model_type, "flash_attention_2") for model_type in supported_model_types()] + [
    (model_type, backend)
    for backend, sample in (("flash_attention_3", FLASH_ATTENTION_3_RUN), ("flash_attention_4", FLASH_ATTENTION_4_RUN))
    for model_type in sample
    if model_type in supported_model_types()
]
# transformers refuses FlashAttention while `prefix_lm=True` (it cannot express the PrefixLM mask overlay); the FA
# cell covers the configs that can use it.
FLASH_OVERRIDES = {"hrm_text": {"prefix_lm": False}}
# Architectures whose FlashAttention path differs from their eager attention inside transformers, packed or not:
# the packed batch still equals the documents run alone on FlashAttention, which is what packing promises.
FLASH_DIFFERS_FROM_EAGER = {
    "qwen2_moe": "Qwen2MoeAttention keeps `sliding_window` but never passes it to the attention function, so "
    "FlashAttention attends the whole document where eager/sdpa/flex apply the window",
    "phimoe": "PhimoeAttention passes no `sliding_window` to the attention function (phi3's does), so FlashAttention "
    "attends the whole document where eager/sdpa/flex apply the window",
    "gpt_neo": "GPTNeoFlashAttention2 passes no window to the kernel, so FlashAttention attends the whole document in "
    "the 'local' layers where eager applies `window_size`",
}
# Hub kernels that transformers puts in FlashAttention's place for some architectures but that are not FlashAttention.
BLOCK_SPARSE_HUB_KERNELS = ("MiniMaxAI/msa",)
# Where transformers keeps the FlashAttention kernel it loaded; cleared so that each test loads the reference.
_LOADED_KERNEL = (
    "_loaded_implementation",
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
)
# Documents (5, 1, 7, 3) + 2 pad tokens, then (9, 2, 1, 6): one segment per document, in flattened order.
PER_DOCUMENT_CU_SEQLENS = [0, 5, 6, 13, 16, 25, 27, 28, 34]
# The FlashAttention 4 stand-in, a package `flash_attn` with the subpackage `cute`, in a folder of its own so that a
# process with fast_kernel_stand_ins on its path (tests/test_mixers.py) finds no flash_attn.
FLASH_ATTENTION_4_STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_kernel_stand_ins",
                                          "flash_attention_4", "flash_attn")


def reference_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    s_aux=None,
):
    """`flash_attn_varlen_func` in plain torch: q `[total, heads, dim]`, k/v `[total, kv_heads, dim]`, one segment
    per `cu_seqlens` entry."""
    reference_varlen.calls.append(cu_seqlens_q.tolist())
    assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    # A real kernel sizes its work by max_seqlen: smaller than the longest segment would be wrong, not just slow.
    assert max_seqlen_q == max_seqlen_k == int(cu_seqlens_q.diff().max())
    options = softmax_scale, causal, window_size, softcap, dropout_p, s_aux
    bounds = itertools.pairwise(cu_seqlens_q.tolist())
    return torch.cat([attend(q[start:end], k[start:end], v[start:end], *options) for start, end in bounds])


def reference_dense(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    s_aux=None,
):
    """`flash_attn_func` in plain torch: q/k/v `[batch, length, heads, dim]`."""
    reference_dense.calls += 1
    options = softmax_scale, causal, window_size, softcap, dropout_p, s_aux
    return torch.stack([attend(*row, *options) for row in zip(q, k, v, strict=True)])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, which only wait on each other on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def flash_model(monkeypatch):
    """A tiny-model builder for which transformers loads the reference kernel as every FlashAttention
    implementation, for this test only: the FA4 stand-in through its own import of `flash_attn.cute`."""
    imports = flash_utils._lazy_imports
    install_flash_attention_4(monkeypatch)

    def load_reference(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation == "flash_attention_4":
            return imports(implementation, attention_wrapper, allow_all_kernels)
        if hub_kernels.is_kernel(implementation):
            # What `load_and_register_attn_kernel` registers for the hub kernels transformers names: FlashAttention
            # kernels behind its FA integration, the block-sparse MSA kernel behind its own function and sdpa masks.
            if implementation in flash_utils.FLASH_ATTN_KERNEL_VERSIONS:
                attention = attention_wrapper or flash_attention.flash_attention_forward
                mask = masking_utils.flash_attention_mask
            elif implementation in BLOCK_SPARSE_HUB_KERNELS:
                attention, mask = msa_attention.msa_attention_forward, masking_utils.sdpa_mask
            else:
                raise ValueError(f"offline: this test knows no hub kernel {implementation!r}")
            monkeypatch.setitem(modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping, implementation, attention)
            monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, implementation, mask)
        return reference_dense, reference_varlen, None, flash_utils._pad_input, flash_utils._unpad_input

    for name in (*_LOADED_KERNEL, "_process_flash_kwargs_fn"):
        monkeypatch.setattr(flash_utils, name, None)
    monkeypatch.setattr(flash_utils, "_process_with_kvcache_kwargs_fn", None, raising=False)  # transformers 5.19+
    monkeypatch.setattr(flash_utils, "_lazy_imports", load_reference)
    # The model-building checks: flash-attn counts as installed (so no hub-kernel fallback is tried), with no import
    # error; whether the architecture supports FlashAttention at all is still transformers' own check.
    for version in flash_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX.values():
        monkeypatch.setitem(version, "general_availability_check", lambda **_: True)
    monkeypatch.setattr(modeling_utils.PreTrainedModel, "_flash_attn_import_error", lambda self, **_: None)
    # Switching a built model's backend (`set_attn_implementation`, `configure_packing(attn_implementation=...)`) also
    # checks that the weights sit on a FlashAttention device: here the CPU is one.
    for version in flash_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX.values():
        monkeypatch.setitem(version, "supported_devices", ((lambda: True, "cpu"),))
    # Real kernels take half precision, so transformers looks up the dtype of the module's first nn.Linear to cast
    # float32 queries to; here that cast is float32 -> float32, and GPT-2's Conv1D layers hold no nn.Linear at all.
    monkeypatch.setattr(flash_attention, "get_target_dtype", lambda query, module: None)
    monkeypatch.setattr(reference_varlen, "calls", [], raising=False)
    monkeypatch.setattr(reference_dense, "calls", 0, raising=False)

    def build(model_type, backend, **overrides):
        model = tiny_model(model_type, backend, **overrides)
        # Modules that import `_flash_attention_forward` only when flash-attn is installed (falcon) get it bound.
        module = sys.modules[type(model).__module__]
        monkeypatch.setattr(module, "_flash_attention_forward", flash_utils._flash_attention_forward, raising=False)
        return model

    return build


def install_flash_attention_4(monkeypatch):
    """tests/fast_kernel_stand_ins/flash_attention_4/flash_attn as the modules `flash_attn` and `flash_attn.cute`, for
    this test only (nothing else in the process sees a flash_attn package); returns `flash_attn.cute`."""
    package = None
    for name, folder in (("flash_attn", FLASH_ATTENTION_4_STAND_IN),
                         ("flash_attn.cute", os.path.join(FLASH_ATTENTION_4_STAND_IN, "cute"))):
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        if package is not None:
            package.cute = module
        package = module
    return package


def kernel_calls(model) -> tuple[list[list[int]], int]:
    """The `cu_seqlens_q` of each varlen call and the number of non-varlen calls of the reference kernel transformers
    loaded for `model`, after checking that the other one was not called: the FA4 stand-in on flash_attention_4 (which
    mimo_v2_flash runs for every FlashAttention request), else the flash_attn API reference."""
    flash_attention_4 = sys.modules["flash_attn.cute"]
    fa4_calls = flash_attention_4.flash_attn_varlen_func.calls, flash_attention_4.flash_attn_func.calls
    reference_calls = reference_varlen.calls, reference_dense.calls
    on_fa4 = model.config._attn_implementation == "flash_attention_4"
    taken, other = (fa4_calls, reference_calls) if on_fa4 else (reference_calls, fa4_calls)
    assert other == ([], 0), (model.config._attn_implementation, "called another kernel than the one it loaded")
    return taken


def _separate_logits(model, batch):
    with torch.no_grad():
        return {
            (row, start): model(
                input_ids=batch["input_ids"][row : row + 1, start : start + length],
                position_ids=torch.arange(length)[None],
                use_cache=False,
            ).logits[0]
            for row, spans in enumerate(batch["documents"])
            for start, length in spans
        }


def _packed_logits(model, batch):
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits


def _max_difference(logits, separate):
    return max(
        (logits[row, start : start + len(expected)] - expected).abs().max().item()
        for (row, start), expected in separate.items()
    )


@pytest.mark.parametrize("backend", ["flash_attention_3", "flash_attention_4"])
def test_flash_attention_3_and_4_take_the_flash_attention_2_path(backend):
    """Same attention function and mask function: only the kernel differs, so FA3 and FA4 need no full sweep."""
    attention = modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping
    masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert attention[backend] is attention["flash_attention_2"] is flash_attention.flash_attention_forward
    assert masks[backend] is masks["flash_attention_2"] is masking_utils.flash_attention_mask
    assert set(FLASH_BACKENDS) == {"flash_attention_2", "flash_attention_3", "flash_attention_4"}


@pytest.mark.parametrize(("model_type", "backend"), FLASH_MATRIX)
def test_packed_flash_path_equals_separate_documents(flash_model, model_type, backend):
    overrides = FLASH_OVERRIDES.get(model_type, {})
    if not backend_available(model_type, backend):
        _assert_no_flash_attention(flash_model, model_type, backend)
        return
    model = flash_model(model_type, backend, **overrides)
    if (model_type, backend) in REFUSED_BACKENDS:
        with pytest.raises(UnsupportedSetupError, match=model_type), packing_configured(model):
            pass
        return
    _assert_packed_equals_separate(model, model_type, **overrides)


def test_hub_flash_kernel_takes_the_same_path(flash_model, monkeypatch):
    """Without flash-attn but with `kernels` installed, transformers serves "flash_attention_2" from a hub kernel
    behind the same integration: the hook accepts it and stays exact."""
    flash_attention_2 = flash_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]
    monkeypatch.setitem(flash_attention_2, "general_availability_check", lambda: False)
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda: True)
    model = flash_model("llama", "flash_attention_2")
    assert model.config._attn_implementation == "kernels-community/flash-attn2"
    _assert_packed_equals_separate(model, "llama")


def _assert_packed_equals_separate(model, model_type, **overrides):
    batch = packed_batch()
    separate = _separate_logits(model, batch)
    varlen_calls, dense_calls = kernel_calls(model)
    assert dense_calls > 0 and not varlen_calls, "documents alone must take the FA path"

    eager = _separate_logits(tiny_model(model_type, "eager", **overrides), batch)
    eager_difference = max((separate[key] - eager[key]).abs().max().item() for key in separate)
    if model_type in FLASH_DIFFERS_FROM_EAGER:
        assert eager_difference > 1e-3, f"transformers fixed {model_type}: drop it from FLASH_DIFFERS_FROM_EAGER"
    else:
        assert eager_difference <= TOLERANCE, (model_type, "reference kernel differs from eager", eager_difference)

    with packing_configured(model):
        logits = _packed_logits(model, batch)
    calls, _ = kernel_calls(model)
    assert calls and all(cu_seqlens == PER_DOCUMENT_CU_SEQLENS for cu_seqlens in calls), (model_type, calls)
    difference = _max_difference(logits, separate)
    assert difference <= TOLERANCE, (model_type, model.config._attn_implementation, difference)


def _assert_no_flash_attention(build, model_type, backend):
    """transformers offers no FlashAttention for this architecture: it refuses to build the model, or builds it on a
    kernel of the model's own choosing (`_compatible_flash_implementations`: minimax_m3_vl_text's block-sparse MSA,
    which ignores the attention mask), which the hook must refuse. On a release too old for it
    (`hook.support.releases.BACKENDS_FROM`), transformers fails to build it (falcon on flash_attention_3 before 5.23:
    KeyError)."""
    if backend_too_old(model_type, backend):
        with pytest.raises(KeyError, match=backend):
            build(model_type, backend)
        return
    try:
        model = build(model_type, backend)
    except ValueError as error:
        assert "does not support Flash Attention" in str(error)
        return
    substitute = model.config._attn_implementation
    assert substitute != backend
    with pytest.raises(UnsupportedSetupError, match=f"'{substitute}'"), packing_configured(model):
        pass


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2", "gpt_oss"])  # plain, sliding, softcap, sinks
def test_collator_flash_kwargs_batch_equals_separate_documents(flash_model, model_type):
    """`DataCollatorWithPacking(return_flash_attn_kwargs=True)` output (no mask; `cu_seq_lens_q/k` over the flattened
    rows, each row's padding one segment) run as it is through the model's FlashAttention path, without the hook: each
    document's logits equal the document run alone."""
    batch = packed_batch()
    features = [
        {"input_ids": ids[: sum(length for _, length in spans)].tolist(), "seq_lengths": [n for _, n in spans]}
        for ids, spans in zip(batch["input_ids"], batch["documents"], strict=True)
    ]
    collated = DataCollatorWithPacking(return_flash_attn_kwargs=True)(features)
    assert "attention_mask" not in collated and torch.equal(collated["input_ids"][:, :16], batch["input_ids"][:, :16])
    model = flash_model(model_type, "flash_attention_2")
    separate = _separate_logits(model, batch)
    reference_varlen.calls.clear()
    with torch.no_grad():
        logits = model(**{key: value for key, value in collated.items() if key != "labels"}, use_cache=False).logits
    # Row 0's two pad tokens are one segment (16 -> 18); row 1 has no padding.
    expected = [0, 5, 6, 13, 16, 18, 27, 29, 30, 36]
    assert reference_varlen.calls == [expected] * model.config.num_hidden_layers
    assert _max_difference(logits, separate) <= TOLERANCE


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_all_padding_row_on_the_flash_path(flash_model, model_type):
    """A row without any document in an indexed mask gets no segment: the other rows stay exact, nothing is NaN."""
    batch = packed_batch(document_lengths=(PACKED_DOCUMENT_LENGTHS[0], (), PACKED_DOCUMENT_LENGTHS[1]))
    model = flash_model(model_type, "flash_attention_2")
    separate = _separate_logits(model, batch)
    with packing_configured(model):
        logits = _packed_logits(model, batch)
    # The empty middle row adds no segment: the per-document cu_seqlens of the batch without it.
    assert reference_varlen.calls[-1] == PER_DOCUMENT_CU_SEQLENS
    assert not logits.isnan().any()
    assert _max_difference(logits, separate) <= TOLERANCE


@pytest.mark.parametrize("backend", ["flash_attention_2", "flash_attention_4"])
def test_flash_path_without_packing_merges_documents(flash_model, backend):
    """Negative control: unpatched, transformers booleanises the indexed mask and FlashAttention sees one segment
    per row, so later documents attend to earlier ones."""
    model = flash_model("llama", backend)
    batch = packed_batch()
    separate = _separate_logits(model, batch)
    logits = _packed_logits(model, batch)
    assert kernel_calls(model)[0] == [[0, 16, 34]] * model.config.num_hidden_layers
    start, length = batch["documents"][1][3]
    assert (logits[1, start : start + length] - separate[(1, start)]).abs().max().item() > 1e-3
