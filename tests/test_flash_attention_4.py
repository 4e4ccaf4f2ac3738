"""FlashAttention 4 (`attn_implementation="flash_attention_4"`, flash-attn-4's `flash_attn.cute`) on CPU: what
transformers passes the kernel, the hook's per-document `cu_seqlens` reaching it through `configure_packing` and
`llm-packing verify`, and the controls that show a test would see a leak; the `[flash]` extra that installs it.

The kernel is tests/fast_kernel_stand_ins/flash_attention_4/flash_attn, FA4's signatures computed in torch, which
transformers imports itself (`test_flash_path.flash_model`); the support table's FA4 cells are run by
tests/test_flash_path.py.
"""

import configparser
import importlib.util
import os

import pytest
import test_flash_path
import torch
import torch.nn.functional as F
from packaging.requirements import Requirement
from test_flash_path import (
    PER_DOCUMENT_CU_SEQLENS,
    TOLERANCE,
    _max_difference,
    _packed_logits,
    _separate_logits,
    install_flash_attention_4,
    kernel_calls,
)
from tiny_models import packed_batch, tiny_model
from transformers import modeling_flash_attention_utils as flash_utils

from llm_packing import cli
from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook.configure import configure_packing, packing_configured, unconfigure_packing


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The fixture: a tiny-model builder on transformers' FlashAttention code with the reference kernels, FA4's stand-in
# imported by transformers itself.
flash_model = test_flash_path.flash_model
LONGEST_DOCUMENT = 9  # of tiny_models.PACKED_DOCUMENT_LENGTHS


def test_transformers_passes_flash_attention_4_its_own_options(monkeypatch):
    """transformers picks the options it passes from the kernel's signature: for FA4, sinks as `learnable_sink` (not
    `s_aux`), no `dropout_p` (FA4 has no dropout), and windows, softcap, `deterministic` and `max_seqlen_q/k`."""
    kernel = install_flash_attention_4(monkeypatch)
    supports = flash_utils._lazy_define_process_function(kernel.flash_attn_varlen_func).keywords["supports_mapping"]
    assert {name for name, supported in supports.items() if supported} >= {
        "learnable_sink", "window_size", "softcap", "deterministic", "max_seqlen_q", "max_seqlen_k"}
    assert not supports["s_aux"] and not supports["dropout_p"]


@pytest.mark.parametrize(("model_type", "option", "expected"), [
    ("llama", "window_size", (None, None)),  # no window: FA4's default, not FA2's (-1, -1)
    ("qwen2", "window_size", (3, 3)),  # sliding_window 4: the kernel pins the right edge at 0 (causal)
    ("gemma2", "softcap", 50.0),
    ("gpt_oss", "learnable_sink", True),
])
def test_packed_batch_reaches_flash_attention_4_with_its_options(flash_model, model_type, option, expected):
    """Each layer's call gets the per-document `cu_seqlens`, `max_seqlen` as the int length of the longest document
    (an exact bound, read on the host without a sync), `causal=True` and the architecture's own option."""
    model = flash_model(model_type, "flash_attention_4")
    with packing_configured(model):
        _packed_logits(model, packed_batch())
    calls, _ = kernel_calls(model)
    options = importlib.import_module("flash_attn.cute").flash_attn_varlen_func.options
    assert calls == [PER_DOCUMENT_CU_SEQLENS] * model.config.num_hidden_layers
    assert all(type(call["max_seqlen_q"]) is int and call["max_seqlen_q"] == LONGEST_DOCUMENT for call in options)
    assert all(call["causal"] for call in options)
    assert expected in {call[option] for call in options}, options


def test_configure_packing_switches_a_model_to_flash_attention_4(flash_model):
    """`configure_packing(model, attn_implementation="flash_attention_4")` on a model built on sdpa: transformers
    loads FA4 and every document's logits equal the document alone on FA4."""
    model = flash_model("qwen2", "sdpa")
    batch = packed_batch()
    try:
        configure_packing(model, attn_implementation="flash_attention_4")
        assert model.config._attn_implementation == "flash_attention_4"
        logits = _packed_logits(model, batch)
    finally:
        unconfigure_packing()
    calls, _ = kernel_calls(model)
    assert calls == [PER_DOCUMENT_CU_SEQLENS] * model.config.num_hidden_layers
    assert _max_difference(logits, _separate_logits(model, batch)) <= TOLERANCE


def test_flash_attention_4_without_its_package_is_refused_by_name():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a flash_attn package is installed here")
    model = tiny_model("llama", "sdpa")
    with pytest.raises(UnsupportedSetupError, match=r"`attn_implementation`='flash_attention_4' cannot be used with "
                                                    r"model_type 'llama'.*attn_implementation='sdpa'"):
        configure_packing(model, attn_implementation="flash_attention_4")
    assert model.config._attn_implementation == "sdpa"


