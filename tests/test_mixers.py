"""Hybrid models: the non-attention mixers (gated delta net, Mamba2 and Mamba SSMs, short convolutions) run each
document alone under the hook, and leak without it.

The parity matrix (tests/test_parity.py) proves every verified hybrid on every backend; these tests keep one
architecture per mixer kind in every CI pass, and check the guards: caches refused, unknown mixers refused, originals
restored, `verify_packing` catching a mixer that is not isolated, gradients through checkpointed mixers.
"""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from test_parity import TOLERANCE, _max_differences, _token_losses
from tiny_models import PACKED_DOCUMENT_LENGTHS, packed_batch, tiny_model

from llm_packing import DataCollatorWithPacking, verify_packing
from llm_packing.errors import ContaminationError, UnsupportedSetupError
from llm_packing.hook import documents, mixers, registry
from llm_packing.hook.configure import configure_packing, packing_configured, unconfigure_packing
from llm_packing.hook.mixers import MIXERS, DocumentBatches


# One architecture per mixer kind, with the backend it runs here.
MIXER_KINDS = {
    "gated delta net": ("qwen3_5_text", "sdpa"),
    "mamba2 ssm": ("nemotron_h", "sdpa"),
    "mamba2 ssm, no attention": ("mamba2", "eager"),
    "mamba ssm": ("jamba", "sdpa"),
    "short conv": ("lfm2", "sdpa"),
    "lightning attention": ("minimax", "sdpa"),
    "kimi delta attention": ("bailing_hybrid", "sdpa"),
    "short conv on keys and values": ("inkling_text", "eager"),
    "rg-lru, reset by position_ids": ("recurrent_gemma", "sdpa"),
    "compressed convolutional attention": ("zaya", "sdpa"),
    "gated delta net and n-gram embeddings": ("qwen4_exp_text", "sdpa"),
    "short conv and dynamic short conv on keys and values": ("inkling2_text", "eager"),
    "rwkv time and channel mixing, no mask handed to the blocks": ("rwkv", "eager"),
    "xlstm matrix memory, no mask handed to the blocks": ("xlstm", "eager"),
}


_NO_SDPA = ("rwkv", "xlstm")  # attention-free: transformers offers them eager only


@pytest.mark.parametrize(("model_type", "backend"), MIXER_KINDS.values(), ids=MIXER_KINDS)
def test_mixers_isolate_documents(model_type, backend):
    model = tiny_model(model_type, backend)
    batch = packed_batch()
    with packing_configured(model):
        logit_difference, loss_difference = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference <= TOLERANCE and loss_difference <= TOLERANCE, (logit_difference, loss_difference)


@pytest.mark.parametrize(("model_type", "backend"), MIXER_KINDS.values(), ids=MIXER_KINDS)
def test_transformers_padding_free_path_leaks_through_mixers(model_type, backend):
    """Negative control: transformers' own packed path (per-document `position_ids`, no mask) isolates attention but
    not the mixers' conv and recurrent state. Measured max logit differences: qwen3_5_text 4.1e-2, nemotron_h 4.4e-1,
    mamba2 2.8, jamba 4.4e-3, minimax 5.0e-2, lfm2 6.1e-4 (its 3-token conv reaches two tokens into the next
    document), bailing_hybrid 6.6e-1, inkling_text 3.5e-4, recurrent_gemma 1.3e-1 (its RG-LRU resets where
    `position_ids` is 0, its conv does not), zaya 4.3e-1, qwen4_exp_text 3.2e-2, rwkv 2.2, xlstm 1.9 (both ignore
    `position_ids` and the mask)."""
    model = tiny_model(model_type, backend)
    logit_difference, _ = _max_differences(model, packed_batch())
    assert logit_difference > 10 * TOLERANCE


