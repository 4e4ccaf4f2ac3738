"""recipes/tiny-cpu-video.yaml: a tiny Qwen2.5-VL fine-tunes on conversations about generated MP4 clips (and photos),
packed, offline, on CPU, with isolation verified on a packed row holding images and a video; and `verify_packing`'s
video document, which catches a broken video mechanism that text and images alone cannot show."""

import math
import os
import re
import sys

import pytest
from test_train import logged_losses, run
from tiny_video import TinyVideo

from llm_packing.data.pack_image_text import plan_conversations
from llm_packing.demo.clips import load_clip_conversations, load_demo_video_processor
from llm_packing.errors import ContaminationError
from llm_packing.hook.configure import packing_configured
from llm_packing.hook.media import video
from llm_packing.hook.media.verify_images import includes_video
from llm_packing.hook.verify import verify_packing


RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "tiny-cpu-video.yaml")


def test_the_demo_clips_are_videos_of_many_lengths():
    conversations = load_clip_conversations()
    counts = [len(videos) for videos in conversations["videos"]]
    assert {0, 1, 2} <= set(counts) and len(conversations) == 24
    tokens, _ = plan_conversations(conversations, load_demo_video_processor())
    assert tokens.min() < 50 and tokens.max() > 100


def test_the_video_recipe_trains_packed_with_isolation_verified(tmp_path):
    output = run([sys.executable, "-m", "llm_packing.train", "--config", RECIPE, "--output_dir",
                  str(tmp_path / "out")], tmp_path)
    assert "isolation verified (documents with images and a video included)" in output
    assert re.search(r"24 conversations \(12 images, 24 videos\) in \d+ rows", output)
    assert "layout indexed mask" in output
    losses = logged_losses(output)
    assert len(losses) >= 2 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava_onevision"])
def test_verify_packing_with_a_video_passes(model_type):
    tiny = TinyVideo(model_type, "sdpa")
    assert includes_video(model_type, tiny.processor)
    with packing_configured(tiny.model):
        assert verify_packing(tiny.model, processor=tiny.processor) <= 1e-5


def test_verify_packing_with_a_video_catches_temporal_positions_dropped(monkeypatch):
    """Qwen2.5-VL's `second_per_grid_ts` dropped (the hook steps temporal positions by 1 s a patch): images and text
    are unaffected, the row with a video fails."""
    tiny = TinyVideo("qwen2_5_vl", "sdpa")
    per_document = video.per_document
    monkeypatch.setattr(video, "per_document", lambda values, owners, n: (
        None if values is not None and values.dtype.is_floating_point else per_document(values, owners, n)))
    with packing_configured(tiny.model):
        verify_packing(tiny.model)
        with pytest.raises(ContaminationError, match="qwen2_5_vl"):
            verify_packing(tiny.model, processor=tiny.processor)
