"""The varlen route's mechanics: its layout, one layout per forward, gradients equal to the dense route, torch's
varlen kernel wrapper (through a CPU stand-in of the same signature), the route switch and its refusals. Exactness per
architecture is tests/test_parity.py (route axis); memory is the slow test at the end."""

import inspect
import itertools
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from flash_op_stand_in import flash_op_on_cpu, flash_op_stand_in
from tiny_models import packed_batch, tiny_model

from llm_packing import (
    PackingValueError,
    UnsupportedSetupError,
    configure_packing,
    packing_configured,
    unconfigure_packing,
)
from llm_packing.cli.arguments import PackingArguments
from llm_packing.hook import documents
from llm_packing.hook.attention import flash_op, route as route_switch, varlen
from llm_packing.hook.attention.varlen import PackedAttentionMask


MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2, 2, 2, 2, 2]])
INPUTS = ("input_ids", "attention_mask", "position_ids")


def _flat_spans(layout):
    """(flat start, length) of every attended piece, from `destination` and `cu_seqlens`."""
    bounds = layout.cu_seqlens.tolist()
    return sorted((int(layout.destination[a]), b - a) for a, b in itertools.pairwise(bounds))


class TestLayout:
    def test_every_real_token_once_and_no_padding(self):
        layout = PackedAttentionMask.from_indexed_mask(MASK)
        assert sorted(layout.destination.tolist()) == torch.nonzero(MASK.flatten()).flatten().tolist()
        assert _flat_spans(layout) == [(0, 7), (7, 2), (10, 2), (12, 8)]
        assert layout.max_seqlen == 8

    def test_chunks_cut_documents_into_pieces(self):
        layout = PackedAttentionMask.from_indexed_mask(MASK, chunk=3)
        assert _flat_spans(layout) == [(0, 3), (3, 3), (6, 1), (7, 2), (10, 2), (12, 3), (15, 3), (18, 2)]

    def test_buckets_group_lengths_within_the_ratio(self, monkeypatch):
        monkeypatch.setattr(documents, "SMALLEST_BUCKET", 1)
        layout = PackedAttentionMask.from_indexed_mask(MASK)
        # Lengths 8 and 7 share a bucket (8 / 7 < 1.25); 2 and 2 share the next.
        assert [tuple(bucket.shape) for bucket in layout.buckets] == [(2, 8), (2, 2)]
        padded = torch.cat([bucket.flatten() for bucket in layout.buckets])
        assert torch.equal(padded[layout.source], layout.destination)

    def test_outputs_match_per_document_sdpa_with_window_and_gqa(self):
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(2, 4, 10, 8, generator=generator)
        key, value = (torch.randn(2, 2, 10, 8, generator=generator) for _ in range(2))
        window = 3
        layout = varlen.packed_attention_mask(MASK, window=window)
        output = varlen.packed_sdpa_attention(torch.nn.Module(), query, key, value, layout)
        for start, length in _flat_spans(layout):
            row, column = divmod(start, MASK.shape[1])
            steps = torch.arange(length)
            band = (steps[:, None] >= steps[None]) & (steps[:, None] - steps[None] < window)
            parts = [t[row : row + 1, :, column : column + length] for t in (query, key, value)]
            expected = torch.nn.functional.scaled_dot_product_attention(*parts, attn_mask=band, enable_gqa=True)
            assert torch.allclose(output[row, column : column + length], expected[0].transpose(0, 1), atol=1e-6)
        assert torch.count_nonzero(output[0, 9]) == 0  # padding


