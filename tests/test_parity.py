"""The parity matrix: for every supported architecture and backend, a packed batch gives exactly the logits and
per-token losses of each document run alone (max abs difference <= 1e-5, float32).

The packed batch (`tiny_models.packed_batch`) has two rows of 18 tokens: documents (5, 1, 7, 3) + 2 pad tokens and
(9, 2, 1, 6), so length-1 documents, trailing padding, a row without padding and documents longer than the 4-token
sliding windows / attention chunks of the tiny configs are all covered. The reference runs each document alone
(batch 1, no padding, positions 0..n-1).

sdpa runs both of its routes: `varlen` (per-document SDPA, llm_packing/hook/varlen.py; the test asserts that it is
taken and that no dense mask is built) and `dense` (transformers' own packed mask). eager and flex_attention have one
route.

The unmarked `CORE_MODEL_TYPES` run in every CI pass; the full sweep is marked `slow`.
"""

import pytest
import torch
from tiny_models import PACKED_DOCUMENT_LENGTHS, WINDOW, packed_batch, tiny_model
from transformers import masking_utils

from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook import varlen
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.support.architectures import (
    MATRIX_BACKENDS,
    REFUSED_BACKENDS,
    backend_available,
    sdpa_route,
    supported_model_types,
)


TOLERANCE = 1e-5
CORE_MODEL_TYPES = ("llama", "qwen2", "gemma2", "mixtral", "phi3", "gpt_neox")
ROUTES = {"eager": ("auto",), "sdpa": ("varlen", "dense"), "flex_attention": ("auto",)}
MATRIX = [
    pytest.param(model_type, backend, route, marks=() if model_type in CORE_MODEL_TYPES else pytest.mark.slow)
    for model_type in supported_model_types()
    for backend in MATRIX_BACKENDS
    for route in ROUTES[backend]
]


def _forward(model, **inputs):
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def _token_losses(logits, labels):
    """Per-token next-token loss, as the model's own loss computes it (labels shifted left by one)."""
    return torch.nn.functional.cross_entropy(
        logits[..., :-1, :].flatten(0, -2), labels[..., 1:].flatten(), reduction="none", ignore_index=-100
    ).view(labels[..., 1:].shape)


def _separate(model, batch):
    """Per document: (logits, per-token losses) of the document run alone."""
    results = {}
    for row, spans in enumerate(batch["documents"]):
        for start, length in spans:
            input_ids = batch["input_ids"][row : row + 1, start : start + length]
            logits = _forward(model, input_ids=input_ids, position_ids=torch.arange(length)[None])
            labels = batch["labels"][row : row + 1, start : start + length]
            results[(row, start, length)] = logits[0], _token_losses(logits, labels)[0]
    return results


