"""FlashAttention 4's kernels alone against a float32 reference, forward and backward, by head dimension.

    python benchmarks/gpu_fa4_backward.py [--head-dims 16 64] [--device cuda]

Why: on an H200 (2026-11-27, benchmarks/results/gpu_check.md) `llm-packing verify --attn_implementation
flash_attention_4` found the packed gradients of the tiny models (head dim 16) 0.97 away from each document's own,
with equal logits, while the SmolLM2-shaped model (head dim 64) was exact. This script tells whether a kernel or the
packing is at fault: it calls `flash_attn_func` (one sequence, what transformers calls for an unpacked row) and
`flash_attn_varlen_func` (documents end to end, what the packed row calls) on the same random documents, causal, with
grouped KV heads, and compares each output and each of dq, dk, dv with float32 attention of each document alone,
relative to the reference's largest entry. It prints one markdown table. On CPU it runs against the stand-in when
`tests/fast_kernel_stand_ins/flash_attention_4` and `tests` are on PYTHONPATH (a rehearsal of the script only).
"""

import argparse
import itertools

import torch


LENGTHS = (30, 1, 62)  # one document of a single token: the edge a varlen kernel gets wrong first
HEADS, KV_HEADS = 4, 2


def reference(q, k, v):
    """Float32 causal attention of one document, `[length, heads, dim]` tensors, KV heads repeated."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def gradients(function, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = function(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach().float(), *(leaf.grad.float() for leaf in leaves)]


def relative(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (stand-in)"
    print(f"# FlashAttention 4 alone vs float32 reference ({device_name}, {dtype}, causal, {HEADS}/{KV_HEADS} heads, "
          f"documents {list(LENGTHS)})\n")
    print("| head dim | call | out | dq | dk | dv |")
    print("|---|---|---|---|---|---|")
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=args.device)
    for head_dim in args.head_dims:
        generator = torch.Generator().manual_seed(head_dim)
        total = sum(LENGTHS)
        q, k, v, grad_out = (torch.randn(total, heads, head_dim, generator=generator).to(args.device, dtype)
                             for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS))
        want = [[], [], [], []]
        for a, b in itertools.pairwise(cu_seqlens.tolist()):
            for side, value in zip(want, gradients(reference, q[a:b], k[a:b], v[a:b], grad_out[a:b]), strict=True):
                side.append(value)
        want = [torch.cat(side) for side in want]

        def alone(q_, k_, v_):  # each document its own flash_attn_func call, as transformers calls unpacked rows
            outs = [flash_attn_func(q_[None, a:b], k_[None, a:b], v_[None, a:b], causal=True)[0][0]
                    for a, b in itertools.pairwise(cu_seqlens.tolist())]
            return torch.cat(outs)

        def packed(q_, k_, v_):
            return flash_attn_varlen_func(q_, k_, v_, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                          max_seqlen_q=max(LENGTHS), max_seqlen_k=max(LENGTHS), causal=True)[0]

        for name, function in (("flash_attn_func, each document", alone), ("flash_attn_varlen_func, packed", packed)):
            try:
                got = gradients(function, q, k, v, grad_out)
                cells = [f"{relative(g, w):.3g}" for g, w in zip(got, want, strict=True)]
            except Exception as error:  # noqa: BLE001 -- a kernel that refuses a head dim is a finding, not a crash
                cells = [f"{type(error).__name__}: {' '.join(str(error).split())[:120]}", "", "", ""]
            print(f"| {head_dim} | {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
