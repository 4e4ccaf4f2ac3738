"""The architecture table: derived from the installed transformers, every candidate decided, the doc kept true."""

import os
from types import SimpleNamespace

import pytest
import test_flash_path
import test_image_text_parity
import test_parity
from packaging.version import Version
from tiny_models import require_model_type
from transformers import AutoConfig

from llm_packing import _compat
from llm_packing.errors import UnsupportedSetupError
from llm_packing.hook.mixers import MIXERS
from llm_packing.hook.support import architectures, matrix as support_matrix, releases
from llm_packing.hook.support.architectures import (
    REFUSED_MODEL_TYPES,
    VERIFIED_MODEL_TYPES,
    candidate_model_types,
    refusal_reason,
    require_supported,
    supported_model_types,
)
from llm_packing.hook.support.image_text import (
    PROVEN_IMAGE_TEXT_TYPES,
    REFUSED_IMAGE_TEXT_TYPES,
    image_text_model_types,
    refused_image_text_model_types,
    require_images_supported,
    supported_image_text_model_types,
)
from llm_packing.hook.support.model_types import causal_lm_classes


DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "support_matrix.md")
REQUIRED = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi",
    "phi3", "starcoder2", "olmo2", "granite", "cohere", "stablelm", "gpt_neox", "falcon",
)  # fmt: skip
# The generic refusal of a candidate that no one has run through the matrix yet (see `refusal_reason`).
UNDECIDED = "not verified by llm_packing's parity matrix for this transformers version"
KNOWN_UNDECIDED = set()  # every candidate of transformers 5.24 is verified or refused by hand
# The committed support table and the README's counts are those of the newest tested transformers.
newest_only = pytest.mark.skipif(
    _compat.TRANSFORMERS_VERSION.release[:2] != Version(_compat.MAX_TESTED_TRANSFORMERS_VERSION).release[:2],
    reason=f"docs/support_matrix.md and the README describe transformers {_compat.MAX_TESTED_TRANSFORMERS_VERSION}",
)


def test_required_architectures_are_supported_and_at_least_forty():
    assert set(REQUIRED) <= set(supported_model_types())
    assert len(supported_model_types()) >= 40


def test_every_candidate_is_decided_verified_or_refused_by_hand():
    """Each candidate of the installed transformers is supported (verified by the matrix) or refused with a written
    reason; only a type the table has not decided falls back to the generic refusal."""
    supported = set(supported_model_types())
    # A verified type the source scan rules out is a stale entry, unless this transformers predates the type.
    assert set(VERIFIED_MODEL_TYPES) & set(causal_lm_classes()) == supported
    assert not supported & set(REFUSED_MODEL_TYPES)
    assert set(candidate_model_types()) <= supported | set(REFUSED_MODEL_TYPES)
    undecided = {t for t in candidate_model_types() if UNDECIDED in REFUSED_MODEL_TYPES.get(t, "")}
    assert undecided == KNOWN_UNDECIDED, "decide each new candidate: run the parity matrix on it"
    assert all(reason.strip() for reason in REFUSED_MODEL_TYPES.values())


def test_candidates_are_mapped_through_the_modeling_module_that_defines_the_class():
    # gemma3_text lives in models/gemma3, internlm3 (transformers 5.23+) reuses LlamaForCausalLM from models/llama.
    assert {"gemma3_text", "internlm3", "llama4_text"} & set(causal_lm_classes()) <= set(candidate_model_types())
    assert {"gemma3_text", "llama4_text"} <= set(candidate_model_types())