def test_layout_is_built_once_per_forward_not_per_layer(monkeypatch):
    """qwen2 here has a sliding and a full-attention mask type and 4 layers: one layout per forward."""
    built = []
    original = PackedAttentionMask.from_indexed_mask.__func__
    monkeypatch.setattr(PackedAttentionMask, "from_indexed_mask",
                        classmethod(lambda cls, *a, **k: built.append(1) or original(cls, *a, **k)))
    attended = []
    monkeypatch.setattr(varlen, "packed_sdpa_attention",
                        lambda *a, _f=varlen.packed_sdpa_attention, **k: attended.append(1) or _f(*a, **k))
    model = tiny_model("qwen2", "sdpa", num_hidden_layers=4,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    batch = packed_batch()
    with packing_configured(model), torch.no_grad():
        for forward in (1, 2):
            model(**{key: batch[key].clone() for key in INPUTS})
            assert (len(built), len(attended)) == (forward, 4 * forward)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_5_text"])
def test_one_host_copy_of_the_mask_per_forward(monkeypatch, model_type):
    """The mask builders (qwen2: a sliding and a full one), the varlen layout and a hybrid's mixers (qwen3_5_text:
    gated delta nets) share one device-to-host copy of the mask and its positions per forward."""
    copies = []
    monkeypatch.setattr(documents, "_to_host", lambda tensor, _f=documents._to_host: copies.append(1) or _f(tensor))
    sliding = {"layer_types": ["sliding_attention", "full_attention"]} if model_type == "qwen2" else {}
    model = tiny_model(model_type, "sdpa", **sliding)
    batch = packed_batch()
    with packing_configured(model), torch.no_grad():
        for forward in (1, 2):
            model(**{key: batch[key].clone() for key in INPUTS})
            assert len(copies) == forward
        model(**{key: batch[key].clone() for key in INPUTS if key != "position_ids"})  # numbered by the hook
        assert len(copies) == 3


# One 12-token row read with two layouts: a forward's mask, and what the same memory is refilled with before the next.
FIRST_LAYOUT, REFILLED_LAYOUT = torch.tensor([[1] * 6 + [2] * 6]), torch.tensor([[1] * 2 + [2] * 10])
ROW_IDS = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))


def assert_a_refilled_buffer_is_read_again(model, between=None):
    """On configured `model`: a forward on a numpy buffer holding `FIRST_LAYOUT` (then `between(buffer)`), the buffer
    refilled in place with `REFILLED_LAYOUT` (no version bump): the next forward gives that layout's logits."""
    with torch.no_grad():
        expected = model(input_ids=ROW_IDS, attention_mask=REFILLED_LAYOUT.clone()).logits
        buffer = FIRST_LAYOUT.numpy().copy()
        model(input_ids=ROW_IDS, attention_mask=torch.from_numpy(buffer))
        if between is not None:
            between(buffer)
        buffer[:] = REFILLED_LAYOUT.numpy()
        assert torch.equal(model(input_ids=ROW_IDS, attention_mask=torch.from_numpy(buffer)).logits, expected)


@pytest.mark.parametrize("rewrite", ["numpy_buffer", "numpy_view", "data"])
def test_a_mask_rewritten_without_a_version_bump_is_read_again(rewrite):
    """Writes that leave a tensor's version as it was between two forwards (a collate function refilling one numpy
    buffer behind `torch.from_numpy`, writes through `.numpy()` or `.data`): the second forward reads its own
    documents, not the first one's (it did: 0.25 off alone on this Llama)."""
    model = tiny_model("llama", "sdpa")
    with packing_configured(model):
        if rewrite == "numpy_buffer":
            assert_a_refilled_buffer_is_read_again(model)
            return
        with torch.no_grad():
            expected = model(input_ids=ROW_IDS, attention_mask=REFILLED_LAYOUT.clone()).logits
            mask = FIRST_LAYOUT.clone()
            model(input_ids=ROW_IDS, attention_mask=mask)
            if rewrite == "numpy_view":
                mask.numpy()[:] = REFILLED_LAYOUT.numpy()
            else:
                mask.data.copy_(REFILLED_LAYOUT)
            assert torch.equal(model(input_ids=ROW_IDS, attention_mask=mask).logits, expected)


