"""Rope types whose frequencies follow the sequence length (`longrope`, `dynamic`): each packed document rotated as it
is alone (`llm_packing.hook.rotary`).

transformers picks these frequencies from `max(position_ids) + 1` over the whole batch: the longest packed document's
length. The configs here put the switch at 16 tokens (longrope's `original_max_position_embeddings`, dynamic's
`max_position_embeddings`), so that the fixed layout and the random ones (rows of 36-48 tokens, each with a document
past 32 tokens beside shorter ones) pack documents on both sides of it. A reference runs each document alone in a
fresh rotary module: transformers' dynamic update otherwise keeps a longer earlier document's frequencies.
"""

import importlib.util
import os
import traceback

import pytest
import torch
import transformers
from random_layouts import draw_layout
from test_compile import TOLERANCE as COMPILE_TOLERANCE, compiled_and_eager_differences
from test_parity import _max_differences
from tiny_models import packed_batch, tiny_config, tiny_model

from llm_packing import configure_packing, unconfigure_packing
from llm_packing.hook import rotary
from llm_packing.hook.configure import packing_configured


TOLERANCE = 1e-5
SWITCH_LENGTH = 16
# Documents of 20, 17 and 30 tokens are past the switch, 16 and shorter are not (one of a single token).
STRADDLING_LAYOUT = ((20, 8, 12, 1, 7), (17, 16, 15), (30, 18))
CASES = [
    ("phi3", "longrope"),  # Phi-3-128k, Phi-3.5 and Phi-4-mini ship longrope
    ("phimoe", "longrope"),  # Phi-3.5-MoE: its forward reads the length itself, for the mscale
    ("phimoe", "linear"),  # the same mscale switch, on frequencies that do not change with the length
    ("llama", "longrope"),
    ("llama", "dynamic"),
    ("qwen2", "dynamic"),  # with sliding windows
    ("gemma3_text", "longrope"),  # rope parameters per layer type: longrope on full attention, default on sliding
    ("deepseek_v2", "longrope"),  # one complex tensor of frequencies, not (cos, sin)
    ("qwen3_5_text", "dynamic"),  # 3-D (mrope) positions, and gated delta net mixers
]
BACKENDS = [("sdpa", "auto"), ("sdpa", "dense"), ("eager", "auto")]


def length_dependent_rope(model_type: str, rope_type: str, switch_length: int = SWITCH_LENGTH) -> dict:
    """Config overrides giving `model_type` the rope type `rope_type` (on its full-attention layers, where it has rope
    parameters per layer type), switching at `switch_length` tokens (longrope: long factors 1, 2, 3, ... against short
    ones of 1)."""
    config = tiny_config(model_type)
    parameters = config.rope_parameters
    per_layer = "full_attention" in parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_parameters = parameters["full_attention"] if per_layer else parameters
    pairs = int(head_dim * layer_parameters.get("partial_rotary_factor", 1.0)) // 2
    rope = {"rope_theta": layer_parameters.get("rope_theta") or 10000.0, "rope_type": rope_type}
    if rope_type == "longrope":
        rope |= {
            "original_max_position_embeddings": switch_length,
            "long_factor": [1.0 + i for i in range(pairs)],
            "short_factor": [1.0] * pairs,
            "factor": 4.0,  # what transformers derives from the two lengths; deepseek_v2 reads it
            "short_mscale": 1.0,  # phimoe scales cos and sin by one of these, chosen from the batch's length
            "long_mscale": 1.5,
        }
        # phi3 reads the original context from its own config field, which overrides the rope parameters'.
        fields = {"max_position_embeddings": 4 * switch_length, "original_max_position_embeddings": switch_length}
    elif rope_type == "dynamic":
        rope |= {"factor": 4.0}
        fields = {"max_position_embeddings": switch_length}
    else:  # phimoe: cos and sin scaled by the mscale of the batch's length, for every rope type but the default
        rope |= {"factor": 4.0, "original_max_position_embeddings": switch_length, "short_mscale": 1.0,
                 "long_mscale": 1.5}
        fields = {"max_position_embeddings": 4 * switch_length}
    if getattr(config, "head_dim", 0) is None:  # rope utils read an explicit None as the width (mixtral, minimax)
        fields["head_dim"] = head_dim
    return {"rope_parameters": {**parameters, "full_attention": rope} if per_layer else rope, **fields}


