"""The hook's mechanics: idempotent, reversible, inert on plain masks, and loud on every setup it cannot isolate.
Exactness per architecture and backend is tests/test_parity.py."""

import functools
import importlib
import os
import sys
import types
import warnings

import pytest
import torch
import transformers.masking_utils as masking_utils
import transformers.modeling_flash_attention_utils as flash_utils
from test_parity import _max_differences
from tiny_models import packed_batch, require_model_type, tiny_model
from transformers.models.llama import modeling_llama

import llm_packing
from llm_packing import (
    ContaminationError,
    IncompatibleTransformersError,
    UnsupportedSetupError,
    _compat,
    configure_packing,
    is_packing_configured,
    packing_configured,
    supported_model_types,
    unconfigure_packing,
    verify_packing,
)
from llm_packing._compat import MASK_BUILDER_NAMES


# A modeling module that imports `create_causal_mask` by name and that the `model` fixture does not import itself.
LATE_MODULE = "transformers.models.mistral.modeling_mistral"
PACKED = {
    "input_ids": torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]),
    "attention_mask": torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]),
    "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]]),
}


@pytest.fixture
def model():
    model = tiny_model("llama", attn_implementation="sdpa")
    yield model
    unconfigure_packing()


def _bindings():
    return {
        "masking_utils": [getattr(masking_utils, name) for name in MASK_BUILDER_NAMES],
        "modeling_llama": [modeling_llama.create_causal_mask],
        "flash": [flash_utils._get_unpad_data],
        "mapping": dict(masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING),
    }


def _is_hook_wrapper(function) -> bool:
    """transformers' own decorators (5.24's `deprecate_kwarg`) set `__wrapped__` too: look at whose code runs."""
    return os.path.dirname(function.__code__.co_filename) == os.path.dirname(llm_packing.__file__)


class TestPatching:
    def test_nothing_is_patched_at_import(self):
        assert not is_packing_configured()
        assert modeling_llama.create_causal_mask is masking_utils.create_causal_mask
        assert masking_utils.create_causal_mask.__module__ == "transformers.masking_utils"
        assert not _is_hook_wrapper(masking_utils.create_causal_mask)

    def test_configure_is_idempotent_and_unconfigure_restores_every_original(self, model):
        before = _bindings()
        configure_packing(model)
        patched = _bindings()
        configure_packing(model)
        assert _bindings() == patched
        assert patched["masking_utils"] != before["masking_utils"]
        assert patched["modeling_llama"] != before["modeling_llama"]
        assert patched["flash"] != before["flash"]
        assert patched["mapping"]["full_attention"] is not before["mapping"]["full_attention"]
        assert isinstance(patched["mapping"]["indexed_attention"], functools.partial)
        unconfigure_packing()
        after = _bindings()
        for key in ("masking_utils", "modeling_llama", "flash"):
            assert all(a is b for a, b in zip(after[key], before[key], strict=True)), key
        assert all(after["mapping"][key] is value for key, value in before["mapping"].items())
        unconfigure_packing()
        assert not is_packing_configured()

    def test_context_manager_restores_on_exit_and_on_error(self, model):
        original = modeling_llama.create_causal_mask
        with packing_configured(model):
            assert is_packing_configured()
            assert modeling_llama.create_causal_mask is not original
        assert modeling_llama.create_causal_mask is original
        with pytest.raises(RuntimeError, match="boom"), packing_configured(model):
            raise RuntimeError("boom")
        assert not is_packing_configured()

    def test_modules_imported_after_configure_bind_the_patched_builder(self, model, monkeypatch):
        # A modeling module imported for the first time after configure_packing: taken out of sys.modules and of its
        # package (both put back afterwards), so that the import below runs its `from ... import create_causal_mask`.
        original = masking_utils.create_causal_mask
        package, _, name = LATE_MODULE.rpartition(".")
        monkeypatch.delitem(sys.modules, LATE_MODULE, raising=False)
        monkeypatch.delattr(importlib.import_module(package), name, raising=False)
        configure_packing(model)
        late = importlib.import_module(LATE_MODULE)

        assert late.create_causal_mask is not original
        assert late.create_causal_mask.__wrapped__ is original
        assert late.create_causal_mask is modeling_llama.create_causal_mask is masking_utils.create_causal_mask
        unconfigure_packing()
        assert late.create_causal_mask is original

    def test_attn_implementation_argument_switches_the_backend(self, model):
        configure_packing(model, attn_implementation="eager")
        assert model.config._attn_implementation == "eager"
        assert verify_packing(model, atol=1e-5) <= 1e-5