def test_a_forward_after_an_interrupted_one_reads_its_own_documents():
    """A `KeyboardInterrupt` inside a forward skips the hook that ends it (torch runs those on `Exception`s only): the
    next forward still starts from no documents, and reads a mask rewritten in place (a numpy buffer) again."""
    model = tiny_model("llama", "sdpa")

    def interrupted_forward(buffer):
        def interrupt(*args):
            raise KeyboardInterrupt

        handle = model.model.layers[1].register_forward_hook(interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=ROW_IDS, attention_mask=torch.from_numpy(buffer))
        finally:
            handle.remove()

    with packing_configured(model):
        assert_a_refilled_buffer_is_read_again(model, between=interrupted_forward)
    assert not documents.forwards_running_elsewhere()


def test_forwards_after_unconfiguring_inside_one_read_their_own_documents():
    """`unconfigure_packing()` inside a forward removes the hook that ends it: the next model configured still starts
    each forward from no documents (a mask rewritten in place is read again), and another thread may unconfigure."""
    model = configure_packing(tiny_model("llama", "sdpa"))
    handle = model.model.norm.register_forward_hook(lambda *args: unconfigure_packing())  # after the layers
    with torch.no_grad():
        model(input_ids=ROW_IDS, attention_mask=FIRST_LAYOUT)
    handle.remove()
    other = tiny_model("qwen2", "sdpa")
    with packing_configured(other):
        assert_a_refilled_buffer_is_read_again(other)
        assert not documents.forwards_running_elsewhere()


def test_inference_tensors_rewritten_in_place_for_a_model_configured_from_its_config():
    """Configured from its config, a model has no forward hooks: an inference tensor (no version count) refilled in
    place between forwards must not pass for the previous forward's mask (it ran on that layout: 0.52 off)."""
    from llm_packing.hook.masks import document_position_ids

    model = tiny_model("llama", "sdpa")
    configure_packing(model.config)
    try:
        with torch.inference_mode():
            expected = model(input_ids=ROW_IDS, attention_mask=REFILLED_LAYOUT.clone(),
                             position_ids=document_position_ids(REFILLED_LAYOUT)).logits
            mask, positions = FIRST_LAYOUT.clone(), document_position_ids(FIRST_LAYOUT)
            model(input_ids=ROW_IDS, attention_mask=mask, position_ids=positions)
            mask.copy_(REFILLED_LAYOUT)
            positions.copy_(document_position_ids(REFILLED_LAYOUT))
            assert torch.equal(model(input_ids=ROW_IDS, attention_mask=mask, position_ids=positions).logits, expected)
    finally:
        unconfigure_packing()


def test_a_bool_mask_without_positions_costs_no_host_copy(monkeypatch):
    """The restarting-positions check of a bool or float 0/1 mask reads the positions on the host: only where a
    forward gives positions of the whole row (not while decoding, nor without them)."""
    copies = []
    monkeypatch.setattr(documents, "_to_host", lambda tensor, _f=documents._to_host: copies.append(1) or _f(tensor))
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with packing_configured(model), torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones(2, 8, dtype=torch.bool))
        model(input_ids=ids, attention_mask=torch.ones(2, 8))
        assert not copies
        model.generate(ids, attention_mask=torch.ones(2, 8, dtype=torch.bool), max_new_tokens=3, do_sample=False)
        assert not copies


def test_inference_mode_forwards_equal_no_grad_ones_with_one_host_copy(monkeypatch):
    """Tensors made under `torch.inference_mode()` keep no version count (reading one raised, for packed and 0/1
    masks alike): they are recognised by their storage within their forward."""
    model = tiny_model("qwen2", "sdpa", layer_types=["sliding_attention", "full_attention"])
    batch = packed_batch()
    unpacked = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].ne(0).long()}
    with packing_configured(model):
        with torch.no_grad():
            expected = [model(**{key: batch[key] for key in INPUTS}).logits, model(**unpacked).logits]
        copies = []
        monkeypatch.setattr(documents, "_to_host",
                            lambda tensor, _f=documents._to_host: copies.append(1) or _f(tensor))
        with torch.inference_mode():
            assert torch.equal(model(**{key: batch[key].clone() for key in INPUTS}).logits, expected[0])
            assert len(copies) == 1
            assert torch.equal(model(**{key: value.clone() for key, value in unpacked.items()}).logits, expected[1])


