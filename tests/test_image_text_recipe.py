"""recipes/tiny-cpu-vlm.yaml: a tiny Qwen2.5-VL trains on conversations about real photos, packed, offline, on CPU,
with isolation verified on a packed row holding images; the built-in data and processor it uses; with
`assistant_only_loss` and a processor template without `{% generation %}` markers, it plans and trains with TRL's
training template."""

import os
import re
import sys

import pytest
from test_train import logged_losses, run
from trl import chat_template_utils

from llm_packing.cli import train_image_text as flow
from llm_packing.cli.train import parse_args
from llm_packing.data.pack_image_text import plan_conversations
from llm_packing.demo.photos import load_demo_processor, load_photo_conversations


RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny-cpu-vlm.yaml")


def test_the_demo_conversations_hold_real_photos_of_many_sizes():
    conversations = load_photo_conversations()
    sizes = {image.size for images in conversations["images"] for image in images}
    counts = [len(images) for images in conversations["images"]]
    assert len(sizes) >= 12 and {0, 1, 2} <= set(counts) and len(conversations) == 36
    tokens, _ = plan_conversations(conversations, load_demo_processor())
    assert tokens.min() < 50 and tokens.max() > 150  # the length spread packing is for


@pytest.mark.slow
def test_the_image_text_recipe_trains_packed_with_isolation_verified(tmp_path):
    output = run([sys.executable, "-m", "llm_packing.train", "--config", RECIPE, "--output_dir",
                  str(tmp_path / "out")], tmp_path)
    assert "isolation verified" in output
    assert re.search(r"36 conversations \(40 images\) in \d+ rows", output)
    assert "layout indexed mask" in output
    losses = logged_losses(output)
    assert len(losses) >= 3 and losses[-1] < losses[0]


def test_the_recipe_plans_with_the_training_template_it_trains_with(tmp_path, monkeypatch, unconfigure_after):
    # The processor's real Qwen2.5-VL template has no {% generation %} markers: the recipe packs before building the
    # trainer, so it must plan with the template the trainer collates with (TRL's training one), and train tokens.
    processor = load_demo_processor()
    processor.chat_template = chat_template_utils.qwen2_5_vl_chat_template
    monkeypatch.setattr(flow, "load_processor", lambda *args, **kwargs: processor)
    planned_with, original = [], flow.pack_dataset

    def pack_dataset(*args, **kwargs):
        planned_with.append(kwargs.get("chat_template"))
        return original(*args, **kwargs)

    monkeypatch.setattr(flow, "pack_dataset", pack_dataset)
    arguments = parse_args(["--config", RECIPE, "--output_dir", str(tmp_path), "--max_steps", "1",
                            "--verify_packing", "false"])
    result = flow.train_image_text(*arguments)
    assert planned_with == [chat_template_utils.qwen2_5_vl_training_chat_template]
    assert result.global_step == 1 and result.training_loss > 1, result