BUILDERLESS_IMPORTED_AFTER_CONFIGURING = """
import sys
sys.path.insert(0, {tests!r})
import torch
from tiny_models import tiny_model
from llm_packing import ContaminationError, configure_packing, unconfigure_packing
configure_packing(tiny_model("llama"))
print("imported" if "transformers.models.mamba.modeling_mamba" in sys.modules else "not-imported", "later")
mamba = tiny_model("mamba", "eager")
try:
    mamba(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 2, 2]]))
    print("accepted")
except ContaminationError:
    print("refused")
unconfigure_packing()
print("finders:%d" % sum(type(finder).__name__ == "_PatchOnImport" for finder in sys.meta_path))
"""


class TestBehaviour:
    def test_packed_batch_is_contaminated_without_the_hook_and_exact_with_it(self, model):
        with pytest.raises(ContaminationError, match="configure_packing"):
            verify_packing(model)
        configure_packing(model)
        assert verify_packing(model, atol=1e-5) <= 1e-5

    def test_plain_padding_mask_gives_identical_logits_with_and_without_the_hook(self, model):
        batch = {"input_ids": PACKED["input_ids"], "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])}
        with torch.no_grad():
            plain = model(**batch, use_cache=False).logits
            configure_packing(model)
            hooked = model(**batch, use_cache=False).logits
        assert torch.equal(plain, hooked)

    def test_use_cache_with_a_packed_batch_raises(self, model):
        configure_packing(model)
        with torch.no_grad(), pytest.raises(ContaminationError, match="use_cache=False"):
            model(**PACKED, use_cache=True)

    def test_positions_that_do_not_restart_per_document_raise(self, model):
        configure_packing(model)
        batch = {**PACKED, "position_ids": torch.arange(6).expand(2, 6)}
        with torch.no_grad(), pytest.raises(ContaminationError, match="row 0 position 2 has 2"):
            model(**batch, use_cache=False)

    def test_malformed_document_ids_raise(self, model):
        configure_packing(model)
        batch = {**PACKED, "attention_mask": torch.tensor([[1, 1, 2, 2, 1, 0], [1, 2, 2, 3, 3, 3]])}
        with torch.no_grad(), pytest.raises(ValueError, match="numbered 1, 2, 3"):
            model(**batch, use_cache=False)

    def test_a_model_of_a_type_never_configured_refuses_packed_batches(self, model):
        """The mask builders are patched for every model, mixers and rotary embeddings per configured type: a second
        model of another type (here a hybrid whose short convolutions would leak) refuses packed batches until it is
        configured too. Its plain batches, and the configured type's, run."""
        configure_packing(model)
        hybrid = tiny_model("lfm2", attn_implementation="sdpa")
        refused = r"model_type 'lfm2', which `configure_packing` was not called for \(configured: \['llama'\]\)"
        with torch.no_grad(), pytest.raises(ContaminationError, match=refused):
            hybrid(**PACKED, use_cache=False)
        with torch.no_grad():
            hybrid(input_ids=PACKED["input_ids"], attention_mask=torch.ones(2, 6, dtype=torch.long), use_cache=False)
        configure_packing(hybrid)
        assert verify_packing(hybrid) >= 0 and verify_packing(model) >= 0
        unconfigure_packing()
        configure_packing(hybrid)
        with torch.no_grad(), pytest.raises(ContaminationError, match=r"'llama', which `configure_packing` was not"):
            model(**PACKED, use_cache=False)

    @pytest.mark.parametrize("model_type", ["llama", "biogpt", "xglm", "opt", "git"])
    def test_a_packed_batch_without_position_ids_gets_each_documents_own(self, model_type):
        """Given the indexed mask alone, each document is numbered from 0 as the collator would. biogpt, xglm and git
        build their mask before numbering positions, so the builders' position check never saw them: their packed
        documents took the row's positions (0.11-0.57 off alone), opt's the mask's cumulative sum (a raw
        `IndexError`), and llama refused the batch."""
        model = tiny_model(model_type, attn_implementation="eager").eval()
        batch = packed_batch()
        with packing_configured(model), torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            assert max(_max_differences(model, batch, logits=logits.logits)) <= 1e-5

    def test_every_supported_causal_lm_calls_the_module_its_guards_sit_on(self):
        """The guards and the positions hook sit on one module per model (`guards.input_module`): every supported
        type's causal LM calls it (OPT's calls its base model's decoder directly, so OPT's guards never ran)."""
        from llm_packing.hook.guards import input_module

        called, not_called = [], []
        for model_type in supported_model_types():
            model = tiny_model(model_type, attn_implementation="eager").eval()
            called.clear()
            handle = input_module(model).register_forward_pre_hook(lambda *arguments: called.append(1))
            with torch.no_grad():
                model(input_ids=torch.randint(3, 50, (1, 6)), use_cache=False)
            handle.remove()
            not_called += [] if called else [model_type]
        assert not_called == []

    @pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "mamba2", "rwkv", "xlstm"])
    def test_a_model_that_calls_no_mask_builder_refuses_packed_batches_until_configured(self, model, model_type):
        """Pure SSMs and recurrent LMs call no mask builder, so the builders' refusal never reached them: once a Llama
        was configured, an unconfigured mamba took the collator's packed batches silently (4.9-5.4 off alone). Their
        model classes now refuse an indexed mask and a padding-free batch; their plain batches run unchanged, and once
        configured their packed batches equal each document alone."""
        configure_packing(model)
        other = tiny_model(model_type, attn_implementation="eager").eval()
        refused = rf"model_type '{model_type}', which `configure_packing` was not called for \(configured: \['llama'\]"
        ids = PACKED["input_ids"]
        with torch.no_grad():
            with pytest.raises(ContaminationError, match=refused):
                other(**PACKED, use_cache=False)
            with pytest.raises(ContaminationError, match="restarting"):
                other(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1, 2, 0]] * 2), use_cache=False)
            ones = torch.ones_like(ids)
            plain = other(input_ids=ids, attention_mask=ones, use_cache=False).logits
            unconfigure_packing()
            assert torch.equal(plain, other(input_ids=ids, attention_mask=ones, use_cache=False).logits)
            configure_packing(model)
            configure_packing(other)
            assert verify_packing(other) >= 0
            unconfigure_packing()
            other(**PACKED, use_cache=False)  # the control: without the hook nothing refuses it

    def test_a_builderless_model_imported_after_configuring_refuses_packed_batches(self):
        """Builderless modeling modules are patched as they are imported (importing them all up front costs seconds):
        in a fresh interpreter, a mamba first imported after configuring a Llama refuses the packed batch, and
        `unconfigure_packing` removes the import finder."""
        import subprocess

        script = BUILDERLESS_IMPORTED_AFTER_CONFIGURING.format(tests=os.path.dirname(os.path.abspath(__file__)))
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.split()[-4:] == ["not-imported", "later", "refused", "finders:0"]

    @pytest.mark.parametrize(("backend", "route"), [("sdpa", "dense"), ("sdpa", "varlen"), ("eager", None)])
    def test_a_piece_of_packed_rows_needs_sequence_parallelism(self, backend, route):
        """`shard_packed_batch` hands a rank a piece of every row with the whole rows' indexed mask: without
        `configure_sequence_parallel`, refused on every backend before any layer runs (the dense route and eager
        attended each piece on its own, silently). The whole rows run."""
        from sequence_parallel_worker import packed_rows

        from llm_packing import shard_packed_batch

        model = tiny_model("llama", attn_implementation=backend).eval()
        batch = packed_rows(((5, 1, 7, 3), (9, 2, 1, 6)))
        with packing_configured(model, **({"attention_route": route} if route else {})), torch.no_grad():
            with pytest.raises(UnsupportedSetupError, match=r"A piece of 9 tokens a row .* whole rows of 18 tokens"):
                model(**shard_packed_batch(batch, 1, 2))
            model(**batch)

    def test_four_dimensional_mask_in_a_training_forward_raises(self, model):
        configure_packing(model)
        mask = torch.zeros(2, 1, 6, 6)
        with pytest.raises(UnsupportedSetupError, match="4-D `attention_mask`"):
            model(input_ids=PACKED["input_ids"], attention_mask=mask, use_cache=False)

    def test_unknown_attention_backend_raises_at_configure_and_at_forward(self, model):
        from transformers import AttentionInterface

        AttentionInterface.register("my_kernel", AttentionInterface._global_mapping["sdpa"])
        try:
            model.config._attn_implementation = "my_kernel"
            with pytest.raises(UnsupportedSetupError, match="'my_kernel'"):
                configure_packing(model)
            model.config._attn_implementation = "sdpa"
            configure_packing(model)
            model.config._attn_implementation = "my_kernel"
            with torch.no_grad(), pytest.raises(UnsupportedSetupError, match="'my_kernel'"):
                model(**PACKED, use_cache=False)
        finally:
            model.config._attn_implementation = "sdpa"
            del AttentionInterface._global_mapping["my_kernel"]


