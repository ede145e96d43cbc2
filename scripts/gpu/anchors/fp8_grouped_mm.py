#!/usr/bin/env python3
"""FP8 peers of bench_grouped_gemm's fp8 rows, on the same cases and GPU, in the same device
command: the experts' gate_up GEMM -> SwiGLU -> down GEMM at DeepSeek-V3 shapes (H=7168, I=2048).

- `torch._scaled_grouped_mm` (PyTorch's fp8 grouped GEMM; row-wise scales: one per row of A and
  one per output column of B, the finest it takes) on expert-major rows with offsets, with the
  SwiGLU and the fp8 cast of its output between the GEMMs in torch ops;
- `torch._scaled_mm` dense on the same rows with one expert's weights (row-wise scales): the
  FLOP-rate anchor;
- DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous` / `m_grouped_fp8_gemm_nt_masked` (1 x 128
  activation scales, 128 x 128 weight scales: DeepSeek-V3's recipe, as ours), when
  `import deep_gemm` works (built from its source on the GPU machine, kept out of the tree),
  both GEMMs alone ("GEMMs only") and with the same torch SwiGLU + cast between them.

PyTorch has no masked layout: its masked cases run on the valid rows only. Times are medians of
event-timed runs after `--warmup-ms` (default 200) of warm-up (sustained clocks). Prints a table and one JSON line per row (prefix `JSON `).

Usage: python3 scripts/gpu/anchors/fp8_grouped_mm.py [--iters N] [--only torch|deepgemm]
    [--warmup-ms MS] [--idle-ms MS]
(run DeepGEMM in its own process: a crash there then leaves the torch rows standing).
`EP_ANCHOR_CASES=a,b` keeps the cases whose name contains one of the words (as
bench_grouped_gemm's `EP_BENCH_CASES`).

DeepGEMM on the GPU machine (its source with CUTLASS's and fmt's headers in `third-party/`):
build it with the system compiler, `CC=/usr/bin/gcc CXX=/usr/bin/g++ bash develop.sh` (with
`CUDA_HOME` set and `CPATH` at CUDA's `include/cccl`). Python's default compiler there
(`/opt/gcc/bin/g++`) links its own libstdc++ code into the extension while compiling against
the system's GCC 13 headers; that extension segfaults in libstdc++ (`std::regex`,
`ostream::operator<<`) at import or at its first GEMM.
"""
import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

