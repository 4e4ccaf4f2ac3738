"""The parity matrix: for every supported architecture and backend, a packed batch gives exactly the logits and
per-token losses of each document run alone (max abs difference <= 1e-5, float32).

The fixed layout (`FIXED_LAYOUT`) has two rows of 18 tokens: documents (5, 1, 7, 3) + 2 pad tokens and (9, 2, 1, 6),
so length-1 documents, trailing padding, a row without padding and documents longer than the 4-token sliding windows
/ attention chunks of the tiny configs are all covered. The reference of a document is the document run alone (batch
1, no padding, positions 0..n-1); its tokens are a prefix of one of `random_layouts.BASE_SEQUENCES`, so that one
forward of those gives every reference where the model is causal (`References` checks that on the longest document
run alone, on eager and sdpa, and runs every document alone where it is not).

Random layouts (`random_layouts.draw_layout`, seeded; a failure prints the seed and the layout) complete it: every
supported type runs issue 25's row and 3 drawn layouts in every CI pass, 9 more in the slow suite, on eager and both
sdpa routes, and a sample of them on flex_attention (see `test_random_layouts_equal_separate_documents`).

sdpa runs both of its routes: `varlen` (per-document SDPA, llm_packing/hook/attention/varlen.py; the test asserts that
it is taken and that no dense mask is built) and `dense` (transformers' own packed mask), and the varlen route as it
runs on CUDA in half precision (`FLASH_OP`: torch's FlashAttention 2 varlen op over the batch in place, through a CPU
stand-in of the op, in float32). eager and flex_attention have one route.

The unmarked `CORE_MODEL_TYPES` run in every CI pass; the full sweep is marked `slow`.
"""

import contextlib
import re

import pytest
import torch
from call_counting import count_calls
from flash_op_stand_in import flash_op_on_cpu
from flex_modes import compiled_flex, traced_flex, untraced_flex
from random_layouts import (
    BASE_SEQUENCES,
    ISSUE_25_LAYOUT,
    MAX_ROW_LENGTH,
    Layout,
    draw_layout,
    longest_window,
    packed_layout_batch,
)
from tiny_models import PACKED_DOCUMENT_LENGTHS, PACKED_ROW_LENGTH, WINDOW, packed_batch, tiny_config, tiny_model
from torch._dynamo.utils import counters
from transformers import masking_utils

from llm_packing.errors import ContaminationError, UnsupportedSetupError
from llm_packing.hook.attention import indexers, varlen
from llm_packing.hook.attention.indexers import INDEXERS
from llm_packing.hook.configure import configure_packing, packing_configured, unconfigure_packing
from llm_packing.hook.documents import SMALLEST_BUCKET
from llm_packing.hook.support.architectures import (
    MATRIX_BACKENDS,
    REFUSED_BACKENDS,
    backend_available,
    sdpa_route,
    supported_model_types,
)


TOLERANCE = 1e-5
CORE_MODEL_TYPES = ("llama", "qwen2", "gemma2", "mixtral", "phi3", "gpt_neox")
# The varlen route as it runs on CUDA in half precision: torch's FlashAttention 2 varlen op over the batch in place,
# here through its CPU stand-in (`flash_op_stand_in.py`), in float32.
FLASH_OP = "varlen, flash op"
ROUTES = {"eager": ("auto",), "sdpa": ("varlen", FLASH_OP, "dense"), "flex_attention": ("auto",)}
MATRIX = [
    pytest.param(model_type, backend, route, marks=() if model_type in CORE_MODEL_TYPES else pytest.mark.slow)
    for model_type in supported_model_types()
    for backend in MATRIX_BACKENDS
    for route in ROUTES[backend]
]
FIXED_LAYOUT = Layout(PACKED_ROW_LENGTH, PACKED_DOCUMENT_LENGTHS)


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