def _max_differences(model, batch, logits=None, **packed_inputs):
    """Max abs difference of logits and of per-token losses between the packed batch (or its given `logits`) and
    separate documents."""
    if logits is None:
        logits = _forward(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"], **packed_inputs)
    losses = _token_losses(logits, batch["labels"])
    logit_difference = loss_difference = 0.0
    for (row, start, length), (expected_logits, expected_losses) in _separate(model, batch).items():
        logit_difference = max(logit_difference, (logits[row, start : start + length] - expected_logits).abs().max())
        # Within a document, the packed loss at position p is the separate loss at p; the last position of the
        # document predicts the next document's first token, whose label is -100 (loss 0 in both).
        packed_losses = losses[row, start : start + length - 1]
        if length > 1:
            loss_difference = max(loss_difference, (packed_losses - expected_losses).abs().max())
    return float(logit_difference), float(loss_difference)


@pytest.fixture
def static_flex_compile():
    # Compiled flex_attention on CPU fails to build its C++ kernel once dynamo recompiles with dynamic shapes
    # (CppCompileError in torch 2.13's flex template); static shapes compile, and past the recompile limit the
    # same mask runs uncompiled. torch's own `patch`, not monkeypatch: newer pytest undoes a module attribute it did
    # not find in the module's __dict__ by deleting it, which removes the setting from torch's config module.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


@pytest.mark.parametrize(("model_type", "backend", "route"), MATRIX)
def test_packed_batch_equals_separate_documents(model_type, backend, route, static_flex_compile, monkeypatch):
    if not backend_available(model_type, backend):
        with pytest.raises(ValueError, match="does not support"):
            tiny_model(model_type, backend)
        return
    model = tiny_model(model_type, backend)
    if (model_type, backend) in REFUSED_BACKENDS:
        with pytest.raises(UnsupportedSetupError, match=model_type):
            configure_packing_and_undo(model)
        return
    if route == "varlen" and sdpa_route(model.config)[0] == "dense":
        with pytest.raises(UnsupportedSetupError, match="attention_route='varlen'"):
            configure_packing_and_undo(model, attention_route=route)
        return
    batch = packed_batch()
    calls = {}
    _count_calls(calls, monkeypatch, varlen, "packed_sdpa_attention")
    mask_functions = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    _count_calls(calls, monkeypatch, masking_utils, "sdpa_mask", mask_functions)
    with packing_configured(model, attention_route=route):
        packed_inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        logits = _forward(model, **packed_inputs)
        if route == "varlen":
            assert calls["packed_sdpa_attention"] >= 1 and calls["sdpa_mask"] == 0, calls
        if route == "dense":
            assert calls["packed_sdpa_attention"] == 0 and calls["sdpa_mask"] >= 1, calls
        logit_difference, loss_difference = _max_differences(model, batch, logits)
    assert logit_difference <= TOLERANCE, (model_type, backend, route, logit_difference)
    assert loss_difference <= TOLERANCE, (model_type, backend, route, loss_difference)


def _count_calls(calls, monkeypatch, module, name, mapping=None):
    """Count the calls of `module.name` in `calls[name]` (and of its entry in `mapping`, where transformers looks it
    up)."""
    calls[name] = 0
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    for key, value in (mapping or {}).items():
        if value is original:
            monkeypatch.setitem(mapping, key, counted)


def test_model_loss_equals_mean_of_separate_document_losses():
    """The model's own mean loss over the packed batch equals the token mean over documents run alone: document
    starts are not targets of the previous document."""
    model = tiny_model("llama", "sdpa")
    batch = packed_batch()
    with packing_configured(model), torch.no_grad():
        packed = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels")}).loss
    separate = torch.cat([losses for _, losses in _separate(model, batch).values()])
    assert abs(packed.item() - separate.mean().item()) <= TOLERANCE


@pytest.mark.parametrize(("model_type", "backend", "route"), [
    ("llama", "eager", "auto"), ("llama", "sdpa", "varlen"), ("llama", "sdpa", "dense"),
    pytest.param("llama", "flex_attention", "auto", marks=pytest.mark.slow),  # a compile for the new batch shape
    ("qwen2", "sdpa", "dense"), ("gemma2", "eager", "auto"),
])
def test_all_padding_row_leaves_the_other_rows_exact(model_type, backend, route, static_flex_compile):
    """A row without any document (indexed mask all 0, as a batch padded to a fixed number of rows has) between two
    packed rows: the other rows stay exact, no logit or gradient is NaN, and the loss is that of the batch without
    the row. (DataCollatorWithPacking refuses an empty feature, so the batch is built by `packed_batch`.)"""
    model = tiny_model(model_type, backend)
    batch = packed_batch(document_lengths=(PACKED_DOCUMENT_LENGTHS[0], (), PACKED_DOCUMENT_LENGTHS[1]))
    assert batch["attention_mask"][1].eq(0).all() and batch["labels"][1].eq(-100).all()
    keys = ("input_ids", "attention_mask", "position_ids", "labels")
    with packing_configured(model, attention_route=route), torch.set_grad_enabled(backend != "flex_attention"):
        output = model(**{key: batch[key] for key in keys}, use_cache=False)
        if output.loss.requires_grad:  # flex_attention has no backward on CPU
            output.loss.backward()
        with torch.no_grad():
            without_row = model(**{key: batch[key][[0, 2]] for key in keys}, use_cache=False).loss
        logit_difference, loss_difference = _max_differences(model, batch, output.logits.detach())
    assert not output.logits.isnan().any()
    assert all(parameter.grad.isfinite().all() for parameter in model.parameters() if parameter.grad is not None)
    assert logit_difference <= TOLERANCE and loss_difference <= TOLERANCE, (logit_difference, loss_difference)
    assert abs(output.loss.item() - without_row.item()) <= TOLERANCE


@pytest.mark.parametrize(("model_type", "backend"), [("llama", "sdpa"), ("qwen2", "eager"), ("gemma2", "eager")])
def test_indexed_mask_without_hook_is_contaminated(model_type, backend):
    """Negative control: the same batch without `configure_packing` leaks across documents, so the matrix can fail."""
    model = tiny_model(model_type, backend)
    batch = packed_batch()
    logit_difference, _ = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference > 1e-3


@pytest.mark.parametrize(
    "model_type",
    [pytest.param(t, marks=() if t in CORE_MODEL_TYPES else pytest.mark.slow) for t in supported_model_types()],
)
def test_restarting_positions_are_what_the_model_gives_a_document_alone(model_type):
    """The matrix's reference passes positions 0..n-1 to each document, as the collator does to packed documents.
    A model run on a document without `position_ids` must number it the same way, or packing would train it on
    shifted positions that both sides of the matrix share (RoBERTa's family starts at `padding_idx + 1`; see
    `test_natural_positions_check_catches_an_offset`)."""
    difference = _difference_of_given_positions(model_type)
    assert difference <= TOLERANCE, (model_type, difference)


def test_natural_positions_check_catches_an_offset():
    """Negative control for the test above: roberta (refused) numbers a document from `padding_idx + 1`."""
    assert _difference_of_given_positions("roberta") > 1e-2


def _difference_of_given_positions(model_type) -> float:
    """Max abs logit difference of one document run alone without `position_ids` and with 0..n-1."""
    model = tiny_model(model_type, "eager")
    document = packed_batch()["input_ids"][1:, :9]
    given = _forward(model, input_ids=document, position_ids=torch.arange(document.shape[1])[None])
    return float((_forward(model, input_ids=document) - given).abs().max())


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [("bert", "encoder family"), ("roberta", "encoder family"), ("bart", "encoder-decoder"),
     ("marian", "encoder-decoder")],
)
def test_refused_families_leak_with_the_hook(model_type, reason, monkeypatch):
    """The written reasons of two refused families, measured: with the hook forced on (its support check bypassed),
    an encoder's causal-LM class on its default config and an encoder-decoder model's decoder still mix documents."""
    from llm_packing.hook.support import architectures

    assert reason in architectures.refusal_reason(model_type)
    monkeypatch.setattr(architectures, "require_supported", lambda config: None)
    model = tiny_model(model_type, "eager")
    batch = packed_batch()
    with packing_configured(model):
        logit_difference, _ = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference > 1e-3


