#!/usr/bin/env python3
"""PyTorch anchors of bench_grouped_gemm, on the same cases and GPU, in the same device command.

For each case (the experts' gate_up GEMM -> SwiGLU -> down GEMM at DeepSeek-V3 shapes, H=7168,
I=2048, bf16): `torch._grouped_mm` on expert-major rows with offsets, a per-expert loop of
`torch.matmul`, and dense `torch.matmul` on the same number of rows with one expert's weights.
PyTorch has no masked (low-latency) layout: the masked cases run `_grouped_mm` on the valid rows
only (as contiguous groups), which is the least work it can do. Times are medians of event-timed
runs after warm-up. Prints a table and one JSON line per row (prefix `JSON `).

Usage: python3 scripts/gpu/anchors/torch_grouped_mm.py [--iters N]
"""
import argparse
import json

import torch
import torch.nn.functional as F

H, I, TOPK = 7168, 2048, 8


def balanced_counts(tokens, experts):
    counts = [0] * experts
    for i in range(tokens * TOPK):
        counts[(i // TOPK * TOPK + i % TOPK) % experts] += 1
    return counts


def zipf_counts(tokens, experts, seed=7):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(experts, generator=g)
    live = experts - experts // 5
    w = 1.0 / torch.arange(1, live + 1, dtype=torch.float64) ** 1.2
    counts = [0] * experts
    for _ in range(tokens):
        chosen = torch.multinomial(w, TOPK, replacement=False, generator=g)
        for r in chosen.tolist():
            counts[int(order[r])] += 1
    return counts


def median_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def swiglu(h):
    return F.silu(h[:, :I]) * h[:, I:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    w1 = (torch.randn(256, 2 * I, H, device=dev) * 0.02).to(torch.bfloat16)  # [E, 2I, H]
    w2 = (torch.randn(256, H, I, device=dev) * 0.02).to(torch.bfloat16)      # [E, H, I]
    cases = [
        ("contiguous 256 x 128", balanced_counts(4096, 256)),
        ("contiguous 32 x 1024", balanced_counts(4096, 32)),
        ("contiguous 8 x 4096", balanced_counts(4096, 8)),
        ("contiguous 256 zipf (32768 rows)", zipf_counts(4096, 256)),
        ("masked 256 x 4 (m_max 128)", balanced_counts(128, 256)),
        ("masked 32 x 32 (m_max 1024)", balanced_counts(128, 32)),
    ]
    rows = []
    for name, counts in cases:
        e = len(counts)
        total = sum(counts)
        used = sum(1 for c in counts if c > 0)
        flops = total * 6.0 * H * I
        wbytes = used * 3.0 * H * I * 2
        x = torch.randn(total, H, device=dev).to(torch.bfloat16)
        offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
        b1 = w1[:e].transpose(-2, -1)  # [E, H, 2I], K-major as _grouped_mm wants
        b2 = w2[:e].transpose(-2, -1)  # [E, I, H]

        def grouped():
            h = torch._grouped_mm(x, b1, offs=offs)
            return torch._grouped_mm(swiglu(h), b2, offs=offs)

        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)

        def loop():
            for g in range(e):
                if counts[g] == 0:
                    continue
                xs = x[starts[g]:starts[g + 1]]
                torch.matmul(swiglu(torch.matmul(xs, w1[g].t())), w2[g].t())

        def dense():
            torch.matmul(swiglu(torch.matmul(x, w1[0].t())), w2[0].t())

        for what, fn, it in (("torch._grouped_mm", grouped, args.iters),
                             ("per-expert loop (torch)", loop, max(3, args.iters // 4)),
                             ("dense cuBLAS (torch)", dense, args.iters)):
            ms = median_ms(fn, it)
            rows.append(dict(case=name, what=what, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                             weight_gbs=wbytes / (ms * 1e-3) / 1e9))
        del x
        torch.cuda.empty_cache()
    print(f"{'case':<34} {'what':<26} {'ms':>9} {'TFLOP/s':>9} {'weight GB/s':>11}")
    for r in rows:
        print(f"{r['case']:<34} {r['what']:<26} {r['ms']:>9.3f} {r['tflops']:>9.1f} {r['weight_gbs']:>11.0f}")
    for r in rows:
        print("JSON " + json.dumps(r))


if __name__ == "__main__":
    main()