@pytest.mark.parametrize(("model_type", "backend"), MIXER_KINDS.values(), ids=MIXER_KINDS)
def test_padding_free_batches_are_refused_where_the_mixers_read_the_mask(model_type, backend):
    """The same padding-free batch on a configured model: refused before any layer runs (training or not) where the
    mixers read the documents from the mask (the leaks above), exact where they read `position_ids` (Griffin's RG-LRU
    block). The collator's `padding_free=True` and `return_flash_attn_kwargs=True` send such batches. RWKV and xLSTM
    take no `position_ids`, but their causal LMs accept any keyword: a padding-free batch ran each row whole there."""
    model = tiny_model(model_type, backend)
    batch = packed_batch()
    with packing_configured(model):
        if mixers.mask_reading_mixers(model_type):
            for training in (True, False):
                model.train(training)
                with pytest.raises(ContaminationError, match=r"padding-free batch .*`position_ids` restarting"):
                    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
                # A 0/1 mask with those positions (TRL's `return_position_ids=True`) too; the models that call no
                # mask builder (mamba2, rwkv, xlstm: 2.8, 2.2 and 1.9 off alone) are checked before their mixers.
                for mask in (batch["attention_mask"].ne(0).long(), batch["attention_mask"].ne(0)):
                    with pytest.raises(ContaminationError, match=r"`position_ids` restart inside a row whose"):
                        model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                              use_cache=False)
            model.eval()
            # A 0/1 mask with positions 0, 1, 2, ... (generation, unpacked rows) is not a padding-free batch.
            model(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False)
        else:
            assert max(_max_differences(model, batch)) <= TOLERANCE


def test_flattened_collator_batches_are_refused_for_a_hybrid():
    model = tiny_model("lfm2", "sdpa").train()
    features = [{"input_ids": list(range(3, 3 + n))} for n in (5, 9, 3)]
    with packing_configured(model):
        for options in ({"padding_free": True}, {"return_flash_attn_kwargs": True}):
            batch = DataCollatorWithPacking(max_length=16, **options)(features)
            with pytest.raises(ContaminationError, match="Lfm2ShortConv read the documents only from an indexed"):
                model(**batch, use_cache=False)
        model(**DataCollatorWithPacking(max_length=16)(features), use_cache=False).loss.backward()


# Kernels each model type calls when flash-linear-attention (`fla`) and `causal_conv1d` are installed.
FAST_KERNELS = {
    "qwen3_5_text": {"causal_conv1d_fn", "chunk_gated_delta_rule"},
    "olmo_hybrid": {"causal_conv1d_fn", "chunk_gated_delta_rule"},
    "lfm2": {"causal_conv1d_fn"},
    "nemotron_h": {"causal_conv1d_fn"},
}


@pytest.mark.slow
def test_fast_kernels_get_one_document_per_row():
    """With `fla` and `causal_conv1d` installed (stand-ins of their signatures here, computing transformers' torch
    reference), transformers calls those kernels instead of its fallbacks. Under the hook they must see each document
    as its own row of a plain batch (several documents of like length side by side), never the packed row's
    `cu_seqlens` / `seq_idx`, and the logits stay exact. Mamba2's fused training kernel (`mamba_ssm`) has no
    stand-in."""
    tests = os.path.dirname(os.path.abspath(__file__))
    stand_ins = os.path.join(tests, "fast_kernel_stand_ins")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([stand_ins, tests, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, os.path.join(stand_ins, "run_packed.py"), *FAST_KERNELS],
                            capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [run["model_type"] for run in runs] == list(FAST_KERNELS)
    longest = max(max(lengths) for lengths in PACKED_DOCUMENT_LENGTHS)
    for run in runs:
        calls = run["calls"]
        assert {call["kernel"] for call in calls} == FAST_KERNELS[run["model_type"]], run
        assert all(call["layout"] == [] for call in calls), calls
        assert all(call["length"] <= longest for call in calls), calls  # a document's length, not the row's 18
        assert max(call["batch_size"] for call in calls) > 1, calls  # documents of like length share a call
        assert run["logits"] <= TOLERANCE and run["losses"] <= TOLERANCE, run


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba2", "rwkv"])
def test_packed_forward_with_a_cache_is_refused(model_type):
    model = tiny_model(model_type, "eager")
    batch = packed_batch()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with packing_configured(model), pytest.raises(ContaminationError, match="use_cache=False"):
        model(**inputs, use_cache=True)


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm"])
def test_blocks_get_the_mask_when_the_instance_holds_its_forward(model_type):
    """SFTTrainer leaves the model's original `forward` bound on the instance before `PackedSFTTrainer` configures the
    hook; a wrapper on the class `forward` would never run, and the blocks would see no documents."""
    model = tiny_model(model_type, "eager")
    model.forward = model.forward
    batch = packed_batch()
    with packing_configured(model):
        assert _max_differences(model, batch, attention_mask=batch["attention_mask"])[0] <= TOLERANCE


def test_xlstm_eval_chunks_through_a_cache_are_refused_with_the_fix():
    """In eval mode xLSTM runs rows longer than `max_inference_chunksize` chunk by chunk through a cache it makes
    itself, whatever `use_cache` says: the state would cross documents, so the packed forward is refused."""
    model = tiny_model("xlstm", "eager", max_inference_chunksize=8)
    batch = packed_batch()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    refused = pytest.raises(ContaminationError, match="xLSTMBlock with a cache.*`config.max_inference_chunksize`")
    with packing_configured(model), torch.no_grad(), refused:
        model(**inputs, use_cache=False)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "rwkv"])
