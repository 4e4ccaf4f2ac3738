"""The training entry point: recipes parse, bad recipes are refused by name, and the tiny recipe trains for real,
packed or not (same first-step loss), with LoRA, from the console script and as a 2-process `accelerate launch` job."""

import ast
import dataclasses
import glob
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from transformers import set_seed

from llm_packing.cli.documents import load_documents, load_tokenizer, tokenize_documents
from llm_packing.cli.startup import load_model
from llm_packing.cli.train import main, parse_args
from llm_packing.errors import PackingValueError, UnsupportedSetupError


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
ACCELERATE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "recipes", "accelerate", "*.yaml")))
TINY = os.path.join(ROOT, "recipes", "tiny-cpu.yaml")
TINY_LORA = os.path.join(ROOT, "recipes", "tiny-cpu-lora.yaml")


def write_recipe(tmp_path, **changes) -> str:
    with open(TINY, encoding="utf-8") as file:
        recipe = yaml.safe_load(file)
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return str(path)


def test_recipes_exist():
    names = {os.path.basename(path) for path in RECIPES + ACCELERATE_CONFIGS}
    assert {"tiny-cpu.yaml", "tiny-cpu-lora.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed-zero3.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_parses(path, tmp_path):
    # GPU recipes ask for bf16, which TrainingArguments refuses on a CPU-only machine unless told to use the CPU.
    on_cpu = [] if torch.cuda.is_available() else ["--use_cpu", "true"]
    script_args, training_args, model_args, packing_args = parse_args(
        ["--config", path, "--output_dir", str(tmp_path), *on_cpu]
    )
    # GRPOConfig (`trainer: grpo`) bounds the completion; its batches pack into one row each.
    assert getattr(training_args, "max_length", None) or training_args.max_completion_length > 0
    assert packing_args.block_diag_attn is True
    assert getattr(training_args, "packing", False) is False  # our packing, never TRL's (DPOConfig: no such key)
    assert (model_args.model_name_or_path is None) != (script_args.model_config is None)
    if model_args.attn_implementation.startswith("flash_attention"):
        assert packing_args.max_docs_per_bin is not None  # bounds cu_seqlens per row


def test_gpu_recipe_takes_flash_attention_4(tmp_path):
    """The `[flash]` extra's kernel in place of the recipe's flash_attention_2, from the command line."""
    _, _, model_args, packing_args = parse_args(["--config", os.path.join(ROOT, "recipes", "qwen2.5-0.5b-sft.yaml"),
                                                 "--attn_implementation", "flash_attention_4", "--use_cpu", "true",
                                                 "--output_dir", str(tmp_path)])
    assert model_args.attn_implementation == "flash_attention_4" and packing_args.max_docs_per_bin == 512


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=os.path.basename)
def test_every_accelerate_config_parses(path):
    config = load_config_from_file(path)
    assert config.num_processes >= 2
    assert config.distributed_type.value in {"MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED"}


def test_command_line_overrides_recipe(tmp_path):
    script_args, training_args, _, packing_args = parse_args(
        ["--config", TINY, "--max_steps", "7", "--packing_strategy", "wfd", "--max_samples=5", "--learning_rate",
         "0.5", "--output_dir", str(tmp_path)]
    )
    assert (training_args.max_steps, packing_args.packing_strategy, script_args.max_samples) == (7, "wfd", 5)
    assert training_args.learning_rate == 0.5


def test_recipe_finds_its_chat_template_beside_it(tmp_path, monkeypatch):
    recipe = os.path.join(ROOT, "recipes", "smollm2-135m-lora.yaml")
    beside = os.path.join(ROOT, "recipes", "chat_templates", "smollm2_training.jinja")
    monkeypatch.chdir(tmp_path)  # not the repository root
    assert parse_args(["--config", recipe])[1].chat_template_path == beside
    (tmp_path / "mine.jinja").write_text("{{ messages }}")  # a flag names a file in the working directory
    assert parse_args(["--config", recipe, "--chat_template_path", "mine.jinja"])[1].chat_template_path == "mine.jinja"