@pytest.mark.parametrize(("model_type", "backend", "route"), MATRIX)
def test_packed_batch_equals_separate_documents(model_type, backend, route, monkeypatch):
    if not backend_available(model_type, backend):
        with pytest.raises(ValueError, match="does not support"):
            tiny_model(model_type, backend)
        return
    model = tiny_model(model_type, backend)
    if (model_type, backend) in REFUSED_BACKENDS:
        with pytest.raises(UnsupportedSetupError, match=model_type):
            configure_packing_and_undo(model)
        return
    if route in ("varlen", FLASH_OP) and sdpa_route(model.config)[0] == "dense":
        with pytest.raises(UnsupportedSetupError, match="attention_route='varlen'"):
            configure_packing_and_undo(model, attention_route=_attention_route(route))
        return
    with untraced_flex():
        references = References(model, [FIXED_LAYOUT], check_prefixes=backend != "flex_attention")
    with traced_flex():  # the hook's mask functions, traced by dynamo for every type
        calls, op_calls = {}, []
        count_calls(calls, monkeypatch, varlen, "packed_sdpa_attention")
        mask_functions = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        count_calls(calls, monkeypatch, masking_utils, "sdpa_mask", mask_functions)
        with packing_configured(model, attention_route=_attention_route(route)), _route_kernel(route, op_calls):
            logit_difference, loss_difference, _ = layout_differences(model, references, FIXED_LAYOUT)
    if route in ("varlen", FLASH_OP):
        assert calls["packed_sdpa_attention"] >= 1 and calls["sdpa_mask"] == 0, calls
    if route == FLASH_OP:
        assert op_calls, "the varlen route never took the FlashAttention op's path"
    if route == "dense":
        assert calls["packed_sdpa_attention"] == 0 and calls["sdpa_mask"] >= 1, calls
    assert logit_difference <= TOLERANCE, (model_type, backend, route, logit_difference)
    assert loss_difference <= TOLERANCE, (model_type, backend, route, loss_difference)


def test_compiled_flex_attention_equals_separate_documents():
    """The matrix runs flex_attention uncompiled; this is transformers' compiled path, the one a GPU runs, on the
    fixed batch (tests/test_image_text_parity.py has Gemma 3's image blocks compiled). The references run uncompiled:
    a compile for every document length would cost about 10 s each with inductor's cache cold."""
    model = tiny_model("llama", "flex_attention")
    batch = packed_batch()
    with packing_configured(model):
        with compiled_flex():
            logits = _forward(model, **{key: batch[key] for key in PACKED_INPUTS})
        with untraced_flex():
            logit_difference, loss_difference = _max_differences(model, batch, logits)
    assert logit_difference <= TOLERANCE and loss_difference <= TOLERANCE, (logit_difference, loss_difference)


def test_the_fixed_matrix_traces_the_mask_functions_and_the_random_layouts_do_not():
    """What the flex cells rely on (tests/flex_modes.py): under `traced_flex` dynamo traces the forward's score and
    mask functions, whole-graph, so a mask function a compile could not take fails the cell; `untraced_flex` runs the
    same kernel with no trace."""
    model = tiny_model("llama", "flex_attention")
    batch = packed_batch()
    traced_graphs = {}
    for mode in (traced_flex, untraced_flex):
        torch._dynamo.reset()  # a forward an earlier test traced would hit dynamo's cache
        counters.clear()
        with mode(), packing_configured(model):
            _forward(model, **{key: batch[key] for key in PACKED_INPUTS})
        traced_graphs[mode.__name__] = counters["stats"]["unique_graphs"]
    assert traced_graphs["traced_flex"] >= 1 and traced_graphs["untraced_flex"] == 0, traced_graphs


