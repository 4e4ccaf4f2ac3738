"""SFT trainers that keep the exact loss of every training step (the logged one is rounded), TRL's and ours."""

import math

from trl import SFTTrainer

from llm_packing import PackedSFTTrainer


class LossRecording:
    """Keeps the loss of every training step in `self.losses`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.losses.append(loss.item())
        return loss


class LossRecordingSFTTrainer(LossRecording, SFTTrainer):
    pass


class LossRecordingPackedSFTTrainer(LossRecording, PackedSFTTrainer):
    pass


def first_step_loss(trainer) -> float:
    """Train `trainer` and return its first step's loss; every step's loss must be finite."""
    trainer.losses = []
    trainer.train()
    assert trainer.losses and all(math.isfinite(loss) for loss in trainer.losses)
    return trainer.losses[0]