def test_encoder_family_leak_is_its_bidirectional_attention(monkeypatch):
    """The encoder reason's cause: the same bert with `is_decoder=True` (causal self-attention) is exact under the
    hook, so what the default config leaks through is its bidirectional attention, not the hook."""
    from llm_packing.hook.support import architectures

    monkeypatch.setattr(architectures, "require_supported", lambda config: None)
    model = tiny_model("bert", "eager", is_decoder=True)
    batch = packed_batch()
    with packing_configured(model):
        logit_difference, loss_difference = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference <= TOLERANCE and loss_difference <= TOLERANCE


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "mistral"])
def test_sliding_window_is_crossed(model_type):
    """The tiny sliding-window configs really window (4 tokens) and the packed documents are longer than that,
    so a wrong window would show in the matrix: dropping the window changes the logits."""
    model = tiny_model(model_type, "eager")
    assert model.config.sliding_window == WINDOW
    assert max(max(lengths) for lengths in packed_batch_lengths()) > WINDOW
    unwindowed = tiny_model(model_type, "eager", sliding_window=None if model_type == "mistral" else 64)
    input_ids = packed_batch()["input_ids"][1:, :9]
    assert (_forward(model, input_ids=input_ids) - _forward(unwindowed, input_ids=input_ids)).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["deepseek_v32", "hy_v4"])
def test_sparse_key_indexer_is_selective(model_type):
    """The tiny sparse-attention configs keep 3 keys per query, fewer than the longer documents have, so a document
    mask the indexer ignored would show in the matrix: keeping every key changes the logits."""
    model = tiny_model(model_type, "eager")
    assert model.config.index_topk == 3
    every_key = tiny_model(model_type, "eager", index_topk=64)
    input_ids = packed_batch()["input_ids"][1:, :9]
    assert (_forward(model, input_ids=input_ids) - _forward(every_key, input_ids=input_ids)).abs().max() > 1e-3


def test_qsa_key_indexer_is_selective():
    """qwen4_exp_text's tiny indexer keeps 2 blocks of 2 keys per query, fewer than the longer documents have, so a
    document mask it ignored would show in the matrix: a budget covering every key changes the logits."""
    model = tiny_model("qwen4_exp_text", "eager")
    every_key = tiny_model("qwen4_exp_text", "eager", indexer_budget=64)
    input_ids = packed_batch()["input_ids"][1:, :9]
    assert (_forward(model, input_ids=input_ids) - _forward(every_key, input_ids=input_ids)).abs().max() > 1e-3


def packed_batch_lengths():
    return [[length for _, length in spans] for spans in packed_batch()["documents"]]


def configure_packing_and_undo(model, **options):
    with packing_configured(model, **options):
        pass