# Issue 25's row and 3 drawn layouts in every CI pass; 9 more drawn layouts in the slow suite (12 drawn in all; the
# slow suite was the largest part of CI's time at 17 more). `benchmarks/random_parity.py` runs 20 drawn layouts on
# every type (benchmarks/results/random_parity.md). flex_attention runs a sample of them, unfused and
# untraced (tests/flex_modes.py), without the prefix checks of its references (its eager and sdpa twins check the
# architecture's): about 45 ms a forward of a tiny llama against 2 ms on sdpa. 2 layouts in every pass
# and 3 more in the slow suite.
RANDOM_LAYOUTS = (ISSUE_25_LAYOUT, *map(draw_layout, range(3)))
MORE_RANDOM_LAYOUTS = tuple(map(draw_layout, range(3, 12)))
FLEX_RANDOM_LAYOUTS = RANDOM_LAYOUTS[:2]
MORE_FLEX_RANDOM_LAYOUTS = MORE_RANDOM_LAYOUTS[::4]
PACKED_INPUTS = ("input_ids", "attention_mask", "position_ids")


@pytest.mark.parametrize("model_type", supported_model_types())
def test_random_layouts_equal_separate_documents(model_type):
    """Every supported type on every backend and sdpa route that transformers offers and the hook does not refuse (the
    fixed matrix above asserts those refusals): every document of issue 25's row and of 3 drawn layouts (2 of these 4
    on flex_attention) gives the logits and per-token losses of the document run alone."""
    with untraced_flex():
        _assert_layouts_exact(model_type, RANDOM_LAYOUTS, FLEX_RANDOM_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", supported_model_types())
def test_more_random_layouts_equal_separate_documents(model_type):
    with untraced_flex():
        _assert_layouts_exact(model_type, MORE_RANDOM_LAYOUTS, MORE_FLEX_RANDOM_LAYOUTS)


def _assert_layouts_exact(model_type, layouts, flex_layouts):
    """One model per backend, its references computed before the hook is configured, then every layout on every route:
    one configure in all (configuring sweeps every loaded module). flex_attention takes `flex_layouts`, and its
    references are not checked for the prefix property (the architecture's eager and sdpa references are)."""
    cells = []
    for backend in MATRIX_BACKENDS:
        if not backend_available(model_type, backend) or (model_type, backend) in REFUSED_BACKENDS:
            continue
        model = tiny_model(model_type, backend)
        flex = backend == "flex_attention"
        references = References(model, flex_layouts if flex else layouts, check_prefixes=not flex)
        routes = ROUTES[backend] if backend != "sdpa" or sdpa_route(model.config)[0] == "varlen" else ("dense",)
        cells += [(f"{backend}/{route}", model, route, references, flex_layouts if flex else layouts)
                  for route in routes]
    failures = []
    try:
        for cell, model, route, references, cell_layouts in cells:
            configure_packing(model, attention_route=_attention_route(route))
            with _route_kernel(route):
                failures += [f"{model_type} {cell}, {failure}"
                             for failure in _layout_failures(model, references, cell_layouts)]
    finally:
        unconfigure_packing()
    assert not failures, "packed documents differ from the same documents run alone:\n" + "\n".join(failures)


def _attention_route(route: str) -> str:
    """The `attention_route` a matrix route configures."""
    return "varlen" if route == FLASH_OP else route


def _route_kernel(route: str, calls: list | None = None):
    """Where `route` is `FLASH_OP`, the context that sends the varlen route through the stand-in of torch's
    FlashAttention 2 varlen op, each call appended to `calls`; else nothing."""
    return flash_op_on_cpu(calls) if route == FLASH_OP else contextlib.nullcontext()


def _layout_failures(model, references, layouts) -> list[str]:
    """For each layout whose packed logits or per-token losses differ from its documents' references by more than
    `TOLERANCE`: the layout, the differences and the document that differs most."""
    failures = []
    for layout in layouts:
        logit_difference, loss_difference, (row, start, length) = layout_differences(model, references, layout)
        if max(logit_difference, loss_difference) > TOLERANCE:
            failures.append(
                f"{layout}: differs by {logit_difference:.2e} (logits), {loss_difference:.2e} (losses), most in the "
                f"document at row {row}, start {start}, length {length}"
            )
    return failures


def layout_differences(model, references, layout) -> tuple[float, float, tuple[int, int, int]]:
    """Max abs differences of logits and of per-token losses between `layout`'s packed batch on `model` (as
    configured) and its documents' `references`, and the document `(row, start, length)` that differs most."""
    batch = packed_layout_batch(layout)
    logits = _forward(model, **{key: batch[key] for key in PACKED_INPUTS})
    losses = _token_losses(logits, batch["labels"])
    logit_max = loss_max = worst = 0.0
    worst_document = (0, 0, 0)
    for row, spans in enumerate(batch["documents"]):
        for start, length, base in spans:
            expected = references(base, length)
            logit_difference = float((logits[row, start : start + length] - expected).abs().max())
            loss_difference = 0.0
            if length > 1:
                expected_losses = _token_losses(expected[None], batch["labels"][row : row + 1, start : start + length])
                loss_difference = float((losses[row, start : start + length - 1] - expected_losses[0]).abs().max())
            logit_max, loss_max = max(logit_max, logit_difference), max(loss_max, loss_difference)
            if max(logit_difference, loss_difference) > worst:
                worst, worst_document = max(logit_difference, loss_difference), (row, start, length)
    return logit_max, loss_max, worst_document


class References:
    """
    The logits of every document of `layouts` run alone on `model` (batch 1, positions 0..n-1, no mask), computed
    when built, before the hook is configured.

    A document is a prefix of one of `random_layouts.BASE_SEQUENCES`. Where the model's output at a token does not
    depend on the tokens after it, one forward of the base sequences gives every reference: the first n logits of a
    base sequence are those of its n-token prefix alone. That property is checked on the longest document of every
    layout, run alone (unless `check_prefixes` is False). A DeepSeek sparse key indexer (`index_topk`) does not have
    it: its `torch.topk` ranks the whole row, masked future keys included, and which of several tied keys it keeps
    depends on the row's length. For those models every distinct document runs alone.
    """

    def __init__(self, model, layouts, check_prefixes: bool = True):
        self.model = model
        self.alone = {}
        self.prefixes = None
        text_config = model.config.get_text_config()
        if getattr(text_config, "index_topk", None) is None:
            positions = torch.arange(MAX_ROW_LENGTH).expand(len(BASE_SEQUENCES), -1)
            self.prefixes = _forward(model, input_ids=BASE_SEQUENCES, position_ids=positions)
        for layout in layouts:
            documents = [document for spans in packed_layout_batch(layout)["documents"] for document in spans]
            for _, length, base in documents:
                self(base, length)
            if check_prefixes:
                _, length, base = max(documents, key=lambda document: document[1])
                self._check_prefix(base, length)

    def __call__(self, base: int, length: int) -> torch.Tensor:
        if self.prefixes is not None:
            return self.prefixes[base, :length]
        return self._alone(base, length)

    def _alone(self, base: int, length: int) -> torch.Tensor:
        if (base, length) not in self.alone:
            input_ids, positions = BASE_SEQUENCES[base : base + 1, :length], torch.arange(length)[None]
            self.alone[base, length] = _forward(self.model, input_ids=input_ids, position_ids=positions)[0]
        return self.alone[base, length]

    def _check_prefix(self, base: int, length: int) -> None:
        if self.prefixes is None:
            return
        difference = float((self._alone(base, length) - self.prefixes[base, :length]).abs().max())
        assert difference <= TOLERANCE, (
            f"{self.model.config.model_type}: the first {length} logits of base sequence {base} differ from its "
            f"{length}-token prefix run alone by {difference:.2e}: the model's outputs depend on later tokens or on "
            "the row's length, so prefixes cannot be its references. Run its documents alone, as for `index_topk`."
        )


def test_random_layouts_cross_every_window_and_hold_every_kind_of_row():
    """In each suite's drawn layouts: a document longer than every window of every supported tiny config and than
    the bucket boundary in every layout; rows of different fill in every layout of several documents a row, and a
    batch of one document a row with trailing padding and two rows of the same length (issue 35); somewhere one-token
    documents, a row filled by one document, a row of many tiny documents and trailing padding."""
    windows = {model_type: longest_window(tiny_config(model_type)) for model_type in supported_model_types()}
    for layouts in (RANDOM_LAYOUTS[1:], MORE_RANDOM_LAYOUTS):
        for layout in layouts:
            assert max(max(row) for row in layout.rows) > max(SMALLEST_BUCKET, *windows.values()), str(layout)
            fills = [sum(row) for row in layout.rows]
            assert len(set(fills)) == len(fills) or max(map(len, layout.rows)) == 1, str(layout)
        assert any(
            max(map(len, layout.rows)) == 1 and len(layout.rows) > 1 and sum(layout.rows[0]) < layout.row_length
            and any(earlier == later for earlier, later in zip(layout.rows, layout.rows[1:], strict=False))
            for layout in layouts
        )
        rows = [(layout.row_length, row) for layout in layouts for row in layout.rows]
        assert any(1 in row for _, row in rows)
        assert any(row == (row_length,) for row_length, row in rows)
        assert any(len(row) >= 8 and max(row) <= 3 for _, row in rows)
        assert any(sum(row) < row_length for row_length, row in rows)


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
    ("llama", "flex_attention", "auto"), ("qwen2", "sdpa", "dense"), ("gemma2", "eager", "auto"),
])
def test_all_padding_row_leaves_the_other_rows_exact(model_type, backend, route):
    """A row without any document (indexed mask all 0, as a batch padded to a fixed number of rows has) between two
    packed rows: the other rows stay exact, no logit or gradient is NaN, and the loss is that of the batch without
    the row. (DataCollatorWithPacking refuses an empty feature, so the batch is built by `packed_batch`.)"""
    model = tiny_model(model_type, backend)
    batch = packed_batch(document_lengths=(PACKED_DOCUMENT_LENGTHS[0], (), PACKED_DOCUMENT_LENGTHS[1]))
    assert batch["attention_mask"][1].eq(0).all() and batch["labels"][1].eq(-100).all()
    keys = ("input_ids", "attention_mask", "position_ids", "labels")
    with (traced_flex(), packing_configured(model, attention_route=route),
          torch.set_grad_enabled(backend != "flex_attention")):
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


