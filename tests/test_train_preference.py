"""`trainer: dpo` recipes: parsed with TRL's DPOConfig keys, and the tiny one trains packed and verified."""

import ast
import math
import os
import re
import subprocess
import sys

import pytest
from trl import DPOConfig

from llm_packing.cli.train import main, parse_args
from llm_packing.demo.chitchat import load_chitchat_preference_pairs
from llm_packing.errors import PackingValueError


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DPO = os.path.join(ROOT, "recipes", "tiny-cpu-dpo.yaml")
TINY_GRPO = os.path.join(ROOT, "recipes", "tiny-cpu-grpo.yaml")


def test_dpo_recipe_takes_dpo_config_keys(tmp_path):
    script_args, training_args, _, _ = parse_args(["--config", TINY_DPO, "--beta", "0.3", "--output_dir",
                                                   str(tmp_path)])
    assert script_args.trainer == "dpo" and isinstance(training_args, DPOConfig)
    assert (training_args.beta, training_args.loss_type, training_args.max_length) == (0.3, ["sigmoid"], 768)
    with pytest.raises(PackingValueError, match="Unknown key 'beta'"):  # SFTConfig has no beta
        parse_args(["--config", TINY_DPO, "--trainer", "sft", "--beta", "0.3"])


@pytest.mark.parametrize("flag", ["--block_diag_attn", "--padding_free"])
def test_dpo_recipe_refuses_the_unpacked_layouts(tmp_path, flag):
    value = "false" if flag == "--block_diag_attn" else "true"
    with pytest.raises(PackingValueError, match="always packs its forwards"):
        main(["--config", TINY_DPO, flag, value, "--output_dir", str(tmp_path)])


def test_demo_pairs_reject_another_conversations_reply():
    pairs = load_chitchat_preference_pairs(max_pairs=50)
    assert len(pairs) == 50
    for pair in pairs:
        assert [message["role"] for message in pair["prompt"] + pair["chosen"] + pair["rejected"]] == [
            "user", "assistant", "assistant"]
        assert pair["chosen"][0]["content"] != pair["rejected"][0]["content"]


def train_recipe(recipe, tmp_path, steps) -> list[dict]:
    """Run the recipe for `steps` steps in a subprocess; its logged metrics, after checking isolation was verified."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "llm_packing.train", "--config", recipe, "--max_steps", str(steps), "--max_samples",
         "16", "--logging_steps", "1", "--output_dir", str(tmp_path / "out")],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "isolation verified: packed logits equal per-document logits" in output
    logged = [ast.literal_eval(line) for line in re.findall(r"\{'loss': [^}]*\}", output)]
    assert len(logged) == steps
    return logged


@pytest.mark.slow
def test_tiny_dpo_recipe_trains_packed_and_verified(tmp_path):
    logged = train_recipe(TINY_DPO, tmp_path, steps=2)
    assert all(math.isfinite(float(entry["loss"])) for entry in logged)
    assert float(logged[0]["loss"]) == pytest.approx(math.log(2), abs=1e-3)  # policy == reference at step 1
    assert "rewards/margins" in logged[-1]
    assert os.path.exists(tmp_path / "out" / "model.safetensors")


@pytest.mark.slow
def test_tiny_grpo_recipe_generates_and_trains_packed_and_verified(tmp_path):
    logged = train_recipe(TINY_GRPO, tmp_path, steps=1)
    assert math.isfinite(float(logged[0]["loss"]))
    assert float(logged[0]["completions/mean_length"]) > 0  # TRL's own generation ran, with the hook configured
    assert "rewards/reply_length_reward/mean" in logged[0]