def test_every_causal_lm_that_calls_no_mask_builder_is_guarded_where_transformers_names_its_module():
    """`hook.builderless` guards the builderless causal LMs by their conventional module names, without reading every
    modeling file at configure time: the full scan (the module that defines each causal LM class) finds no
    builderless one elsewhere, and finds the pure SSMs and recurrent LMs among them."""
    guarded = set(architectures.causal_lm_modeling_modules())
    builderless = {}
    for model_type in causal_lm_classes():
        path = architectures._modeling_file(model_type)
        if path is not None and architectures._calls_no_builder(architectures._read(path)):
            builderless[model_type] = os.path.splitext(os.path.relpath(path, architectures._transformers_models_dir()))
    names = {t: "transformers.models." + stem.replace(os.sep, ".") for t, (stem, _) in builderless.items()}
    assert {"mamba", "falcon_mamba", "mamba2", "rwkv", "xlstm"} <= names.keys()
    assert set(names.values()) <= guarded, sorted(set(names.values()) - guarded)
    assert all(architectures.calls_no_mask_builder(name) for name in names.values())


def test_unreachable_architectures_are_refused():
    assert "without create_causal_mask" in REFUSED_MODEL_TYPES["openai-gpt"]
    assert "openai-gpt" not in supported_model_types()


@pytest.mark.parametrize("model_type", ["bailing_hybrid", "recurrent_gemma"])
def test_hybrid_whose_mixers_are_not_in_the_table_is_refused(model_type, monkeypatch):
    require_model_type(model_type)
    monkeypatch.delitem(MIXERS, model_type)
    assert "hybrid" in refusal_reason(model_type)
    with pytest.raises(UnsupportedSetupError, match=rf"model_type '{model_type}'.*hybrid"):
        require_supported(SimpleNamespace(model_type=model_type))


def test_require_supported_accepts_every_supported_type_and_reads_its_layer_types():
    for model_type in supported_model_types():
        assert require_supported(SimpleNamespace(model_type=model_type, layer_types=None)) is None, model_type
    # The same config with a layer kind that carries state across the row is refused: the check reads the config.
    with pytest.raises(UnsupportedSetupError, match=r"'llama'.*non-attention layers \['linear_attention'\]"):
        require_supported(SimpleNamespace(model_type="llama", layer_types=["full_attention", "linear_attention"]))


@pytest.mark.parametrize("model_type", ["openai-gpt", "no_such_model"])
def test_require_supported_names_the_refused_type(model_type):
    with pytest.raises(UnsupportedSetupError, match=rf"model_type '{model_type}'.*Supported model types: .*llama"):
        require_supported(SimpleNamespace(model_type=model_type))


def test_require_supported_refuses_non_attention_layers_of_a_supported_type():
    config = SimpleNamespace(model_type="qwen2", layer_types=["full_attention", "linear_attention"])
    with pytest.raises(UnsupportedSetupError, match=r"'qwen2'.*\['linear_attention'\]"):
        require_supported(config)


