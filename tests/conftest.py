import os

import torch


# Tests never reach a model hub: everything is built from configs or shipped in registry packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tiny models on a 2-core machine shared by 2 xdist workers: extra intra-op threads only wait on each other.
torch.set_num_threads(1)