def test_config_equals_form(tmp_path):
    _, training_args, _, _ = parse_args([f"--config={TINY}", "--output_dir", str(tmp_path)])
    assert training_args.max_length == 512


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"block_diag_atn": True}, PackingValueError, r"Unknown key 'block_diag_atn'.*did you mean 'block_diag_attn'"),
        ({"learning_rat": 1e-3}, PackingValueError, r"Unknown key 'learning_rat'.*did you mean 'learning_rate'"),
        ({"packing_strategy": "best"}, PackingValueError, r"`packing_strategy` must be one of .*'bfd'.*got 'best'"),
        ({"overflow": "wrap"}, PackingValueError, r"`overflow` must be one of .*got 'wrap'"),
        ({"max_docs_per_bin": 0}, PackingValueError,
         r"`max_docs_per_bin` must be a positive integer or None \(no cap\), got 0"),
        ({"packing": True}, PackingValueError, r"`packing: true` turns on TRL's own packing"),
        ({"max_length": None}, PackingValueError, r"`max_length` must be a positive integer"),
        ({"model_name_or_path": "some/model"}, PackingValueError, r"exactly one of `model_name_or_path`"),
        ({"block_diag_attn": False, "padding_free": True}, PackingValueError, r"`padding_free: true` flattens"),
        ({"max_samples": 0}, PackingValueError, r"`max_samples` must be a positive integer or None, got 0"),
        ({"load_in_4bit": True}, UnsupportedSetupError, r"`load_in_4bit` / `load_in_8bit` are not supported"),
        ({"packing_engine": "spark"}, PackingValueError, r"`packing_engine` must be one of \('local', 'ray'\)"),
        ({"ray_address": "auto"}, PackingValueError, r"`ray_address: auto` is read by `packing_engine: ray` only"),
        ({"packed_dir": "/tmp/x"}, PackingValueError, r"`packed_dir: /tmp/x` is read by `packing_engine: ray`"),
    ],
)
def test_bad_recipe_is_refused_by_name(tmp_path, changes, error, match):
    with pytest.raises(error, match=match):
        parse_args(["--config", write_recipe(tmp_path, **changes)])


def test_badly_typed_value_names_the_key(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", write_recipe(tmp_path, max_docs_per_bin="many")])
    assert "argument --max_docs_per_bin" in capsys.readouterr().err


def test_unknown_flag_names_the_closest(tmp_path):
    with pytest.raises(PackingValueError, match=r"Unknown flag '--max_step'.*did you mean 'max_steps'"):
        parse_args(["--config", TINY, "--max_step", "3"])


@pytest.mark.parametrize(
    ("text", "match"),
    [("- just\n- a list\n", r"must be a YAML mapping"), ("max_length: [1, 2\n", r"is not valid YAML"),
     ("model: !!python/object/apply:os.system ['true']\n", r"is not valid YAML")],
    ids=["list", "malformed", "python-tag"],
)
def test_malformed_recipe(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PackingValueError, match=match):
        parse_args(["--config", str(path)])


def test_config_flag_without_path():
    with pytest.raises(PackingValueError, match=r"`--config` needs a recipe path"):
        parse_args(["--config", "--max_steps", "3"])


# Rows of 128 tokens for the first-step comparisons: the 4 chats' 1,853 tokens cut into 128-token pieces pad to fewer
# positions than into 512-token ones, and TRL's CPU loss scores every position.
SHORT_ROWS = 128


def first_step_loss(tmp_path, **changes) -> float:
    """Loss of one optimizer step over all documents of the recipe (one batch holds every row, packed or not)."""
    recipe = write_recipe(tmp_path, max_samples=4, max_length=SHORT_ROWS, per_device_train_batch_size=32, max_steps=1,
                          output_dir=str(tmp_path / "out"), **changes)
    return main(["--config", recipe]).training_loss


def independent_unpacked_loss(tmp_path, attn_implementation) -> float:
    """The recipe's model and documents without pack_dataset or DataCollatorWithPacking: each document cut into
    `max_length` pieces (as `overflow: split` does), one piece per right-padded row with a 0/1 mask, through
    transformers' own loss: what the first training step reports before it updates the weights."""
    recipe = write_recipe(tmp_path, max_samples=4, max_length=SHORT_ROWS, attn_implementation=attn_implementation)
    script_args, training_args, model_args, _ = parse_args(["--config", recipe, "--output_dir", str(tmp_path / "ref")])
    set_seed(training_args.seed)  # as train() does before building the model: the same random weights
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path)
    model = load_model(script_args, model_args, training_args, tokenizer)
    documents = tokenize_documents(load_documents(script_args.dataset_name, max_samples=script_args.max_samples),
                                   tokenizer, assistant_only_loss=training_args.assistant_only_loss)
    length = training_args.max_length
    pieces = [(ids[start : start + length], labels[start : start + length])
              for ids, labels in zip(documents["input_ids"], documents["labels"], strict=True)
              for start in range(0, len(ids), length)]
    assert len(pieces) > len(documents)  # the split policy is exercised
    width = max(len(ids) for ids, _ in pieces)
    padding = [width - len(ids) for ids, _ in pieces]
    rows = list(zip(pieces, padding, strict=True))
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * pad for (ids, _), pad in rows])
    labels = torch.tensor([piece_labels + [-100] * pad for (_, piece_labels), pad in rows])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * pad for (ids, _), pad in rows])
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_and_unpacked_first_step_loss_match(tmp_path, attn_implementation):
    reference = independent_unpacked_loss(tmp_path, attn_implementation)
    unpacked = first_step_loss(tmp_path, block_diag_attn=False, attn_implementation=attn_implementation)
    packed = first_step_loss(tmp_path, block_diag_attn=True, attn_implementation=attn_implementation)
    padding_free = first_step_loss(tmp_path, block_diag_attn=True, padding_free=True,
                                   attn_implementation=attn_implementation)
    assert reference > 9  # a random 32k-vocab model: about ln(32000) = 10.4
    assert unpacked == pytest.approx(reference, abs=1e-5)
    assert packed == pytest.approx(reference, abs=1e-5)
    assert padding_free == pytest.approx(reference, abs=1e-5)