# Types whose models build their attention masks without `position_ids`, on a backend with a mask: transformers'
# padding-free path, which isolates documents from the positions the builders get, mixed their documents (measured
# max logit differences on the fixed layout, unconfigured: afmoe 0.87, gpt_oss 0.51, mpt 0.59, opt 0.42, biogpt 0.16,
# bloom 1.8e-2).
POSITIONLESS_BUILDERS = [("afmoe", "sdpa"), ("gpt_oss", "eager"), ("mpt", "eager"), ("opt", "sdpa"),
                         ("biogpt", "eager"), ("bloom", "eager")]


@pytest.mark.parametrize(("model_type", "backend"), POSITIONLESS_BUILDERS)
def test_padding_free_batches_are_refused_where_the_mask_builders_get_no_positions(model_type, backend):
    """A padding-free batch (`position_ids` restarting within the row, no mask or a 0/1 one: TRL's `padding_free`,
    `DataCollatorWithFlattening`) on a model whose mask builders are handed no `position_ids`: the documents attend to
    each other unconfigured, and the configured model refuses the batch, training or not, while the indexed mask of
    the same documents stays exact."""
    model = tiny_model(model_type, backend)
    batch = packed_batch()
    assert _max_differences(model, batch)[0] > 1e-2
    with packing_configured(model):
        for training, mask in ((True, None), (False, None), (False, batch["attention_mask"].clamp(max=1))):
            model.train(training)
            with pytest.raises(ContaminationError, match=f"model_type {model_type!r} builds its attention mask"):
                model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                      use_cache=False)
        model.eval()
        assert max(_max_differences(model, batch, attention_mask=batch["attention_mask"])) <= TOLERANCE
        model(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False)