def test_hybrids_whose_mixers_are_isolated_are_supported():
    """llm_packing.hook.mixers re-batches their mixers per document; tests/test_parity.py and tests/test_mixers.py
    prove it."""
    assert {"qwen3_5_text", "qwen3_next", "nemotron_h", "mamba2", "lfm2", "jamba", "mamba", "recurrent_gemma"} <= set(
        supported_model_types()
    )
    require_supported(SimpleNamespace(model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"]))


def test_require_supported_looks_into_text_config():
    config = SimpleNamespace(model_type="llama", text_config=SimpleNamespace(layer_types=["mamba", "full_attention"]))
    with pytest.raises(UnsupportedSetupError, match="mamba"):
        require_supported(config)


def test_every_exact_cell_is_a_run_of_the_parity_or_flash_matrix():
    """The table claims `exact` only where tests/test_parity.py or tests/test_flash_path.py runs that architecture on
    that backend; `inferred` only on flash_attention_3/4 cells that are not run, whose flash_attention_2 cell is."""
    runs = {tuple(param.values[:2]) for param in test_parity.MATRIX} | set(test_flash_path.FLASH_MATRIX)
    backends = support_matrix.MATRIX_BACKENDS + support_matrix.FLASH_BACKENDS
    cells = {(t, backend): support_matrix._cell(t, backend) for t in supported_model_types() for backend in backends}
    for (model_type, backend), cell in cells.items():
        verdict = cell.split()[0]
        assert verdict in {"exact", "inferred", "n/a", "refused:"}, cell
        if verdict == "exact":
            assert (model_type, backend) in runs, (model_type, backend, "claimed exact, never run")
        if verdict == "inferred":
            assert backend in support_matrix.FLASH_SAMPLES and (model_type, backend) not in runs, (model_type, backend)
            assert cells[model_type, "flash_attention_2"] == cell.replace("inferred", "exact", 1), model_type
    for backend in support_matrix.FLASH_SAMPLES:
        inferred = sum(cells[t, backend].startswith("inferred") for t in supported_model_types())
        assert 0 < inferred < len(supported_model_types()), backend


def test_a_proven_type_the_installed_release_lacks_is_refused_with_the_reason(monkeypatch):
    """On an older admitted transformers, a type a later release added is refused, saying so, and listed as refused
    in the support table."""
    classes = {t: name for t, name in causal_lm_classes().items() if t != "llama"}  # as if this release lacked it
    monkeypatch.setattr(architectures, "_causal_lm_classes", lambda: classes)
    reason = refusal_reason("llama")
    assert reason.startswith(f"not in transformers {_compat.TRANSFORMERS_VERSION} (a later release has it")
    monkeypatch.setattr(architectures, "_refused_model_types", architectures._refused_model_types.__wrapped__)
    assert architectures._refused_model_types()["llama"] == reason


@pytest.mark.parametrize("backend", ["flash_attention_3", "flash_attention_4"])
def test_a_backend_an_older_release_cannot_build_is_not_available_there(monkeypatch, backend):
    """falcon's flash_attention_3 and _4 before transformers 5.23 (KeyError in transformers): n/a, with the reason."""
    monkeypatch.setattr(releases, "TRANSFORMERS_VERSION", Version("5.18.0"))
    assert not architectures.backend_available("falcon", backend)
    assert support_matrix._cell("falcon", backend).startswith("n/a (before transformers 5.23.0: Falcon")
    assert architectures.backend_available("falcon", "flash_attention_2")
    monkeypatch.setattr(releases, "TRANSFORMERS_VERSION", Version("5.23.0"))
    assert architectures.backend_available("falcon", backend)


def test_flash_cells_name_the_kernel_transformers_loads_instead():
    assert support_matrix._cell("gpt_oss", "flash_attention_2") == "exact (runs kernels-community/vllm-flash-attn3)"
    assert support_matrix._cell("mimo_v2_flash", "flash_attention_3") == "inferred (runs flash_attention_4)"
    assert support_matrix._cell("gpt_oss", "flash_attention_4") == "exact"  # FA4 is among its own kernels
    assert support_matrix._cell("mistral", "flash_attention_4") == "inferred"
    assert support_matrix._cell("mpt", "flash_attention_2") == "n/a"


@newest_only
def test_committed_support_matrix_is_what_the_generator_prints():
    with open(DOC, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == support_matrix.support_matrix_markdown(), (
        "docs/support_matrix.md is stale: run `python -m llm_packing.hook.support.matrix > docs/support_matrix.md`"
    )


@newest_only
def test_documented_counts_are_the_tables():
    """The supported and refused counts of the README and docs/guarantees.md are `supported_model_types()` and the
    refused table, so a type added to or dropped from the matrix cannot leave the documents behind."""
    import re

    from llm_packing.hook.support.architectures import _refused_model_types

    def words(path):
        with open(os.path.join(os.path.dirname(DOC), os.pardir, path), encoding="utf-8") as handle:
            return " ".join(handle.read().split())

    headline = re.search(r"(\d+) causal LM types of transformers", words("README.md"))
    guarantees = words("docs/guarantees.md")
    supported = re.search(r"(\d+) model types are supported", guarantees)
    refused = re.search(r"The other (\d+) causal LMs are refused", guarantees)
    hybrids = re.search(r"Hybrid and recurrent models are among the (\d+): (\d+) types", guarantees)
    assert headline and supported and refused and hybrids, "the support paragraphs changed wording: update this test"
    assert int(headline.group(1)) == int(supported.group(1)) == int(hybrids.group(1)) == len(supported_model_types())
    assert int(refused.group(1)) == len(_refused_model_types())
    assert int(hybrids.group(2)) == len(MIXERS)
    image_text = re.search(r"The image-text types of `hook/support/image_text.py` \((\d+),", guarantees)
    assert image_text and int(image_text.group(1)) == len(supported_image_text_model_types())


def test_every_image_text_type_is_proven_or_refused_with_its_own_reason():
    """The image-text table decides every type of transformers' image-text mapping by hand: proven by
    tests/test_image_text_parity.py, or refused with a reason of its own (never the generic fallback)."""
    types = set(image_text_model_types())
    assert set(supported_image_text_model_types()) == set(PROVEN_IMAGE_TEXT_TYPES) & types
    assert types <= set(PROVEN_IMAGE_TEXT_TYPES) | set(REFUSED_IMAGE_TEXT_TYPES)
    assert not set(PROVEN_IMAGE_TEXT_TYPES) & set(REFUSED_IMAGE_TEXT_TYPES)
    reasons = refused_image_text_model_types()
    assert all(reason.strip() and "not verified" not in reason for reason in reasons.values())
    assert len(supported_image_text_model_types()) >= 15


@newest_only
def test_image_text_table_has_no_stale_entries():
    """On the newest tested transformers every entry is a type it has (older releases lack some)."""
    types = set(image_text_model_types())
    assert set(PROVEN_IMAGE_TEXT_TYPES) <= types
    assert types == set(PROVEN_IMAGE_TEXT_TYPES) | set(REFUSED_IMAGE_TEXT_TYPES)


def test_every_exact_image_text_cell_is_a_run_of_the_image_text_matrix():
    runs = {tuple(param.values[:2]) for param in test_image_text_parity.MATRIX}
    for model_type in supported_image_text_model_types():
        for backend in support_matrix.IMAGE_TEXT_BACKENDS:
            if support_matrix._image_text_cell(model_type, backend).startswith("exact"):
                assert (model_type, backend) in runs, (model_type, backend)


def test_supported_model_types_stays_the_causal_lm_list():
    assert "llava" not in supported_model_types() and "llava" in supported_image_text_model_types()
    assert "gemma3" in supported_model_types() and "gemma3" in supported_image_text_model_types()


@pytest.mark.parametrize(("model_type", "refused"), [
    ("llava", {}),
    ("qwen2_5_vl", {"flex_attention": "proved it on eager, sdpa, flash_attention_2"}),
    ("paligemma", {"flash_attention_2": "not on 'flash_attention_2': FlashAttention's varlen kernel attends each "
                                        "document as one causal segment, and cannot express bidirectional image"}),
    ("mllama", {}),  # a causal LM type too: its text-only batches keep that table's backends
])
def test_require_supported_takes_an_image_text_type_on_its_proven_backends(model_type, refused):
    config = AutoConfig.for_model(model_type)
    for backend in ("sdpa", "flash_attention_2", "flex_attention"):
        config._attn_implementation = backend
        if backend in refused:
            with pytest.raises(UnsupportedSetupError, match=refused[backend]):
                require_supported(config)
        else:
            require_supported(config)


def test_require_supported_refuses_a_refused_image_text_type():
    with pytest.raises(UnsupportedSetupError, match="'qwen2_5_omni_thinker'"):
        require_supported(AutoConfig.for_model("qwen2_5_omni_thinker"))
    with pytest.raises(UnsupportedSetupError, match=r"attention_mask == 1"):
        require_images_supported("qwen2_5_omni_thinker", "sdpa")