def logged_losses(output: str) -> list[float]:
    return [float(ast.literal_eval(line)["loss"]) for line in re.findall(r"\{'loss': [^}]*\}", output)]


def run(command: list[str], tmp_path, timeout=600) -> str:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_tiny_recipe_trains_and_loss_goes_down(tmp_path):
    output = run([sys.executable, "-m", "llm_packing.train", "--config", TINY, "--max_steps", "6",
                  "--logging_steps", "2", "--output_dir", str(tmp_path / "out")], tmp_path)
    assert "isolation verified" in output
    assert len(re.findall(r"efficiency \d+\.\d+%", output)) == 1  # packing stats are printed, once
    losses = logged_losses(output)
    assert len(losses) == 3
    assert losses[-1] < losses[0] - 0.3, losses
    last, mean = re.search(r"last logged loss (\S+) \(step 6\); mean loss over the run (\S+)", output).groups()
    assert float(last) == pytest.approx(losses[-1], rel=1e-3) and float(mean) > float(last)  # logs are rounded
    assert os.path.exists(tmp_path / "out" / "model.safetensors")
    assert f"model saved to {tmp_path / 'out'} (" in output and "model.safetensors" in output


@pytest.mark.slow
def test_lora_recipe_trains_adapters(tmp_path):
    # Rows of 256 tokens, 2 a step (the recipe's 4 of 1024 took 8 s a step here: TRL's loss scores 32,000 logits a
    # token on CPU).
    output = run(["llm-packing", "train", "--config", TINY_LORA, "--max_steps", "3", "--logging_steps", "1",
                  "--max_samples", "20", "--max_length", "256", "--per_device_train_batch_size", "2",
                  "--output_dir", str(tmp_path / "out")], tmp_path)
    assert "isolation verified" in output
    assert len(logged_losses(output)) == 3
    assert os.path.exists(tmp_path / "out" / "adapter_config.json")
    assert os.path.exists(tmp_path / "out" / "adapter_model.safetensors")


@pytest.mark.slow
def test_accelerate_two_process_cpu_run(tmp_path):
    # 8 chats pack into 5 rows: an odd count, so one rank gets a padded last batch rather than one batch fewer.
    output = run(["accelerate", "launch", "--config_file", os.path.join(ROOT, "recipes", "accelerate", "cpu-ddp.yaml"),
                  "-m", "llm_packing.train", "--config", TINY, "--max_samples", "8",
                  "--output_dir", str(tmp_path / "out")], tmp_path)
    assert output.count("5 bins of 512 tokens") == 1  # rank 0 tells, once
    batches = re.findall(r"on \[(\d+), (\d+)\] batches \(per rank\)", output)
    assert len(batches) == 1, output[-4000:]
    assert batches[0][0] == batches[0][1] and int(batches[0][0]) > 0
    assert len(re.findall(r"mean loss over the run", output)) == 1
    assert len(re.findall(r"\[rank 0/2\] isolation verified", output)) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("script", "steps"), [("sft_trainer.py", "--max_steps=1"), ("custom_loop.py", "--steps=2")])