class TestVersionChecks:
    def test_transformers_older_than_the_minimum_fails_closed(self, model, monkeypatch):
        monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", _compat.Version("5.8.0"))
        with pytest.raises(IncompatibleTransformersError, match="older than the minimum"):
            configure_packing(model)
        assert not is_packing_configured()

    def test_missing_builder_parameter_fails_closed(self, model, monkeypatch):
        monkeypatch.setattr(_compat, "MASK_BUILDER_PARAMETERS", (*_compat.MASK_BUILDER_PARAMETERS, "cache_position"))
        with pytest.raises(IncompatibleTransformersError, match="cache_position"):
            configure_packing(model)
        assert not is_packing_configured()

    def test_unpad_lookup_moved_fails_closed(self, model, monkeypatch):
        monkeypatch.setattr(flash_utils, "_upad_input", lambda *args: None)
        with pytest.raises(IncompatibleTransformersError, match="_get_unpad_data"):
            configure_packing(model)

    def test_newer_untested_version_warns_once(self, model, monkeypatch):
        monkeypatch.setattr(_compat, "TRANSFORMERS_VERSION", _compat.Version("99.0.0"))
        monkeypatch.setattr(_compat, "_warned_untested", False)
        with pytest.warns(UserWarning, match="tested with transformers"):
            configure_packing(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            configure_packing(model)


class TestRefusals:
    def test_hybrid_architecture_is_refused_and_nothing_is_patched(self, monkeypatch):
        from transformers import AutoConfig

        from llm_packing.hook.mixers import MIXERS

        require_model_type("bailing_hybrid")  # transformers 5.20+
        monkeypatch.delitem(MIXERS, "bailing_hybrid")  # a hybrid whose mixers the table does not isolate
        with pytest.raises(UnsupportedSetupError, match="'bailing_hybrid'.*hybrid"):
            configure_packing(AutoConfig.for_model("bailing_hybrid"))
        assert not is_packing_configured()
        assert not _is_hook_wrapper(modeling_llama.create_causal_mask)

    def test_remote_modeling_code_is_refused_and_would_leak(self, model, monkeypatch):
        """A hub checkpoint loaded with `trust_remote_code=True` keeps a supported `model_type` but runs its own code
        (its classes live in `transformers_modules`); this one makes its mask from `attention_mask[:, None, None, :]`,
        as older hub code does. Refused, nothing patched; with the check undone, packed documents leak."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        from llm_packing.hook.support import architectures

        class RemoteLlamaModel(modeling_llama.LlamaModel):
            def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
                hidden = self.embed_tokens(input_ids)
                causal = torch.ones(hidden.shape[1], hidden.shape[1], dtype=torch.bool).tril()[None, None]
                mask = causal if attention_mask is None else causal & attention_mask[:, None, None, :].bool()
                if position_ids is None:
                    position_ids = torch.arange(hidden.shape[1])[None]
                embeddings = self.rotary_emb(hidden, position_ids=position_ids)
                for layer in self.layers:
                    hidden = layer(hidden, attention_mask=mask, position_embeddings=embeddings)
                return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))

        RemoteLlamaModel.__module__ = "transformers_modules.someone.modeling_remote"
        remote = modeling_llama.LlamaForCausalLM(model.config)
        remote.model = RemoteLlamaModel(model.config)
        remote.load_state_dict(model.state_dict())
        with pytest.raises(UnsupportedSetupError, match=r"RemoteLlamaModel \(module transformers_modules\.someone.*"
                                                         r"Load the model without `trust_remote_code`"):
            configure_packing(remote)
        assert not is_packing_configured()
        monkeypatch.setattr(architectures, "require_transformers_modeling_code", lambda model: None)
        configure_packing(remote)
        with pytest.raises(ContaminationError):
            verify_packing(remote)

    def test_large_dense_mask_warns_once_with_the_linear_memory_alternative(self, model, monkeypatch):
        from llm_packing.hook import builders

        monkeypatch.setattr(builders, "DENSE_MASK_WARNING_BYTES", 2 * 6 * 6 - 1)
        monkeypatch.setattr(builders, "_warned_dense_mask", False)
        configure_packing(model, attention_route="dense")  # the default varlen route builds no dense mask
        with torch.no_grad(), pytest.warns(UserWarning, match="flash_attention_2"):
            model(**PACKED, use_cache=False)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**PACKED, use_cache=False)


def _every_binding(models) -> dict:
    """Every name transformers binds (module attributes, attributes of the classes its modules define, the attention
    and mask registries), and the forward pre-hooks of `models`' modules: key -> the object itself."""
    from transformers import modeling_utils

    bound = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("transformers"):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType):  # a lazy package caches its submodules as they are first used
                continue
            bound[module_name, attribute] = value
            if isinstance(value, type) and value.__module__ == module_name:
                bound.update({(module_name, attribute, name): member for name, member in list(vars(value).items())})
    registries = {
        "attention": modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping,
        "masks": masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
        "layer patterns": masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING,
    }
    bound.update({(name, key): value for name, registry in registries.items() for key, value in registry.items()})
    bound["torch._dynamo.config", "recompile_limit"] = torch._dynamo.config.recompile_limit  # `hook.compile_limits`
    for index, model in enumerate(models):
        for name, module in model.named_modules():
            bound.update({("hooks", index, name, key): hook for key, hook in module._forward_pre_hooks.items()})
    return bound