def test_unconfigure_restores_every_mixer_forward(model_type):
    """The mixers' `forward`, and for RWKV the `__call__` of the model classes that hand the mask to its blocks."""
    model = tiny_model(model_type, "eager")
    recorders = [type(model), type(model.base_model)] * (model_type == "rwkv")
    originals = [cls.forward for cls in mixers.mixer_classes(model_type)] + [cls.__call__ for cls in recorders]
    configure_packing(model)
    try:
        wrapped = [cls.forward for cls in mixers.mixer_classes(model_type)]
        assert wrapped != originals[: len(originals) - len(recorders)]
        assert all("__call__" in vars(cls) for cls in recorders)
    finally:
        unconfigure_packing()
    assert [cls.forward for cls in mixers.mixer_classes(model_type)] + [cls.__call__ for cls in recorders] == originals
    assert not any("__call__" in vars(cls) for cls in recorders)
    assert not registry.is_active()


def test_mixer_missing_from_the_table_is_refused(monkeypatch):
    model = tiny_model("qwen3_5_text")
    monkeypatch.setitem(MIXERS, "qwen3_5_text", ("qwen3_5", {}))
    with pytest.raises(UnsupportedSetupError, match="Qwen3_5GatedDeltaNet.*does not isolate"):
        configure_packing(model)
    assert not registry.is_active()


def test_short_convolution_without_a_conv1d_missing_from_the_table_is_refused(monkeypatch):
    """Inkling 2's dynamic short convolution holds its taps as plain weights (no Conv1d child): its name marks it."""
    model = tiny_model("inkling2_text", "eager")
    module_name, calls = MIXERS["inkling2_text"]
    static_only = {name: call for name, call in calls.items() if "Dynamic" not in name}
    monkeypatch.setitem(MIXERS, "inkling2_text", (module_name, static_only))
    with pytest.raises(UnsupportedSetupError, match="Inkling2DynamicShortConvolution.*does not isolate"):
        configure_packing(model)
    assert not registry.is_active()


def test_documents_read_from_position_ids_shared_by_every_row():
    """recurrent_gemma's block reads the documents from `position_ids`; one row of them serves every row."""
    model = tiny_model("recurrent_gemma")
    batch = packed_batch(document_lengths=((5, 1, 7, 3), (5, 1, 7, 3)))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    with packing_configured(model), torch.no_grad():
        per_row = model(**inputs, position_ids=batch["position_ids"]).logits
        shared = model(**inputs, position_ids=batch["position_ids"][:1]).logits
    assert (per_row - shared).abs().max() <= TOLERANCE
    assert _max_differences(model, batch)[0] > 10 * TOLERANCE  # without the hook, the same batch leaks


@pytest.mark.parametrize(("model_type", "mixer"), [
    ("qwen4_exp_text", "Qwen4ExpTextPLELayer"), ("qwen4_exp_text", "Qwen4ExpTextGatedDeltaNet"),
    ("inkling2_text", "Inkling2ShortConvolution"), ("inkling2_text", "Inkling2DynamicShortConvolution"),
])
def test_every_mixer_of_a_layer_is_needed(model_type, mixer):
    """Negative control per mixer kind of a type with two: Qwen4Exp's n-gram embeddings (hashed token n-grams and a
    dilated conv) leak on their own when the gated delta net is isolated, and the other way round; so do Inkling 2's
    static short convolutions and the dynamic ones of its full-attention layers."""
    model = tiny_model(model_type, "eager")
    batch = packed_batch()
    with packing_configured(model):
        cls = next(cls for cls in mixers.mixer_classes(model_type) if cls.__name__ == mixer)
        cls.forward = cls.forward.__wrapped__  # this one left on the packed row; unconfiguring finds it in place
        logit_difference, _ = _max_differences(model, batch, attention_mask=batch["attention_mask"])
    assert logit_difference > 10 * TOLERANCE


