"""transformers' video processors without torchvision: their own classes with torch pixel kernels.

transformers' video processors are torchvision classes, and torchvision has no build for some torch builds (the CPU
torch this project tests with among them: its wheel's operators fail to load). [`with_torch_kernels`] keeps a video
processor class whole (frame sampling by fps or count, `smart_resize`, temporal patches, merge size: transformers'
own code) and replaces only the two pixel kernels torchvision provides: resize (antialiased bicubic interpolation)
and normalize. Token counts and grids are the real class's; pixel values are close to torchvision's. Used by the
video demo (`demo/clips.py`) where torchvision cannot be imported, and by the tests.
"""

import importlib
import sys
import types

import torch
from transformers.video_processing_utils import BaseVideoProcessor


class TorchKernels(BaseVideoProcessor):
    """The pixel kernels a video processor takes from torchvision, in torch (it sits below the model's class in the
    MRO, so that class's `super().resize` lands here)."""

    def resize(self, image, size, resample=None, antialias=True, **kwargs):
        height, width = (size.height, size.width) if size.height else (size.shortest_edge, size.shortest_edge)
        frames = image.reshape(-1, *image.shape[-3:]).float()
        out = torch.nn.functional.interpolate(frames, size=(height, width), mode="bicubic", antialias=True)
        out = out.reshape(*image.shape[:-2], height, width)
        return out.round().clamp(0, 255).to(torch.uint8) if image.dtype == torch.uint8 else out

    def normalize(self, image, mean, std, inplace=False, **kwargs):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image - mean) / std

    def convert_to_rgb(self, video):
        return video


def with_torch_kernels(cls: type) -> type:
    """The video processor class `cls`, of the same name, computing its pixels with [`TorchKernels`]."""
    return type(cls.__name__, (cls, TorchKernels), {})


def import_without_torchvision(name: str):
    """Import a module whose only top-level use of torchvision is `import torchvision.transforms.v2.functional`
    (for its annotations): empty stand-ins are in `sys.modules` for the import only."""
    stand_ins = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"]
    saved = {stand_in: sys.modules.get(stand_in) for stand_in in stand_ins}
    sys.modules.update({stand_in: types.ModuleType(stand_in) for stand_in in stand_ins})
    try:
        return importlib.import_module(name)
    finally:
        for stand_in, module in saved.items():
            if module is None:
                sys.modules.pop(stand_in, None)
            else:
                sys.modules[stand_in] = module