def fresh_rotary_forward(monkeypatch) -> None:
    """Each reference forward of `test_parity._max_differences` starts from the rotary modules' original state."""
    import test_parity

    forward = test_parity._forward

    def forward_from_fresh_rotary(model, **inputs):
        for module in model.modules():
            if hasattr(module, "original_inv_freq") and hasattr(module, "max_seq_len_cached"):
                module.inv_freq.copy_(module.original_inv_freq)
                module.max_seq_len_cached = module.original_max_seq_len
        return forward(model, **inputs)

    monkeypatch.setattr(test_parity, "_forward", forward_from_fresh_rotary)


def differences(model, layout_rows, row_length=48):
    batch = packed_batch(document_lengths=layout_rows, row_length=row_length)
    return _max_differences(model, batch, attention_mask=batch["attention_mask"])


@pytest.mark.parametrize(("backend", "route"), BACKENDS)
@pytest.mark.parametrize(("model_type", "rope_type"), CASES)
def test_documents_on_both_sides_of_the_switch_are_rotated_as_alone(
    model_type, rope_type, backend, route, monkeypatch
):
    fresh_rotary_forward(monkeypatch)
    model = tiny_model(model_type, backend, **length_dependent_rope(model_type, rope_type))
    layouts = [STRADDLING_LAYOUT] + [draw_layout(seed).rows for seed in (0, 1, 3)]
    with packing_configured(model, attention_route=route):
        for rows in layouts:
            assert max(differences(model, rows)) <= TOLERANCE, (model_type, rope_type, backend, route, rows)


@pytest.mark.parametrize(("model_type", "rope_type"), CASES)
def test_without_the_rotary_patch_short_documents_get_the_long_frequencies(model_type, rope_type, monkeypatch):
    """Negative control: transformers' own rotary module, under the rest of the hook, rotates the short documents of
    the straddling layout with the longest one's frequencies (3.3e-4 at the least, deepseek_v2's: 33 times the
    tolerance)."""
    fresh_rotary_forward(monkeypatch)
    monkeypatch.setattr(rotary, "patch_rotary_embeddings", lambda model_or_config: None)
    model = tiny_model(model_type, "sdpa", **length_dependent_rope(model_type, rope_type))
    with packing_configured(model):
        try:
            difference = differences(model, STRADDLING_LAYOUT)[0]
        except UnboundLocalError as error:
            if not traceback.extract_tb(error.__traceback__)[-1].filename.endswith("modeling_rope_utils.py"):
                raise
            # transformers 5.18's own longrope update fails for rope types per layer type, from its second long
            # batch on (`long_inv_freq` unbound): there is no unpatched forward to compare. The patched one skips it.
            pytest.skip(f"transformers {transformers.__version__} cannot run per-layer longrope unpatched: {error}")
    assert difference > 10 * TOLERANCE


@pytest.mark.parametrize(("model_type", "rope_type"), [("phi3", "longrope"), ("phimoe", "linear"),
                                                      ("llama", "dynamic")])
def test_padding_numbered_on_from_a_document_does_not_lengthen_it(model_type, rope_type, monkeypatch):
    """The rotary patch reads each document's length from the positions, split where they restart. Padding numbered
    with the row's `arange` (a hand-made batch; the collator writes 0) ran on from the document before it past the
    switch: 1.8e-3 to 7.5e-3 off alone. A packed batch's padding positions are set to 0 before the model runs."""
    fresh_rotary_forward(monkeypatch)
    model = tiny_model(model_type, "sdpa", **length_dependent_rope(model_type, rope_type))
    batch = packed_batch(document_lengths=((14, 1, 3), (12, 2)), row_length=34)
    arange = torch.arange(34).expand(2, 34)
    positions = torch.where(batch["attention_mask"] == 0, arange, batch["position_ids"])
    with packing_configured(model), torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=positions,
                       use_cache=False).logits
        assert max(_max_differences(model, batch, logits=logits)) <= TOLERANCE


def test_a_layout_short_of_the_switch_is_exact_unpatched_too(monkeypatch):
    """The control's leak is the switch: with every document at most `SWITCH_LENGTH` tokens, transformers' module is
    exact as well."""
    monkeypatch.setattr(rotary, "patch_rotary_embeddings", lambda model_or_config: None)
    model = tiny_model("phi3", "sdpa", **length_dependent_rope("phi3", "longrope"))
    with packing_configured(model):
        assert max(differences(model, ((16, 8, 1, 7), (10, 6)), row_length=32)) <= TOLERANCE