def test_gradients_equal_the_dense_route():
    model = tiny_model("qwen2", "sdpa").train()
    batch = packed_batch()
    gradients = {}
    for route in ("varlen", "dense"):
        model.zero_grad()
        with packing_configured(model, attention_route=route):
            model(**{key: batch[key] for key in (*INPUTS, "labels")}).loss.backward()
        gradients[route] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert (gradients["varlen"] - gradients["dense"]).abs().max() <= 1e-5


def test_torch_flash_varlen_op_with_a_cpu_stand_in():
    """On CUDA in half precision the route calls torch's FlashAttention 2 varlen op once per layer over every
    document, grouped-query key and value heads as they are (no copies), the sliding window as its left edge. (The
    parity matrix runs every type through the stand-in too: `test_parity.FLASH_OP`.)"""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    stand_in = flash_op_stand_in()
    assert list(inspect.signature(stand_in).parameters) == [argument.name for argument in schema.arguments]
    model = tiny_model("qwen2", "sdpa")
    batch = packed_batch()
    calls = []
    with packing_configured(model), torch.no_grad():
        expected = model(**{key: batch[key] for key in INPUTS}).logits
        with flash_op_on_cpu(calls):
            logits = model(**{key: batch[key] for key in INPUTS}).logits
    assert len(calls) == 2  # one call per layer, every document at once
    assert {window for _, _, window, _ in calls} == {(3, 0), (-1, 0)}  # sliding layer: window 4 = 3 back + itself
    # The whole batch in place: the documents and row 0's two padding tokens as segments, no gather or scatter.
    assert calls[0][0] == [0, 5, 6, 13, 16, 18, 27, 29, 30, 36]
    assert calls[0][1] == 9  # the longest document
    assert all(heads == model.config.num_key_value_heads for *_, heads in calls)
    real = batch["attention_mask"] > 0
    assert (logits - expected)[real].abs().max() <= 1e-5


def test_the_flash_op_runs_only_where_its_kernel_does(monkeypatch):
    """CUDA, half precision (the inputs' own or autocast's), head dims in multiples of 8 up to 256, sm80 or newer, and
    a torch whose op takes a sliding window; elsewhere the per-document SDPA route runs."""
    def tensor(dim=64, dtype=torch.bfloat16, is_cuda=True):  # what the check reads
        return types.SimpleNamespace(is_cuda=is_cuda, dtype=dtype, shape=(1, 2, 4, dim),
                                     device=types.SimpleNamespace(index=0, type="cuda" if is_cuda else "cpu"))

    runs = lambda query, dropout=0.0: flash_op.flash_varlen_dtype(query, query, query, dropout)  # noqa: E731
    monkeypatch.setattr(flash_op, "_flash_capable", lambda index: True)
    assert runs(tensor()) == torch.bfloat16 and runs(tensor(dtype=torch.float16)) == torch.float16
    for query in (tensor(is_cuda=False), tensor(dtype=torch.float32), tensor(dim=20), tensor(dim=512)):
        assert runs(query) is None
    assert runs(tensor(), dropout=0.1) is None
    # Under autocast sdpa computes in autocast's dtype, whatever its inputs' (float64 aside): so does the op.
    autocast = {"cuda": torch.bfloat16}
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: device_type in autocast)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: autocast[device_type])
    assert runs(tensor(dtype=torch.float32)) == torch.bfloat16 and runs(tensor(dtype=torch.float16)) == torch.bfloat16
    assert runs(tensor(dtype=torch.float64)) is None and runs(tensor(dtype=torch.float32, is_cuda=False)) is None
    monkeypatch.setattr(flash_op, "_flash_capable", lambda index: False)  # a T4, or ROCm
    assert runs(tensor()) is None
    monkeypatch.setattr(flash_op, "_flash_capable", lambda index: True)
    monkeypatch.setattr(flash_op, "flash_varlen_op", lambda: None)  # a torch whose op has no sliding window
    assert runs(tensor()) is None