def test_kernel_fed_whole_rows_leaks(flash_model, monkeypatch):
    """Control: the same configured model, with the kernel given one segment per row instead of the hook's
    per-document `cu_seqlens`, puts later documents off by far more than the tolerance: exactness comes from the
    segments the hook hands FA4, and the parity test would see them wrong."""
    model = flash_model("llama", "flash_attention_4")
    batch = packed_batch()
    separate = _separate_logits(model, batch)
    kernel = flash_utils._flash_varlen_fn
    rows = torch.tensor([0, 16, 34], dtype=torch.int32)  # 16 and 18 tokens before padding

    def whole_rows(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
        assert cu_seqlens_q.tolist() == PER_DOCUMENT_CU_SEQLENS
        return kernel(q, k, v, cu_seqlens_q=rows, cu_seqlens_k=rows, max_seqlen_q=18, max_seqlen_k=18, **options)

    monkeypatch.setattr(flash_utils, "_flash_varlen_fn", whole_rows)
    with packing_configured(model):
        logits = _packed_logits(model, batch)
    assert kernel_calls(model)[0] == [[0, 16, 34]] * model.config.num_hidden_layers
    assert _max_difference(logits, separate) > 1e-3


@pytest.mark.parametrize(("head_dim", "refused"), [(16, True), (32, False)])
def test_cuda_training_below_head_dim_32_is_refused(flash_model, monkeypatch, head_dim, refused):
    """FlashAttention 4's varlen backward was measured wrong at head dim 16 on an H200 (right at 32 and 64), so a
    CUDA training forward of a configured model below 32 is refused, naming the fix; evaluation, CPU and head dim 32
    run (the CUDA check is stood in for: this machine has no GPU)."""
    from llm_packing.hook import guards

    model = flash_model("llama", "flash_attention_4", head_dim=head_dim).train()
    batch = packed_batch()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with packing_configured(model):
        model(**inputs)  # on CPU: the stand-in kernel, right at any head dim
        monkeypatch.setattr(guards, "_on_cuda", lambda tensor: True)
        with torch.no_grad():
            model(**inputs)  # no gradients, no backward: its forward is right
        if not refused:
            model(**inputs)
            return
        with pytest.raises(UnsupportedSetupError, match=r"head_dim 16: .*attn_implementation='sdpa'"):
            model(**inputs)


def test_stand_in_attends_each_segment_alone(monkeypatch):
    """The stand-in itself: per-document segments give torch SDPA's causal GQA attention of each document alone;
    whole-row segments do not (later documents attend to earlier ones)."""
    kernel = install_flash_attention_4(monkeypatch)
    torch.manual_seed(0)
    lengths = [5, 1, 7, 3]
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    per_document = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    out, lse = kernel.flash_attn_varlen_func(q, k, v, cu_seqlens_q=per_document, cu_seqlens_k=per_document,
                                             max_seqlen_q=7, max_seqlen_k=7, causal=True)
    alone = torch.cat([
        F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in parts), is_causal=True, enable_gqa=True)
        .transpose(0, 1)
        for parts in zip(*(x.split(lengths) for x in (q, k, v)), strict=True)
    ])
    assert lse is None and (out - alone).abs().max() <= TOLERANCE
    row = torch.tensor([0, 16], dtype=torch.int32)
    merged, _ = kernel.flash_attn_varlen_func(q, k, v, cu_seqlens_q=row, cu_seqlens_k=row, causal=True)
    assert (merged[5:] - alone[5:]).abs().max() > 1e-3
    with pytest.raises(AssertionError, match="cu_seqlens must be int32"):
        kernel.flash_attn_varlen_func(q, k, v, cu_seqlens_q=row.long(), cu_seqlens_k=row.long(), causal=True)
    with pytest.raises(NotImplementedError, match="does not compute seqused_k"):
        kernel.flash_attn_varlen_func(q, k, v, cu_seqlens_q=row, cu_seqlens_k=row, seqused_k=row[1:])


def test_verify_command_proves_flash_attention_4(flash_model, tmp_path, capsys):
    """`llm-packing verify --attn_implementation flash_attention_4`: logits and gradients exact through FA4."""
    torch.manual_seed(0)
    tiny_model("llama", "eager").save_pretrained(tmp_path)
    capsys.readouterr()  # saving may import DeepSpeed (accelerate's unwrap), which prints a warning once a process
    code = cli.main(["verify", "--model", str(tmp_path), "--attn_implementation", "flash_attention_4"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.startswith("exact: ") and "(llama, float32, cpu, flash_attention_4)" in out, out
    assert "; gradients (of the largest alone) " in out
    assert importlib.import_module("flash_attn.cute").flash_attn_varlen_func.calls


def test_flash_extra_installs_flash_attention_4_on_linux_x86_64_only():
    setup = configparser.ConfigParser(interpolation=None)
    setup.read(os.path.join(ROOT, "setup.cfg"), encoding="utf-8")
    (requirement,) = map(Requirement, setup["options.extras_require"]["flash"].strip().splitlines())
    assert requirement.name == "flash-attn-4" and requirement.specifier.contains("4.0.0b36")  # pip takes the beta
    assert requirement.marker.evaluate({"platform_system": "Linux", "platform_machine": "x86_64"})
    assert not requirement.marker.evaluate({"platform_system": "Linux", "platform_machine": "aarch64"})
    assert not requirement.marker.evaluate({"platform_system": "Darwin", "platform_machine": "arm64"})