def test_unconfigure_restores_every_rebound_name_and_the_registry_lists_them():
    """Every kind of replacement at once: mask builders and unpad (llama), sdpa's function (varlen), hybrid mixers
    (qwen3_5_text), a model's `__call__` (rwkv), ALiBi builders (bloom), media guards (gemma3) and the training-batch
    guards. Afterwards every binding is the object it was before, and while configured, what changed is exactly
    what the registry lists."""
    from llm_packing.hook import registry

    models = [tiny_model(t, b) for t, b in
              (("llama", "sdpa"), ("qwen3_5_text", "sdpa"), ("rwkv", "eager"), ("bloom", "eager"), ("gemma3", "sdpa"))]
    before = _every_binding(models)
    for model in models:
        configure_packing(model)
    during = _every_binding(models)
    changed = {key for key in before.keys() | during.keys() if before.get(key, None) is not during.get(key, None)}
    listed = registry.replaced_objects()
    unconfigure_packing()
    after = _every_binding(models)
    assert after.keys() == before.keys()
    assert [key for key, value in before.items() if after[key] is not value] == []
    assert {key[0] for key in changed} >= {"attention", "layer patterns", "hooks"}
    changed_names = {_owner_and_name(key) for key in changed if key[0] != "hooks"}
    assert {(id(owner), name) for owner, name in listed} == changed_names


def _owner_and_name(key) -> tuple[int, str]:
    """`(id(owner), name)` of a key of `_every_binding` (a module or class attribute, or a registry entry)."""
    from transformers import modeling_utils

    registries = {"attention": modeling_utils.ALL_ATTENTION_FUNCTIONS._global_mapping,
                  "masks": masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
                  "layer patterns": masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING}
    if key[0] in registries:
        return id(registries[key[0]]), key[1]
    owner = sys.modules[key[0]]
    if len(key) == 3:
        owner = getattr(owner, key[1])
    return id(owner), key[-1]