def test_compiled_longrope_model_equals_eager_on_every_new_layout():
    """The longrope route reads nothing on the host: compiled, it follows each batch's documents (1-20 tokens, the
    switch at 10) and compiles no more than a model without it (`test_compile`)."""
    overrides = length_dependent_rope("phi3", "longrope", switch_length=10)
    batch_differences, frames = compiled_and_eager_differences("phi3", "sdpa", "auto", **overrides)
    assert all(max(difference) <= COMPILE_TOLERANCE for difference in batch_differences), batch_differences
    assert frames[2:] == [frames[1]] * (len(frames) - 2), frames


def test_compiled_dynamic_rope_model_equals_eager_on_every_new_layout():
    """The dynamic route reads the long documents' lengths on the host, as transformers' own dynamic update does: the
    compiled model breaks its graph there and still follows each batch's documents."""
    overrides = length_dependent_rope("llama", "dynamic", switch_length=10)
    batch_differences, _ = compiled_and_eager_differences("llama", "sdpa", "auto", **overrides)
    assert all(max(difference) <= COMPILE_TOLERANCE for difference in batch_differences), batch_differences


def test_an_unpacked_batch_is_rotated_as_transformers_rotates_it():
    """A right-padded 0/1 batch without `position_ids` (every row at positions 0, 1, ..., so one run of the whole
    length): configuring changes nothing, whatever the rows' lengths."""
    model = tiny_model("phi3", "sdpa", **length_dependent_rope("phi3", "longrope"))
    input_ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        with packing_configured(model):
            configured = model(input_ids=input_ids, attention_mask=attention_mask).logits
    assert torch.equal(configured, expected)


def test_left_padded_prompts_are_rotated_by_their_own_length():
    """Left-padded prompts with generate's positions (0 from each prompt's first token, 1 on padding): the short
    prompt is rotated as alone, where transformers takes the long prompt's length for both."""
    model = tiny_model("phi3", "sdpa", **length_dependent_rope("phi3", "longrope"))
    input_ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :16] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    with torch.no_grad():
        alone = model(input_ids=input_ids[:1, 16:]).logits[0]
        unconfigured = model(**inputs).logits[0, 16:]
        with packing_configured(model):
            configured = model(**inputs).logits[0, 16:]
    assert (configured - alone).abs().max() <= TOLERANCE
    assert (unconfigured - alone).abs().max() > 50 * TOLERANCE


def test_a_config_patches_its_modeling_modules_rotary_class_and_unconfigure_restores_it():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    original = LlamaRotaryEmbedding.forward
    default_config = tiny_config("llama")
    try:
        configure_packing(default_config)
        assert LlamaRotaryEmbedding.forward is original  # default rope: nothing depends on the length
        configure_packing(tiny_config("llama", **length_dependent_rope("llama", "dynamic")))
        assert LlamaRotaryEmbedding.forward is not original
    finally:
        unconfigure_packing()
    assert LlamaRotaryEmbedding.forward is original


def test_the_rope_parity_benchmark_reports_each_pair_with_its_control(tmp_path, monkeypatch):
    """`benchmarks/rope_parity.py` (every supported type; its table is in benchmarks/results/rope_parity.md), on a
    type it measures and one without rope."""
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    monkeypatch.syspath_prepend(benchmarks)  # its sibling `publish`
    specification = importlib.util.spec_from_file_location("rope_parity", os.path.join(benchmarks, "rope_parity.py"))
    benchmark = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(benchmark)
    benchmark.main(["phi3", "gpt2", "--output", str(tmp_path / "rope.md")])
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): [cell.strip() for cell in line.split("|")[3:-1]]
            for line in (tmp_path / "rope.md").read_text().splitlines() if line.startswith("| ")}
    backend, packed, control, _ = rows[("phi3", "longrope")]
    assert backend == "sdpa" and float(packed) <= TOLERANCE < float(control)
    assert rows[("gpt2", "dynamic")][-1] == "no rope parameters"
    assert "not built" in rows[("phi3", "dynamic")][-1]  # phi3's config refuses dynamic rope