def test_under_autocast_the_flash_op_gets_every_input_in_autocasts_dtype(monkeypatch):
    """`Trainer(bf16=True)` on float32 weights: the rotary embedding hands attention float32 query and key and a
    bfloat16 value. The op then gets all three in bfloat16 (CPU autocast and a stand-in of the op here, the same
    code as on CUDA), as sdpa would, and the packed logits equal the per-document route's under the same autocast."""
    calls, dtypes = [], []
    stand_in = flash_op_stand_in(calls)

    def recording(query, key, value, *args, **kwargs):
        dtypes.append((query.dtype, key.dtype, value.dtype))
        return stand_in(query, key, value, *args, **kwargs)

    inputs, choose = [], flash_op.flash_varlen_dtype

    def choosing(query, key, value, dropout):
        inputs.append((query.dtype, key.dtype, value.dtype))
        return choose(query, key, value, dropout)

    model = tiny_model("llama", "sdpa")
    batch = packed_batch()
    with packing_configured(model), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**{key: batch[key] for key in INPUTS}).logits
        monkeypatch.setattr(flash_op, "_on_flash_capable_gpu", lambda query: True)
        monkeypatch.setattr(flash_op, "flash_varlen_op", lambda: recording)
        monkeypatch.setattr(varlen, "flash_varlen_dtype", choosing)  # where the route calls it
        logits = model(**{key: batch[key] for key in INPUTS}).logits
    assert set(inputs) == {(torch.float32, torch.float32, torch.bfloat16)}
    assert len(calls) == model.config.num_hidden_layers
    assert set(dtypes) == {(torch.bfloat16,) * 3}
    real = batch["attention_mask"] > 0
    assert (logits.float() - expected.float())[real].abs().max() <= 2e-2  # bfloat16 computed twice, not a leak