@pytest.mark.parametrize(
    "model_type", ["qwen3_5_text", "recurrent_gemma", "inkling_text", "zaya", "qwen4_exp_text", "rwkv", "xlstm"]
)
def test_verify_packing_catches_a_mixer_leak(model_type):
    """Attention isolated but the mixers left on the packed row: `verify_packing`'s documents (9, 7, 11 tokens, longer
    than the 4-token conv kernels) expose it."""
    model = tiny_model(model_type, "eager" if model_type in _NO_SDPA else "sdpa")
    with packing_configured(model):
        assert verify_packing(model) <= TOLERANCE
        for cls in mixers.mixer_classes(model_type):
            cls.forward = cls.forward.__wrapped__
        with pytest.raises(ContaminationError, match=model_type):
            verify_packing(model)


def _checkpointed_model(model_type, use_reentrant):
    """A tiny model in training mode with gradient checkpointing on, and the list its layers append to each time they
    run a call under the checkpoint function."""
    model = tiny_model(model_type, "eager" if model_type in _NO_SDPA else "sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    calls = []
    for layer in model.modules():
        if getattr(layer, "gradient_checkpointing", False):
            function = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *args, f=function, **kwargs: calls.append(1) or f(
                *args, **kwargs)
    return model, calls


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "rwkv", "xlstm"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradients_through_checkpointed_mixers_equal_separate_documents(model_type, use_reentrant):
    """Training: with gradient checkpointing the mixers run again in backward, outside the model's forward; the
    gradients of the packed loss equal those of the documents' losses summed. RWKV's and xLSTM's re-batched blocks are
    themselves checkpointed layers: each document group's call is checkpointed (asserted), not the packed row's."""
    model, checkpointed = _checkpointed_model(model_type, use_reentrant)
    batch = packed_batch()

    def gradients(loss):
        # `.backward()`, not `autograd.grad`: reentrant checkpointing supports only the former.
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with packing_configured(model):
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
        packed = gradients(_token_losses(logits, batch["labels"]).sum())
    separate_loss = 0
    for row, spans in enumerate(batch["documents"]):
        for start, length in spans:
            input_ids = batch["input_ids"][row : row + 1, start : start + length]
            logits = model(input_ids=input_ids, position_ids=torch.arange(length)[None], use_cache=False).logits
            labels = batch["labels"][row : row + 1, start : start + length]
            separate_loss = separate_loss + _token_losses(logits, labels).sum()
    separate = gradients(separate_loss)
    difference = max((a - b).abs().max().item() for a, b in zip(packed, separate, strict=True))
    # Relative above 1: the tiny RWKV's embedding gradients reach 5e3 (its WKV exponentials), where float32's spacing
    # alone is 5e-4; the other models' gradients stay below 1, so their bound is the absolute one.
    scale = max(1.0, max(gradient.abs().max().item() for gradient in separate))
    assert difference <= TOLERANCE * scale, (difference, scale)
    assert checkpointed, "no layer ran under gradient checkpointing"


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm"])
def test_unpacked_batches_still_checkpoint_the_wrapped_blocks(model_type):
    """transformers checkpoints a layer only when the layer's class `forward` is its own wrapper; the hook replaced
    it, so a plain batch through a configured model is checkpointed by the hook's wrapper instead. (A configured model
    trains only batches that say where documents start: one document per row, with its `position_ids`.)"""
    model, calls = _checkpointed_model(model_type, use_reentrant=False)
    with packing_configured(model):
        model(input_ids=torch.arange(1, 9)[None], position_ids=torch.arange(8)[None], use_cache=False).logits.sum(
        ).backward()
    blocks = [module for module in model.modules() if isinstance(module, tuple(mixers.mixer_classes(model_type)))]
    assert len(calls) == len(blocks) > 0


@pytest.mark.parametrize(("model_type", "targets"), [("rwkv", ["key", "receptance"]), ("xlstm", ["k", "v"])])
def test_blocks_see_the_mask_through_a_peft_wrapper(model_type, targets):
    """LoRA, as most users train: PEFT's wrappers call the model inside their own forward, and the blocks that get no
    mask (RWKV, xLSTM) still see the packed documents, so the wrapped model is exact and verifies."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(model_type, "eager"), LoraConfig(r=4, target_modules=targets))
    batch = packed_batch()
    with packing_configured(model):
        assert _max_differences(model, batch, attention_mask=batch["attention_mask"])[0] <= TOLERANCE
        assert verify_packing(model) <= TOLERANCE


def test_layout_follows_the_mask_of_each_forward_and_thread():
    """The layout is remembered per thread and per mask object and version: a new mask, an in-place edit or another
    thread never reuses a stale one."""
    model = tiny_model("qwen3_5_text")
    first = packed_batch()
    second = packed_batch(document_lengths=((2, 9, 7), (18,)), seed=1)
    with packing_configured(model):
        assert _max_differences(model, first, attention_mask=first["attention_mask"])[0] <= TOLERANCE
        assert _max_differences(model, second, attention_mask=second["attention_mask"])[0] <= TOLERANCE
        mask = torch.tensor([[1, 1, 1, 2, 2, 2]])
        assert [g.tolist() for g in mixers._document_batches(mask).gather] == [[[0, 1, 2], [3, 4, 5]]]
        mask[0, 2] = 2
        assert [g.tolist() for g in mixers._document_batches(mask).gather] == [[[2, 3, 4, 5], [0, 1, 6, 6]]]
        seen = []
        thread = threading.Thread(target=lambda: seen.append(dict(documents._per_thread.states)))
        thread.start()
        thread.join()
        assert seen == [{}]


def test_document_batches_group_by_length_and_zero_the_padding():
    batches = DocumentBatches.from_mask(torch.tensor([[1] * 9 + [2] * 2 + [0], [1, 2, 2, 2, 3, 3, 3, 3, 3, 0, 0, 0]]))
    # Documents of up to 32 tokens share one call (the rule varlen attention groups by: `documents.bucket_bounds`).
    assert [tuple(group.shape) for group in batches.gather] == [(5, 9)]
    states = torch.arange(24.0).view(2, 12, 1)
    assert torch.equal(batches.run(lambda x: x, states)[..., 0], torch.where(torch.tensor(
        [[1] * 11 + [0], [1] * 9 + [0] * 3]).bool(), states[..., 0], 0))
    # A causal running sum restarts at every document.
    sums = batches.run(lambda x: x.cumsum(1), torch.ones(2, 12, 1))[..., 0]
    assert sums.tolist() == [[*range(1, 10), 1, 2, 0], [1, 1, 2, 3, 1, 2, 3, 4, 5, 0, 0, 0]]


def test_left_padded_generation_of_a_mixer_reading_positions_is_transformers_own():
    """Griffin's recurrent block reads its documents from `position_ids`, and generation numbers left padding 0 too:
    a configured recurrent_gemma refused left-padded `generate` (a "packed batch with a cache") and ran each pad of a
    left-padded forward as a document of its own (0.086 off unconfigured with a trained-like conv bias). With an
    ordinary 0/1 mask the positions tell no documents: both are transformers' own again."""
    from transformers import GenerationConfig

    model = tiny_model("recurrent_gemma", "eager").eval()
    with torch.no_grad():
        for block in model.modules():
            if type(block).__name__ == "RecurrentGemmaRecurrentBlock":
                block.linear_x.bias.normal_()
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    with torch.no_grad():
        expected = model(input_ids=ids * mask, attention_mask=mask, position_ids=positions).logits
        generated = model.generate(input_ids=ids * mask, attention_mask=mask, generation_config=config)
        with packing_configured(model):
            logits = model(input_ids=ids * mask, attention_mask=mask, position_ids=positions).logits
            assert torch.equal(model.generate(input_ids=ids * mask, attention_mask=mask, generation_config=config),
                               generated)
    assert float((logits - expected)[mask.bool()].abs().max()) <= 1e-6


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm"])
def test_the_recorded_mask_ends_with_its_call(model_type):
    """The mask a model call records (a class `__call__` wrapper and instance hooks) is gone once the call returns or
    raises: a stale one of an earlier batch's shape reached the blocks of a later call made without a mask."""
    model = tiny_model(model_type, "eager").eval()
    batch = packed_batch()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with packing_configured(model), torch.no_grad():
        model(**inputs, use_cache=False)
        assert (mixers._model_mask.mask, mixers._model_mask.outer) == (None, [])
        with pytest.raises(ContaminationError):
            model(**inputs, use_cache=True)
        assert (mixers._model_mask.mask, mixers._model_mask.outer) == (None, [])
        model(input_ids=batch["input_ids"][:1], use_cache=False)
