"""Wrong invocations of the console script end in one line saying what to fix, with exit status 2 for a command line
that cannot run as typed (1 for a value a `PackingError` refuses), never in a traceback."""

import os

import pytest
from test_train import write_recipe

from llm_packing import __version__, cli
from llm_packing.cli.train_arguments import _training_arguments_refusal, parse_args
from llm_packing.errors import PackingValueError


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "tiny-cpu.yaml")


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def last_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    return lines[-1]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    assert run([flag], capsys) == (0, f"llm-packing {__version__}\n", "")


def test_usage_names_the_version_flag(capsys):
    code, _, err = run([], capsys)
    assert code == 2 and "llm-packing --version" in err


def test_train_config_that_does_not_exist(capsys):
    code, _, err = run(["train", "--config", "/nonexistent.yaml"], capsys)
    assert code == 2
    assert last_error_line(err) == (
        "llm-packing train: error: `--config` '/nonexistent.yaml' cannot be read: No such file or directory. Give the "
        "path of a YAML recipe file, e.g. `--config recipes/tiny-cpu.yaml`.")


def test_train_relative_config_names_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["train", "--config", "recipes/missing.yaml"], capsys)
    assert code == 2 and f"No such file or directory (relative to {tmp_path})." in last_error_line(err)


@pytest.mark.parametrize(("make", "reason"), [
    (lambda tmp_path: tmp_path, "Is a directory"),
    (lambda tmp_path: tmp_path / "binary.yaml", "not UTF-8 text (invalid start byte at byte 0)"),
], ids=["directory", "binary"])
def test_train_config_that_is_not_a_readable_file(tmp_path, make, reason, capsys):
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    path = make(tmp_path)
    code, _, err = run(["train", "--config", str(path)], capsys)
    assert code == 2
    assert last_error_line(err).startswith(f"llm-packing train: error: `--config` '{path}' cannot be read: {reason}.")


def test_train_without_config(capsys):
    code, _, err = run(["train"], capsys)
    assert code == 2
    assert last_error_line(err) == (
        "llm-packing train: error: `--config` is missing: give a training recipe, e.g. `--config "
        "recipes/tiny-cpu.yaml` (the repository's recipes/ folder holds ready ones); `python -m llm_packing.train "
        "--help` lists its keys.")


def test_train_settings_refused_by_transformers(capsys):
    code, _, err = run(["train", "--config", TINY, "--logging_strategy", "steps", "--logging_steps", "0"], capsys)
    assert code == 2
    assert last_error_line(err) == (
        "llm-packing train: error: The recipe and flags are refused by TRL / transformers: logging strategy "
        "IntervalStrategy.STEPS requires non-zero --logging_steps. Change that key in the recipe, or pass it as a "
        "flag.")


def test_bf16_without_a_gpu_says_how_to_train_on_cpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    message = _training_arguments_refusal("Your setup doesn't support bf16/gpu. You need to assign use_cpu if you "
                                          "want to train the model on CPU.")
    assert message.endswith("on CPU. This machine has no GPU: set `use_cpu: true` and `bf16: false` in the recipe "
                            "(or pass `--use_cpu true --bf16 false`).")


@pytest.mark.parametrize(("changes", "match"), [
    ({"max_length": [1, 2]}, r"`max_length` must be a whole number, got \[1, 2\] in '.*recipe.yaml'\. Write a whole "
                             r"number, e\.g\. `max_length: 1024`\."),
    ({"max_length": 12.5}, r"`max_length` must be a whole number, got 12\.5"),
    ({"max_length": True}, r"`max_length` must be a whole number, got True"),
    ({"max_length": 0}, r"`max_length` must be a positive integer \(tokens per packed row\), got 0\. Set e\.g\. "
                        r"`max_length: 2048` in the recipe, or pass `--max_length 2048`\."),
    ({"learning_rate": [1]}, r"`learning_rate` must be a number, got \[1\]"),
    ({"per_device_train_batch_size": 1.5}, r"`per_device_train_batch_size` must be a whole number, got 1\.5"),
    ({"trainer": "ppo"}, r"`trainer` must be one of \('sft', 'dpo', 'grpo'\), got 'ppo'\. Write e\.g\. "
                         r"`trainer: sft` in the recipe\."),
    ({"trainer": [1]}, r"`trainer` must be one of \('sft', 'dpo', 'grpo'\), got \[1\]"),
], ids=["max_length-list", "max_length-float", "max_length-bool", "max_length-0", "learning_rate-list",
        "batch_size-float", "trainer-unknown", "trainer-list"])
def test_badly_typed_recipe_value_is_refused_before_training(tmp_path, changes, match):
    with pytest.raises(PackingValueError, match=match):
        parse_args(["--config", write_recipe(tmp_path, **changes)])


def test_recipe_numbers_in_yaml_forms_still_parse(tmp_path):
    recipe = write_recipe(tmp_path, learning_rate=1, num_train_epochs=2, max_samples=None)
    _, training_args, _, _ = parse_args(["--config", recipe, "--output_dir", str(tmp_path)])
    assert (training_args.learning_rate, training_args.num_train_epochs) == (1, 2)


@pytest.mark.parametrize("text", ["- a\n- b\n", "max_lenght: 3\n"], ids=["not-a-mapping", "unknown-key"])
def test_train_bad_recipe_is_one_line(tmp_path, text, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    code, _, err = run(["train", "--config", str(path)], capsys)
    assert code == 1 and last_error_line(err).startswith("llm-packing train: error: PackingValueError: ")


def test_stats_unknown_dataset_offline(capsys):
    # conftest sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE: datasets answers at once, as it would after retries offline
    code, _, err = run(["stats", "--dataset", "nosuchdataset", "--max_length", "2048"], capsys)
    assert code == 2
    assert last_error_line(err) == (
        f"llm-packing stats: error: `--dataset_name` 'nosuchdataset' is neither a local file or folder (paths are "
        f"relative to {os.getcwd()}) nor a bundled dataset ('chitchat', 'photos', 'clips'), and the hub could not be "
        "reached to download it (Couldn't reach 'nosuchdataset' on the Hub (OfflineModeIsEnabled)). Check the name, "
        "or connect to the network (and unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) for a hub dataset.")
