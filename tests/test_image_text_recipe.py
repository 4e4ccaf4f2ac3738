"""recipes/tiny-cpu-vlm.yaml: a tiny Qwen2.5-VL trains on conversations about real photos, packed, offline, on CPU,
with isolation verified on a packed row holding images; the built-in data and processor it uses."""

import os
import re
import sys

import pytest
from test_train import logged_losses, run

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
