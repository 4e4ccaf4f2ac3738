"""Concurrent forwards on one configured model, as `nn.DataParallel` runs them (one replica per thread; HF `Trainer`
uses it on a machine with several GPUs and no launcher): every thread gets exactly the logits its own packed batch
gives when run alone, on every route the hook has.

Each case runs three different packed batches (other document layouts, other tokens) on three threads at once, each
thread many times over, the threads released together at every round so that their forwards interleave; each output
must equal the batch's single-threaded output. State that one forward keeps for its layers (the document layout, the
unpad data, the varlen buckets, the mixers' document batches, the mask a recurrent model records, the dense masks by
which the sparse key indexers find their documents) must belong to that forward: with it kept process-wide,
gemma3_text on sdpa differed by up to 1.1 (issue 25).
"""

import copy
import sys
import threading
import time

import pytest
import torch
from flex_modes import traced_flex
from test_flash_path import flash_model  # noqa: F401  (the fixture: transformers' FlashAttention code, reference kernel)
from test_rotary import length_dependent_rope
from tiny_models import PACKED_ROW_LENGTH, packed_batch, tiny_model
from transformers import masking_utils

from llm_packing import (
    UnsupportedSetupError,
    configure_packing,
    is_packing_configured,
    packing_configured,
    unconfigure_packing,
    verify_packing,
)
from llm_packing.hook import documents, registry
from llm_packing.hook.attention import varlen


THREADS = 3
ROUNDS = 12
TOLERANCE = 1e-6  # the same batch through the same kernels: only a leak from another thread's forward moves it
# Different layouts per thread: rows of different document counts and lengths, trailing padding in some.
LAYOUTS = (
    ((5, 1, 7, 3), (9, 2, 1, 6)),
    ((18,), (2, 2, 2, 2, 10)),
    ((1, 1, 1, 4, 8), (11, 5)),
)
# (model_type, backend, attention_route): a plain model, sliding windows (gemma3_text alternates sliding and full
# layers), hybrids (qwen3_5_text's gated delta nets read the mask; RWKV's blocks read the mask their model was called
# with), ALiBi (bloom) and a sparse key indexer (deepseek_v32's reads the documents its forward's builders recorded)
# on each route they take, one model shared by the threads.
CASES = [
    ("llama", "sdpa", "varlen"),
    ("llama", "sdpa", "dense"),
    ("llama", "eager", "auto"),
    ("gemma3_text", "sdpa", "varlen"),
    ("gemma3_text", "sdpa", "dense"),
    ("gemma3_text", "eager", "auto"),
    ("qwen3_5_text", "sdpa", "varlen"),
    ("qwen3_5_text", "eager", "auto"),
    ("rwkv", "eager", "auto"),
    ("bloom", "eager", "auto"),
    ("deepseek_v32", "sdpa", "dense"),
    ("deepseek_v32", "eager", "auto"),
    ("llama4_text", "sdpa", "varlen"),  # the attention temperature of its layer without rope, per document
]
FLASH_CASES = [(model_type, "flash_attention_2") for model_type in ("llama", "gemma3_text", "qwen3_5_text")]


@pytest.fixture(autouse=True)
def host_copies_release_the_interpreter(monkeypatch):
    """On a GPU, the forward's device-to-host copy of the mask waits for the device with the interpreter released, so
    another thread's forward runs in the middle of building this one's state. On CPU the copy holds it; let it go."""
    copy_to_host = documents._to_host

    def releasing(tensor):
        time.sleep(0)
        return copy_to_host(tensor)

    monkeypatch.setattr(documents, "_to_host", releasing)


def _batches():
    return [packed_batch(document_lengths=layout, row_length=PACKED_ROW_LENGTH, seed=seed)
            for seed, layout in enumerate(LAYOUTS)]


def _logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False).logits


