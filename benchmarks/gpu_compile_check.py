"""A compiled packed training step against eager, on the GPU's kernels: `tests/test_compile.py`'s check where the
routes differ from CPU (torch's FlashAttention 2 varlen op, FlashAttention 4, bfloat16).

    python benchmarks/gpu_compile_check.py --json result.json             # CUDA: every case (gpu_check.py runs it)
    python benchmarks/gpu_compile_check.py --device cpu --cases llama:sdpa:dense:float32 --batches 2   # a smoke run

Each case compiles a tiny model (`tests/tiny_models.py`) with `torch.compile(model)`, configures it for packing and
trains it on `--batches` collated batches of new document layouts and new lengths, the compiled call first on each (a
warm-up with the eager call would hide a layout baked into the graph). An eager twin of the same weights runs the same
batch after it. Compiled and eager must agree: logits and gradients by the relative norm of their difference
(`||compiled - eager|| / ||eager||`, at most 1e-4 in float32, 2e-2 in bfloat16, where fused kernels round
differently), the loss within the same relative limit. A layout from an earlier batch leaks whole documents, far above
either. The number of compiled graphs after each batch shows whether a new layout recompiles (it must not after the
switch to dynamic shapes on the second batch).
"""

import argparse
import copy
import json
import os
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (model type, backend, attention_route, dtype): the varlen route on CUDA in half precision is torch's FlashAttention
# 2 varlen op, in float32 per-document SDPA; qwen2's tiny config has sliding windows of 4 tokens. Head dim 32, not the
# tiny configs' 16: below 32 FlashAttention 4's varlen backward is wrong, and the hook refuses it (gpu_check.py).
HEAD_DIM = 32
CASES = (
    ("llama", "sdpa", "varlen", "bfloat16"),
    ("llama", "sdpa", "dense", "bfloat16"),
    ("llama", "flash_attention_4", None, "bfloat16"),
    ("qwen2", "sdpa", "varlen", "bfloat16"),
    ("llama", "sdpa", "varlen", "float32"),
)
LIMITS = {"float32": 1e-4, "bfloat16": 2e-2}


def run_case(model_type: str, backend: str, route: str | None, dtype: str, device: str, batches: int) -> dict:
    """One case: per batch the relative differences (logits, loss, gradients) and the compiled entries after it."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from compile_checks import compiled_frames, packed_batches
    from tiny_models import tiny_model

    from llm_packing.hook.configure import packing_configured

    torch._dynamo.reset()
    model = tiny_model(model_type, "eager", head_dim=HEAD_DIM).to(device, getattr(torch, dtype)).train()
    model.set_attn_implementation(backend)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    limit, rows, started = LIMITS[dtype], [], time.perf_counter()
    with packing_configured(model, attention_route=route):
        for batch in packed_batches(batches, flash=backend.startswith("flash")):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            output = compiled(**batch, use_cache=False)
            output.loss.backward()
            expected = eager(**batch, use_cache=False)
            expected.loss.backward()
            mine = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            theirs = torch.cat([p.grad.float().flatten() for p in eager.parameters() if p.grad is not None])
            rows.append({"logits": relative(output.logits, expected.logits), "loss": relative(output.loss,
                                                                                                expected.loss),
                         "gradients": relative(mine, theirs), "frames": compiled_frames()})
            model.zero_grad()
            eager.zero_grad()
    worst = max(max(row["logits"], row["loss"], row["gradients"]) for row in rows)
    recompiles = rows[-1]["frames"] - rows[min(1, len(rows) - 1)]["frames"]
    return {"case": f"{model_type}, {backend}{f' ({route} route)' if route else ''}, {dtype}", "limit": limit,
            "worst": worst, "exact": worst <= limit, "recompiles_after_second": recompiles, "batches": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def relative(mine, theirs) -> float:
    mine, theirs = mine.detach().float(), theirs.detach().float()
    return float((mine - theirs).norm() / theirs.norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, default=6, help="new layouts per case")
    parser.add_argument("--cases", nargs="+", metavar="TYPE:BACKEND:ROUTE:DTYPE",
                        help="default: every case of CASES (ROUTE 'none' for the backend's only one)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    cases = CASES if not args.cases else [tuple(None if part == "none" else part for part in case.split(":"))
                                          for case in args.cases]
    results = []
    for case in cases:
        try:
            results.append(run_case(*case, device=args.device, batches=args.batches))
        except Exception as error:  # noqa: BLE001 -- a case that cannot compile or run is reported, not fatal
            results.append({"case": ", ".join(str(part) for part in case), "error":
                            f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"})
        print(json.dumps({key: value for key, value in results[-1].items() if key != "batches"}), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as file:
                json.dump(results, file, indent=1)
    return 0 if all(result.get("exact") for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