def test_this_torch_has_the_flash_op_with_autograd():
    """The op the CUDA path calls exists here with its window arguments, and autograd knows its backward."""
    op = flash_op.flash_varlen_op()
    assert op is torch.ops.aten._flash_attention_forward
    query = torch.zeros(6, 4, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    key = torch.zeros(6, 2, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    segments = torch.tensor([0, 2, 6], dtype=torch.int32, device="meta")
    output = op(query, key, key, segments, segments, 4, 4, 0.0, True, False, scale=0.25, window_size_left=-1,
                window_size_right=0)[0]
    assert output.shape == query.shape and type(output.grad_fn).__name__ == "FlashAttentionBackward0"


def test_auto_takes_the_dense_route_where_it_is_faster(monkeypatch):
    """`attention_route="auto"` builds transformers' dense mask where `auto_takes_dense` says so (on CUDA for rows up
    to 4,096 tokens and heads up to 128 wide; a CPU batch stands in for one here), and the varlen layout elsewhere;
    both exact. The rule is asked with the batch's device and row length and the model's head dim."""
    model = tiny_model("qwen2", "sdpa")
    batch = packed_batch()
    layouts, asked = [], []
    monkeypatch.setattr(varlen, "packed_sdpa_attention", _recording(varlen.packed_sdpa_attention, layouts))
    logits = {}
    for dense in (False, True):
        def rule(device_type, length, head_dim, dense=dense):
            asked.append((device_type, length, head_dim))
            return dense

        monkeypatch.setattr(route_switch, "auto_takes_dense", rule)
        layouts.clear()
        with packing_configured(model, attention_route="auto"), torch.no_grad():
            logits[dense] = model(**{key: batch[key] for key in INPUTS}).logits
        assert bool(layouts) != dense
    assert set(asked) == {("cpu", batch["input_ids"].shape[1], 16)}  # tiny qwen2: hidden 64 over 4 heads
    real = batch["attention_mask"] > 0
    assert (logits[True] - logits[False])[real].abs().max() <= 1e-5


def _recording(function, calls: list):
    def recorded(*args, **kwargs):
        calls.append(args[4])
        return function(*args, **kwargs)

    return recorded


class TestRouteSwitch:
    def test_unknown_route_is_refused_with_the_allowed_set(self):
        model = tiny_model("llama", "sdpa")
        with pytest.raises(PackingValueError, match=r"\('auto', 'varlen', 'dense'\), got 'fast'"):
            configure_packing(model, attention_route="fast")
        with pytest.raises(PackingValueError, match="attention_route"):
            PackingArguments(attention_route="fast")

    @pytest.mark.parametrize(("model_type", "backend", "reason"),
                             [("falcon", "sdpa", "ALiBi"), ("llama", "eager", "sdpa only")])
    def test_varlen_is_refused_where_it_cannot_run(self, model_type, backend, reason):
        with pytest.raises(UnsupportedSetupError, match=reason):
            with packing_configured(tiny_model(model_type, backend), attention_route="varlen"):
                pass

    def test_softcapping_keeps_the_dense_route(self):
        from tiny_models import tiny_config

        from llm_packing.hook.support.architectures import sdpa_route

        assert sdpa_route(tiny_config("gemma2")) == ("dense", "attention logit softcapping, which SDPA cannot apply")
        assert sdpa_route(tiny_config("llama")) == ("varlen", None)

    def test_a_feature_sdpa_cannot_express_fails_closed(self):
        layout = varlen.packed_attention_mask(MASK)
        query = torch.zeros(2, 2, 10, 4)
        with pytest.raises(UnsupportedSetupError, match="softcap"):
            varlen.packed_sdpa_attention(torch.nn.Module(), query, query, query, layout, softcap=30.0)

    def test_configuring_again_keeps_a_forced_route(self):
        """PackedSFTTrainer configures the model it is given: a recipe's `attention_route: dense` must survive that."""
        model = tiny_model("llama", "sdpa")
        with packing_configured(model, attention_route="dense"):
            configure_packing(model)
            assert route_switch._route == "dense"
        assert route_switch._route == "auto"
        with packing_configured(model):
            assert route_switch._route == "auto"

    def test_unconfigure_restores_transformers_sdpa(self):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        with packing_configured(tiny_model("llama", "sdpa")):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is varlen.sdpa_attention_forward
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from llm_packing import configure_packing
    length, documents, route = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
                                  use_cache=False, attn_implementation="sdpa")
    model = configure_packing(AutoModelForCausalLM.from_config(config), attention_route=route)
    ids = torch.arange(length) * documents // length + 1
    starts = torch.searchsorted(ids, ids, right=False)
    batch = dict(input_ids=torch.randint(0, 128, (1, length)), attention_mask=ids[None],
                 position_ids=(torch.arange(length) - starts)[None])
    batch["labels"] = batch["input_ids"].masked_fill(batch["position_ids"] == 0, -100)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model(**batch).loss.backward()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
""")


def peak_rss_rise_mib(length: int, documents: int, route: str) -> float:
    """Peak RSS rise (MiB) of one forward + backward of a 1-layer tiny Llama on one packed row, in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(length), str(documents), route],
                            capture_output=True, text=True, check=True, env=environment)
    return float(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_32k_row_of_256_documents_raises_peak_rss_by_at_most_512_mib():
    assert peak_rss_rise_mib(32_768, 256, "varlen") <= 512