def _run_together(threads: list[threading.Thread]) -> None:
    """Start every thread, then wait for all of them."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _hammer(models, batches, logits=_logits) -> list[float]:
    """Per batch, the largest difference between its outputs on the threads (thread `i` runs `models[i]`) and its
    output run alone (`logits(model, batch)` runs a batch)."""
    expected = [logits(model, batch) for model, batch in zip(models, batches, strict=True)]
    differences = [0.0] * len(batches)
    errors = []
    start = threading.Barrier(len(batches))

    def run(index):
        try:
            for _ in range(ROUNDS):
                start.wait()
                # Fresh tensors every round, as a data loader gives: per-forward state must follow the new mask.
                output = logits(models[index], {key: value.clone() for key, value in batches[index].items()
                                                if isinstance(value, torch.Tensor)})
                differences[index] = max(differences[index], (output - expected[index]).abs().max().item())
        except BaseException as error:  # reported below: a thread's exception would otherwise vanish
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(batches))]
    # Hand the interpreter from thread to thread every microsecond (5 ms by default), so that the Python parts of
    # concurrent forwards interleave finely, as when each thread waits on a GPU of its own.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _run_together(threads)
    finally:
        sys.setswitchinterval(switch_interval)
    if errors:
        raise errors[0]
    return differences


@pytest.mark.parametrize(("model_type", "backend", "route"), CASES)
def test_concurrent_forwards_each_get_their_own_documents(model_type, backend, route):
    model = tiny_model(model_type, backend)
    with packing_configured(model, attention_route=route):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences


@pytest.mark.parametrize(("model_type", "rope_type"), [("phi3", "longrope"), ("llama", "dynamic")])
def test_concurrent_forwards_with_a_length_dependent_rope(model_type, rope_type):
    """Rotary frequencies chosen per document (`hook.rotary`; the switch at 16 tokens: the 18-token document is past
    it, the others are not) come from the forward's own positions, never from a module attribute another thread's
    forward has set."""
    model = tiny_model(model_type, "sdpa", **length_dependent_rope(model_type, rope_type))
    with packing_configured(model):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences


def test_concurrent_forwards_on_replicas_of_a_model_that_keeps_state_on_its_modules():
    """recurrent_gemma's blocks read the mask's documents from `position_ids`. Its RG-LRU keeps its recurrent state on
    the module (`self.recurrent_states`, even with `use_cache=False`), so two threads sharing one model race inside
    transformers, packed or not; `nn.DataParallel` gives each thread a replica of its own, as here. The hook's state is
    still shared by the replicas (the same classes, the same patched functions)."""
    model = tiny_model("recurrent_gemma", "eager")
    with packing_configured(model):
        differences = _hammer([copy.deepcopy(model) for _ in range(THREADS)], _batches())
    assert max(differences) <= TOLERANCE, differences


# Three packed image-text batches per type: other documents (0 to 2 images of other sizes), other row counts.
IMAGE_LAYOUTS = (
    (((7, ()), (6, ((56, 84),)), (9, ((112, 56), (56, 56)))), ((0, 1), (2,))),
    (((5, ((84, 84), (56, 112))), (3, ()), (6, ((168, 56),))), ((0, 1, 2),)),
    (((4, ()), (8, ((56, 56),)), (2, ()), (6, ((112, 56),))), ((0, 3), (1, 2))),
)


def _image_text_logits(model, batch):
    with torch.no_grad():
        return model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits


@pytest.mark.parametrize(("model_type", "route"), [
    ("qwen2_5_vl", "varlen"), ("qwen2_5_vl", "dense"), ("gemma3", "auto"), ("mllama", "auto"),
])
def test_concurrent_image_text_forwards_each_get_their_own_documents(model_type, route):
    """The image-text state of a forward (its mRoPE positions, computed in a pre-hook; its block ids and
    same-document mask function, in the builder call; Mllama's image slot owners, kept on the forward's documents)
    belongs to that forward."""
    from test_image_text_parity import make_case
    from tiny_image_text import TinyImageText

    tiny = TinyImageText(model_type, "sdpa")
    batches = [make_case(model_type, "sdpa", documents, rows, padding=2, seed=10 * k, tiny=tiny).batch
               for k, (documents, rows) in enumerate(IMAGE_LAYOUTS)]
    with packing_configured(tiny.model, attention_route=route):
        differences = _hammer([tiny.model] * THREADS, batches, logits=_image_text_logits)
    assert max(differences) <= TOLERANCE, differences


def test_concurrent_video_forwards_each_get_their_own_documents():
    """The per-forward video state (each document's video grids and temporal mRoPE steps) belongs to that forward:
    three drawn layouts with videos and images, hammered on one Qwen2.5-VL."""
    from test_video_parity import random_layout, video_case
    from tiny_video import TinyVideo

    tiny = TinyVideo("qwen2_5_vl", "sdpa")
    batches = []
    for seed in range(3):
        documents, rows, padding = random_layout(seed, "qwen2_5_vl")
        batches.append(video_case("qwen2_5_vl", "sdpa", documents, rows, padding, seed=10 * seed, tiny=tiny).batch)
    assert all("pixel_values_videos" in batch for batch in batches)
    with packing_configured(tiny.model):
        differences = _hammer([tiny.model] * THREADS, batches, logits=_image_text_logits)
    assert max(differences) <= TOLERANCE, differences


def test_concurrent_forwards_on_flex_attention():
    model = tiny_model("llama", "flex_attention")
    with traced_flex(), packing_configured(model):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences


@pytest.mark.parametrize(("model_type", "backend"), FLASH_CASES)
def test_concurrent_forwards_on_the_flash_attention_path(flash_model, model_type, backend):  # noqa: F811
    model = flash_model(model_type, backend)
    with packing_configured(model):
        differences = _hammer([model] * THREADS, _batches())
    assert max(differences) <= TOLERANCE, differences


def test_a_forward_paused_while_building_its_layout_keeps_its_own(monkeypatch):
    """One interleaving, forced: thread A stops in the middle of building its varlen layout; thread B builds its own;
    A finishes; B's next layer asks again. Each gets the layout of its own mask every time (with the layouts of the
    last mask kept process-wide, B reset them, A then stored its own into B's, and B's next layer read A's)."""
    masks = {"A": torch.tensor([[1, 1, 1, 2, 2, 0]]), "B": torch.tensor([[1, 2, 2, 2, 3, 3]])}
    expected = {name: varlen.PackedAttentionMask.from_indexed_mask(mask).cu_seqlens.tolist()
                for name, mask in masks.items()}
    building, resume = threading.Event(), threading.Event()
    build = varlen.PackedAttentionMask.from_indexed_mask.__func__

    def pausing_build(cls, attention_mask, **options):
        if threading.current_thread().name == "A":
            building.set()
            assert resume.wait(10)
        return build(cls, attention_mask, **options)

    monkeypatch.setattr(varlen.PackedAttentionMask, "from_indexed_mask", classmethod(pausing_build))
    seen = {"A": [], "B": []}
    b_first_layer_done, b_next_layer = threading.Event(), threading.Event()

    def forward(name):
        seen[name].append(varlen.packed_attention_mask(masks[name]).cu_seqlens.tolist())
        if name == "B":  # B's next layer comes once A has finished building
            b_first_layer_done.set()
            assert b_next_layer.wait(10)
            seen[name].append(varlen.packed_attention_mask(masks[name]).cu_seqlens.tolist())

    threads = {name: threading.Thread(target=forward, args=(name,), name=name) for name in masks}
    threads["A"].start()
    assert building.wait(10)
    threads["B"].start()
    assert b_first_layer_done.wait(10)
    resume.set()
    threads["A"].join()
    b_next_layer.set()
    threads["B"].join()
    assert seen == {"A": [expected["A"]], "B": [expected["B"]] * 2}


# ---------------------------------------------------------------------------------------------------------------------
# Configuring and unconfiguring from several threads: the hook is process-wide.


def _hook_left_in_transformers() -> list:
    return registry.replaced_objects() + [name for name in ("create_causal_mask", "create_sliding_window_causal_mask")
                                          if registry.is_ours(getattr(masking_utils, name))]


def test_threads_configuring_at_once_leave_nothing_behind_after_unconfigure():
    """Configured from 4 threads at once, the same originals were wrapped several times, and the wrapper the modules
    held escaped the restore: transformers kept the hook's builders for good (6 modules)."""
    models = [tiny_model(model_type) for model_type in ("llama", "qwen2", "mistral", "mixtral")]
    start = threading.Barrier(len(models))

    def configure(model):
        start.wait(10)
        configure_packing(model)

    _run_together([threading.Thread(target=configure, args=(model,)) for model in models])
    unconfigure_packing()
    assert not is_packing_configured() and not _hook_left_in_transformers()


def test_a_block_ending_leaves_packing_another_thread_configured():
    """Thread A's `packing_configured` block ends while thread B trains a model it configured itself: B stays
    configured (the block's exit unconfigured the process, and B's packed forwards attended across documents, 0.53
    off alone). Blocks open on two threads at once: the last to exit unconfigures."""
    model_a, model_b = tiny_model("qwen2"), tiny_model("llama")
    batch = packed_batch()
    inside, leave = threading.Event(), threading.Event()

    def block_a():
        with packing_configured(model_a):
            inside.set()
            assert leave.wait(10)

    thread = threading.Thread(target=block_a)
    thread.start()
    assert inside.wait(10)
    configure_packing(model_b)
    with torch.no_grad():
        expected = model_b(**batch).logits
    leave.set()
    thread.join()
    assert is_packing_configured()
    with torch.no_grad():
        assert torch.equal(model_b(**batch).logits, expected)
    unconfigure_packing()

    inside.clear(), leave.clear()
    thread = threading.Thread(target=block_a)
    thread.start()
    assert inside.wait(10)
    with packing_configured(model_b):
        leave.set()
        thread.join()
        assert is_packing_configured()  # A's block ended first: B's is still open
    assert not is_packing_configured() and not _hook_left_in_transformers()


def test_unconfiguring_while_another_thread_runs_a_forward_is_refused(monkeypatch):
    """The forward's remaining layers would run unpatched: on a hybrid, its mixers across documents (qwen3_next:
    0.29 off alone, silently). Once the forward has ended, unconfiguring goes ahead."""
    model = tiny_model("llama")
    batch = packed_batch()
    in_layer, finish = threading.Event(), threading.Event()
    layer = model.model.layers[0]
    pause = layer.register_forward_hook(lambda *args: (in_layer.set(), finish.wait(10)) and None)
    configure_packing(model)
    thread = threading.Thread(target=lambda: model(**batch))
    thread.start()
    assert in_layer.wait(10)
    try:
        with pytest.raises(UnsupportedSetupError, match=r"while 1 other thread\(s\) run a forward of a configured"):
            unconfigure_packing()
        assert is_packing_configured()
    finally:
        finish.set()
        thread.join()
        pause.remove()
    unconfigure_packing()
    assert not is_packing_configured()


def test_threads_verifying_one_model_leave_it_in_training_mode():
    """Two `verify_packing` calls at once on a model in training mode: the second saved the eval mode the first had
    set, and restored it last (3 runs of 3)."""
    model = configure_packing(tiny_model("llama").train())
    start, checked = threading.Barrier(3), []

    def check():
        start.wait(10)
        checked.append(verify_packing(model))

    try:
        _run_together([threading.Thread(target=check) for _ in range(3)])
    finally:
        unconfigure_packing()
    assert len(checked) == 3 and model.training
