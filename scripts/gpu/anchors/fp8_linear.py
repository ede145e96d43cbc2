#!/usr/bin/env python3
"""PyTorch peers of bench_fp8_linear, on the same cases and GPU, in the same device command:
DeepSeek-V3's dense projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj) from 1 to 4096
rows.

- `F.linear` in bf16 (cuBLAS) on the weight;
- `torch._scaled_mm` in fp8 e4m3: the rows cast to fp8 in torch ops and the GEMM, with
  DeepSeek's scales (1 x 128 on the rows, 128 x 128 on the weight) where this PyTorch takes
  them on this GPU, else row-wise scales (one per row, one per output column; the finest it
  takes): the JSON line says which.

Each figure is the time of one call inside a CUDA graph of 20 calls (as bench_fp8_linear), the
median of event-timed replays; the calls cycle through copies of the weight that together
exceed the L2 cache, as bench_fp8_linear's do. Prints a table and one JSON line per row (prefix `JSON `).

Usage: python3 scripts/gpu/anchors/fp8_linear.py [--iters N]
"""
import argparse
import json

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CALLS = 20
PROJECTIONS = [("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536),
               ("kv_a_proj_with_mqa", 576, 7168), ("o_proj", 7168, 16384)]
ROWS = [1, 4, 8, 16, 64, 256, 1024, 4096]


def graph_us(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    times.sort()
    return times[len(times) // 2]


def blocks_1x128(x):
    m, k = x.shape
    v = x.float().view(m, k // 128, 128)
    s = v.abs().amax(dim=2).clamp(min=1e-4) / FP8_MAX
    return (v / s.unsqueeze(2)).to(FP8).view(m, k), s


def rowwise(x):
    s = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / FP8_MAX
    return (x.float() / s).to(FP8), s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one call in a graph of "
          f"{CALLS}, us")
    for name, n, k in PROJECTIONS:
        copies = max(1, min(CALLS, -(-(256 << 20) // (n * k))))
        ws = [(torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        rw = [rowwise(w) for w in ws]
        for rows in ROWS:
            x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
            bf16 = graph_us(lambda i: F.linear(x, ws[i % copies]), args.iters)
            recipe = "blockwise 1x128 / 128x128"
            try:
                # DeepSeek's recipe: scale_a [rows, k / 128] (1 x 128), scale_b [k / 128, n / 128]
                # (128 x 128), as PyTorch's blockwise scaled_mm takes them.
                if n % 128:
                    raise RuntimeError("n not a multiple of 128")
                blocks = []
                for w in ws:
                    wq = w.float().view(n // 128, 128, k // 128, 128)
                    sb = wq.abs().amax(dim=(1, 3)).clamp(min=1e-4) / FP8_MAX  # [n/128, k/128]
                    blocks.append(((wq / sb[:, None, :, None]).to(FP8).view(n, k),
                                   sb.t().contiguous()))

                def fp8(i):
                    xq, xs = blocks_1x128(x)
                    qb, sb_t = blocks[i % copies]
                    return torch._scaled_mm(xq, qb.t(), scale_a=xs, scale_b=sb_t,
                                            out_dtype=torch.bfloat16)
                fp8(0)
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - fall back to the finest scales it takes
                recipe = "row-wise"

                def fp8(i):
                    xq, xs = rowwise(x)
                    wq_r, ws_r = rw[i % copies]
                    return torch._scaled_mm(xq, wq_r.t(), scale_a=xs, scale_b=ws_r.t(),
                                            out_dtype=torch.bfloat16)
            fp8_us = graph_us(fp8, args.iters)
            print(f"{name:<20} [{n}, {k}] {rows:>5} bf16 {bf16:8.1f} fp8 {fp8_us:8.1f} ({recipe})")
            print("JSON " + json.dumps({"bench": "fp8_linear_torch", "case": name, "n": n,
                                        "k": k, "rows": rows, "bf16_us": round(bf16, 2),
                                        "fp8_us": round(fp8_us, 2), "fp8_scales": recipe,
                                        "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
