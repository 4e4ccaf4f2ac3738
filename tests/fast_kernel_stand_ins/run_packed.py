"""Run with this folder and `tests/` first on `sys.path`: each model type in argv, packed under the hook, with the
stand-in kernels taking transformers' fast-kernel branch. Prints one JSON line per model type."""

import json
import sys

import kernel_calls
from test_parity import _forward, _max_differences
from tiny_models import packed_batch, tiny_model

from llm_packing.hook.configure import packing_configured


def main(model_types: list[str]) -> None:
    for model_type in model_types:
        model = tiny_model(model_type, "sdpa")
        batch = packed_batch()
        with packing_configured(model):
            kernel_calls.CALLS.clear()
            logits = _forward(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                              attention_mask=batch["attention_mask"])
            packed_calls = list(kernel_calls.CALLS)
            logit_difference, loss_difference = _max_differences(model, batch, logits=logits)
        print(json.dumps({"model_type": model_type, "calls": packed_calls, "logits": logit_difference,
                          "losses": loss_difference}))


if __name__ == "__main__":
    main(sys.argv[1:])