def test_padding_free_batches_stay_exact_where_the_mask_builders_get_the_positions():
    """The refusal above is for models that hand their builders no `position_ids`: Llama's builders get them, and
    transformers' padding-free path isolates its documents (as TRL's `padding_free` relies on)."""
    model = tiny_model("llama", "sdpa")
    batch = packed_batch()
    with packing_configured(model):
        assert max(_max_differences(model, batch)) <= TOLERANCE


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


@pytest.mark.parametrize(
    ("model_type", "overrides", "leak"),
    [
        ("inkling_text", {"log_scaling_n_floor": 4, "log_scaling_alpha": 1.0}, 5e-5),
        ("gemma", {"use_bidirectional_attention": True}, 1e-2),
        ("gemma4_text", {"use_bidirectional_attention": "all"}, 1e-1),
        ("gemma4_unified_text", {"use_bidirectional_attention": "all"}, 1e-1),
    ],
)
def test_refused_config_values_are_refused_and_leak_with_the_hook(model_type, overrides, leak, monkeypatch):
    """Each of `REFUSED_CONFIG_VALUES` (off by default): configuring refuses it with its reason, and with the support
    check bypassed the packed documents differ from each document alone (sdpa, the fixed layout)."""
    from llm_packing.hook.support import architectures

    model = tiny_model(model_type, "sdpa", **overrides)
    field, value = next(iter(overrides.items()))
    with pytest.raises(UnsupportedSetupError, match=re.escape(f"`{field}`={value!r}: ")):
        configure_packing_and_undo(model)
    monkeypatch.setattr(architectures, "require_supported", lambda config: None)
    batch = packed_batch()
    with packing_configured(model):
        logit_difference, _ = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference > leak