def test_examples_run(tmp_path, script, steps):
    output = run([sys.executable, os.path.join(ROOT, "examples", script), steps], tmp_path)
    if script == "custom_loop.py":
        assert "isolation verified" in output and "step 2: loss" in output
    else:
        # What users copy prints what the CLI prints: stats, verification, losses; no warnings, no raw reprs.
        assert re.search(r"efficiency \d+\.\d+%", output) and "isolation verified" in output
        assert "last logged loss" in output and "TrainOutput(" not in output
        # DeepSpeed (the test extra installs it), imported by TRL when present, announces on a machine without GPUs
        # that it runs on the CPU: its line, not the example's.
        ours = "\n".join(line for line in output.splitlines() if "Setting accelerator to CPU" not in line)
        assert "[transformers]" not in ours and "warn" not in ours.lower(), output


def test_console_script_prints_errors_without_traceback(tmp_path, capsys):
    from llm_packing import cli

    assert cli.main(["train", "--config", write_recipe(tmp_path, packing_strategy="best")]) == 1
    error = capsys.readouterr().err
    assert error.splitlines()[1].startswith(
        "llm-packing train: error: PackingValueError: `packing_strategy` must be one of")
    assert "Traceback" not in error


# -- the command line, as a new user meets it --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["data/my_chats.jsonl", "./chats", "~/no/such/chats", "a/b/c"])
def test_missing_local_dataset_fails_fast_naming_path_and_folder(tmp_path, name):
    start = time.perf_counter()
    with pytest.raises(PackingValueError, match=rf"`dataset_name` '{re.escape(name)}' is not a file or folder "
                                                rf"\(paths are relative to {re.escape(os.getcwd())}\)"):
        parse_args(["--config", TINY, "--dataset_name", name, "--output_dir", str(tmp_path / "out")])
    assert time.perf_counter() - start < 2  # no hub lookup, no retries
    with pytest.raises(PackingValueError, match="is not a file or folder"):
        load_documents(name)


def test_help_is_short_and_leads_with_the_recipe(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m llm_packing.train --config RECIPE.yaml")
    assert len(text.splitlines()) < 70
    for key in ("--config PATH", "--block_diag_attn", "--overflow {error,truncate,split,drop}", "--max_length",
                "--dataset_name", "SFTConfig", "ModelConfig", "--help_all"):
        assert key in text
    assert "(default: error)" in text and "`llm-packing stats` defaults to split" in text


def test_help_all_explains_the_negated_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help_all"])
    text = capsys.readouterr().out
    assert re.search(r"--no_block_diag_attn, --no-block-diag-attn\s+Same as `--block_diag_attn false`\.\n", text)


def test_errors_read_as_flags_and_leave_nothing_behind(tmp_path, capsys):
    from llm_packing import cli

    output_dir = tmp_path / "out"
    recipe = write_recipe(tmp_path, overflow="error", max_length=16, max_samples=2, output_dir=str(output_dir))
    assert cli.main(["train", "--config", recipe]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "llm-packing train: loading torch, transformers and TRL..."
    assert lines[-1].startswith("llm-packing train: error: SequenceTooLongError: ")
    assert "`--overflow split` / `overflow: split`" in lines[-1] and "overflow='split'" not in lines[-1]
    assert "Traceback" not in lines
    assert not output_dir.exists()


def test_bugs_keep_their_traceback():
    from llm_packing.cli.main import run_command

    def bug(argv):
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):
        run_command("llm-packing train", bug, [])


def test_a_split_that_cuts_most_documents_is_warned_about(caplog):
    from llm_packing.cli.train import _warn_if_mostly_split
    from llm_packing.core.stats import PackingStats

    stats = PackingStats.from_bin_token_counts([8] * 30, num_sequences=30, capacity=8)
    with caplog.at_level(logging.WARNING, logger="llm_packing.train"):
        _warn_if_mostly_split(dataclasses.replace(stats, split_sequences=3), 10, 8)
        assert not caplog.records
        _warn_if_mostly_split(dataclasses.replace(stats, split_sequences=6), 10, 8)
    assert "6 of 10 documents are longer than max_length 8 and were split" in caplog.text


@pytest.mark.slow
def test_python_m_train_speaks_first_and_errors_in_one_line(tmp_path):
    # -X importtime lists every import on stderr as it happens: our first line must come before torch's.
    recipe = write_recipe(tmp_path, packing_strategy="best")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "llm_packing.train", "--config", recipe],
                            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    first = lines.index("llm_packing.train: loading torch, transformers and TRL...")
    assert first < next(i for i, line in enumerate(lines) if re.search(r"\|\s+torch$", line))
    errors = [line for line in lines if not line.startswith("import time:")][1:]
    assert len(errors) == 1 and errors[0].startswith(
        "python -m llm_packing.train: error: PackingValueError: `packing_strategy` must be one of")