H, I, TOPK = 7168, 2048, 8
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def balanced_counts(tokens, experts):
    counts = [0] * experts
    for i in range(tokens * TOPK):
        counts[(i // TOPK * TOPK + i % TOPK) % experts] += 1
    return counts


def median_ms(fn, iters, warmup_s=0.2, idle_s=0.0):
    # Warm up for `warmup_s` (200 ms by default, as bench_grouped_gemm), so that every method is
    # timed at the clocks and power a sustained load gets: after a short warm-up an H200 still
    # runs at its boost clock (1980 MHz) where a sustained fp8 GEMM load holds it near 1450 MHz
    # at the 700 W limit. The first call (DeepGEMM's JIT compiles or loads its kernel there)
    # runs before the warm-up's clock starts, so that the warm-up is GPU work. `idle_s` rests
    # the GPU before it (bench_grouped_gemm's `EP_BENCH_IDLE_MS`).
    time.sleep(idle_s)
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
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


def rowwise(x):
    """fp8 rows of x [M, K] with one f32 scale per row."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-4) / FP8_MAX
    return (x.float() / s).to(FP8), s.squeeze(1)


def per_token_group(x):
    """fp8 rows of x [M, K] with one f32 scale per row per 128 channels (DeepSeek's 1 x 128)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    s = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-4) / FP8_MAX
    return (g / s).to(FP8).view(m, k), s.squeeze(2)


def swiglu(h):
    return F.silu(h[:, :I]) * h[:, I:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--only", choices=("torch", "deepgemm", "all"), default="all")
    p.add_argument("--warmup-ms", type=float, default=200.0,
                   help="GPU work before each method is timed (EP_BENCH_WARMUP_MS)")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="rest before each method's warm-up (EP_BENCH_IDLE_MS)")
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    experts = 256
    # Random fp8 weights (values of a 0.02-std weight quantized) with their scales.
    w1 = (torch.randn(experts, 2 * I, H, device=dev) * 0.02)
    w1_q = (w1 / (w1.abs().amax() / FP8_MAX)).to(FP8)
    del w1
    w2 = (torch.randn(experts, H, I, device=dev) * 0.02)
    w2_q = (w2 / (w2.abs().amax() / FP8_MAX)).to(FP8)
    del w2
    torch.cuda.empty_cache()
    w1_colscale = torch.full((experts, 2 * I), 1e-4, device=dev)   # row-wise: per output column
    w2_colscale = torch.full((experts, H), 1e-4, device=dev)
    w1_block = torch.full((experts, 2 * I // 128, H // 128), 1e-4, device=dev)
    w2_block = torch.full((experts, H // 128, I // 128), 1e-4, device=dev)
    cases = [
        ("contiguous 256 x 128", balanced_counts(4096, 256), None),
        ("contiguous 32 x 1024", balanced_counts(4096, 32), None),
        ("contiguous 8 x 4096", balanced_counts(4096, 8), None),
        ("masked 256, one token (8 x 1, m_max 128)", balanced_counts(1, 256), 128),
        ("masked 256 x 4 (m_max 128)", balanced_counts(128, 256), 128),
        ("masked 32 x 32 (m_max 1024)", balanced_counts(128, 32), 1024),
    ]
    only_cases = os.environ.get("EP_ANCHOR_CASES")
    if only_cases:
        cases = [c for c in cases if any(w in c[0] for w in only_cases.split(","))]
    have_dg = False
    if args.only != "torch":
        try:
            import deep_gemm  # noqa: F401
            have_dg = True
            print("deep_gemm imported from", deep_gemm.__file__, flush=True)
        except Exception as e:  # pragma: no cover - depends on the machine
            print(f"deep_gemm not available: {e!r}")
    rows = []
    for name, counts, m_max in cases:
        e = len(counts)
        total = sum(counts)
        used = sum(1 for c in counts if c > 0)
        flops = total * 6.0 * H * I
        wbytes = used * 3.0 * H * I  # fp8 weights
        x = torch.randn(total, H, device=dev).to(torch.bfloat16)
        xq, xs = rowwise(x)
        offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
        b1 = w1_q[:e].transpose(-2, -1)  # [E, H, 2I] column-major as _scaled_grouped_mm wants
        b2 = w2_q[:e].transpose(-2, -1)  # [E, I, H]

        def scaled_grouped():
            h = torch._scaled_grouped_mm(xq, b1, xs, w1_colscale[:e], offs=offs,
                                         out_dtype=torch.bfloat16)
            aq, as_ = rowwise(swiglu(h))
            return torch._scaled_grouped_mm(aq, b2, as_, w2_colscale[:e], offs=offs,
                                            out_dtype=torch.bfloat16)

        def dense():
            h = torch._scaled_mm(xq, w1_q[0].t(), scale_a=xs.unsqueeze(1),
                                 scale_b=w1_colscale[0].unsqueeze(0), out_dtype=torch.bfloat16)
            aq, as_ = rowwise(swiglu(h))
            torch._scaled_mm(aq, w2_q[0].t(), scale_a=as_.unsqueeze(1),
                             scale_b=w2_colscale[0].unsqueeze(0), out_dtype=torch.bfloat16)

        methods = []
        if args.only != "deepgemm":
            methods += [("torch._scaled_grouped_mm fp8 (row-wise)", scaled_grouped),
                        ("torch._scaled_mm fp8 dense", dense)]
        if have_dg:
            methods += deepgemm_methods(dev, e, counts, m_max, x)
        for what, fn in methods:
            print(f"{time.time():.2f} {name}: {what}", flush=True)
            try:
                ms = median_ms(fn, args.iters, args.warmup_ms / 1e3, args.idle_ms / 1e3)
            except Exception:
                print(f"{name}: {what} failed:\n{traceback.format_exc()}")
                continue
            rows.append(dict(case=name, what=what, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                             weight_gbs=wbytes / (ms * 1e-3) / 1e9))
        del x, xq, xs
        torch.cuda.empty_cache()
    print(f"{'case':<42} {'what':<44} {'ms':>9} {'TFLOP/s':>9} {'weight GB/s':>11}")
    for r in rows:
        print(f"{r['case']:<42} {r['what']:<44} {r['ms']:>9.3f} {r['tflops']:>9.1f} "
              f"{r['weight_gbs']:>11.0f}")
    for r in rows:
        print("JSON " + json.dumps(r))


def block_quantized(dev, e, n, k):
    """e random [n, k] weights quantized as checkpoints are (e4m3 with one f32 scale per 128 x
    128 block, the block's amax at 448), as bench_grouped_gemm's weights: the tensor cores' power,
    and so the clocks a sustained load holds, depend on the bits they multiply."""
    q = torch.empty(e, n, k, device=dev, dtype=FP8)
    s = torch.empty(e, n // 128, k // 128, device=dev)
    for g in range(e):
        w = torch.randn(n // 128, 128, k // 128, 128, device=dev)
        amax = w.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
        q[g] = (w * (FP8_MAX / amax)).to(FP8).view(n, k)
        s[g] = (amax / FP8_MAX).view(n // 128, k // 128) * 0.02
    return q, s


def deepgemm_methods(dev, e, counts, m_max, x):
    """DeepGEMM's grouped fp8 GEMMs on the case (1 x 128 and 128 x 128 scales)."""
    import deep_gemm
    from deep_gemm.utils import get_mk_alignment_for_contiguous_layout
    align = get_mk_alignment_for_contiguous_layout()
    w1, s1 = block_quantized(dev, e, 2 * I, H)
    w2, s2 = block_quantized(dev, e, H, I)
    if m_max is None:
        # Contiguous: each group's rows padded to the alignment, -1 rows skipped.
        padded = [(c + align - 1) // align * align for c in counts]
        m = sum(padded)
        idx = torch.full((m,), -1, device=dev, dtype=torch.int32)
        start = 0
        for g, (c, pc) in enumerate(zip(counts, padded)):
            idx[start:start + c] = g
            start += pc
        xb = torch.randn(m, H, device=dev).to(torch.bfloat16)
        a = per_token_group(xb)
        h = torch.empty(m, 2 * I, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, H, device=dev, dtype=torch.bfloat16)
        act = per_token_group(torch.randn(m, I, device=dev).to(torch.bfloat16))

        def gemms():
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, (w1, s1), h, idx)
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(act, (w2, s2), y, idx)

        def full():
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, (w1, s1), h, idx)
            aq = per_token_group(swiglu(h))
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(aq, (w2, s2), y, idx)
    else:
        masked = torch.tensor(counts, device=dev, dtype=torch.int32)
        expected = max(1, max(counts))
        xb = torch.randn(e * m_max, H, device=dev).to(torch.bfloat16)
        aq, as_ = per_token_group(xb)
        a = (aq.view(e, m_max, H), as_.view(e, m_max, H // 128))
        h = torch.empty(e, m_max, 2 * I, device=dev, dtype=torch.bfloat16)
        y = torch.empty(e, m_max, H, device=dev, dtype=torch.bfloat16)
        cq, cs = per_token_group(torch.randn(e * m_max, I, device=dev).to(torch.bfloat16))
        act = (cq.view(e, m_max, I), cs.view(e, m_max, I // 128))

        def gemms():
            deep_gemm.m_grouped_fp8_gemm_nt_masked(a, (w1, s1), h, masked, expected)
            deep_gemm.m_grouped_fp8_gemm_nt_masked(act, (w2, s2), y, masked, expected)

        def full():
            deep_gemm.m_grouped_fp8_gemm_nt_masked(a, (w1, s1), h, masked, expected)
            q, s = per_token_group(swiglu(h.view(e * m_max, 2 * I)))
            deep_gemm.m_grouped_fp8_gemm_nt_masked(
                (q.view(e, m_max, I), s.view(e, m_max, I // 128)), (w2, s2), y, masked, expected)
    return [("DeepGEMM fp8 (GEMMs only)", gemms),
            ("DeepGEMM fp8 (+ torch SwiGLU + cast)", full)]


if __name__ == "__main__":
    main()