def test_the_values_refused_for_gemma_4_leave_its_vision_bidirectional_setting_packed():
    """`use_bidirectional_attention="vision"` (image tokens only) is not refused: text-only packed rows stay exact."""
    model = tiny_model("gemma4_text", "sdpa", use_bidirectional_attention="vision")
    batch = packed_batch()
    with packing_configured(model):
        assert max(_max_differences(model, batch, attention_mask=batch["attention_mask"])) <= TOLERANCE


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


@pytest.mark.parametrize("model_type", sorted(INDEXERS))
def test_sparse_key_indexer_is_selective(model_type):
    """The tiny sparse-attention configs keep 3 keys per query, fewer than the longer documents have, so a document
    mask the indexer ignored, or a tied key it kept by the packed row, would show in the matrix: keeping every key
    changes the logits."""
    model = tiny_model(model_type, "eager")
    assert model.config.get_text_config().index_topk == 3
    every_key_topk = {"index_topk": 64}
    config = tiny_config(model_type)
    if config.get_text_config() is not config:  # a multimodal config: the indexer is its text model's
        every_key_topk = {"text_config": every_key_topk}
    every_key = tiny_model(model_type, "eager", **every_key_topk)
    assert every_key.config.get_text_config().index_topk == 64
    input_ids = packed_batch()["input_ids"][1:, :9]
    assert (_forward(model, input_ids=input_ids) - _forward(every_key, input_ids=input_ids)).abs().max() > 1e-3


def test_random_layouts_catch_an_indexer_that_ranks_the_packed_row(monkeypatch):
    """Negative control for the random layouts: deepseek_v32's indexer left as transformers has it (ranking the whole
    packed row, where tied keys fall otherwise than alone) fails the layouts of every CI pass, while the fixed layout
    passes it."""
    monkeypatch.setattr(indexers, "patch_indexers", lambda model_type: None)
    model = tiny_model("deepseek_v32", "eager")
    references = References(model, RANDOM_LAYOUTS)
    batch = packed_batch()
    with packing_configured(model):
        failures = _layout_failures(model, references, RANDOM_LAYOUTS)
        fixed_layout_differences = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert failures
    assert max(fixed_layout_differences) <= TOLERANCE


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
