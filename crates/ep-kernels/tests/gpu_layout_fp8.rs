//! GPU tests: the layout and fp8 kernels against their host twins, bit for bit.
//!
//! Run on a machine with an sm_90 GPU: `cargo test --release --features cuda -p ep-kernels
//! --test gpu_layout_fp8` (or the packaged binary, see `scripts/gpu/`). Prints one line per
//! case, then `N passed, N failed`.

mod common;

use std::sync::Arc;

use common::{compare, compare_bits, device, poisoned, time_ms, CaseResult, Runner};
use cudarc::driver::CudaStream;
use ep_kernels::fp8::{self, ScaleFormat};
use ep_kernels::layout::{self, DeviceDispatchLayout, ExpertPlacement};
use ep_kernels::FP8_GROUP;
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// How a layout case draws its routing.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// K distinct experts per token, each slot `-1` with probability `p_masked`.
    Distinct { p_masked: f64 },
    /// Every token picks expert `hot` first, then distinct random others.
    Hot { hot: i64 },
    /// Independent draws: repeated experts within a token allowed.
    WithRepeats,
    /// Every entry `-1`.
    AllMasked,
}

fn random_topk(rng: &mut StdRng, t: usize, k: usize, e: usize, routing: Routing) -> Vec<i64> {
    let mut out = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<i64> = Vec::with_capacity(k);
        match routing {
            Routing::AllMasked => row.resize(k, -1),
            Routing::WithRepeats => {
                row.extend((0..k).map(|_| rng.random_range(-1..e as i64)));
            }
            Routing::Distinct { .. } | Routing::Hot { .. } => {
                if let Routing::Hot { hot } = routing {
                    row.push(hot);
                }
                while row.len() < k.min(e) {
                    let x = rng.random_range(0..e as i64);
                    if !row.contains(&x) {
                        row.push(x);
                    }
                }
                row.resize(k, -1);
                if let Routing::Distinct { p_masked } = routing {
                    for v in &mut row {
                        if rng.random_bool(p_masked) {
                            *v = -1;
                        }
                    }
                }
            }
        }
        out.extend(row);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn layout_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    t: usize,
    k: usize,
    e: usize,
    r: usize,
    p: usize,
    routing: Routing,
    time_it: bool,
) -> CaseResult {
    let placement = ExpertPlacement::new(e, r, p)?;
    let topk = random_topk(rng, t, k, e, routing);
    let want = layout::get_dispatch_layout(&topk, t, k, &placement)?;

    let topk_dev = stream.clone_htod(&topk)?;
    let mut out = DeviceDispatchLayout {
        num_tokens_per_rank: poisoned(stream, r)?,
        num_tokens_per_node: poisoned(stream, r / p)?,
        num_tokens_per_expert: poisoned(stream, e)?,
        is_token_in_rank: poisoned(stream, t * r)?,
    };
    layout::get_dispatch_layout_cuda_into(stream, &topk_dev, t, k, &placement, &mut out)?;
    compare(
        "num_tokens_per_rank",
        &stream.clone_dtoh(&out.num_tokens_per_rank)?,
        &want.num_tokens_per_rank,
    )?;
    compare(
        "num_tokens_per_node",
        &stream.clone_dtoh(&out.num_tokens_per_node)?,
        &want.num_tokens_per_node,
    )?;
    compare(
        "num_tokens_per_expert",
        &stream.clone_dtoh(&out.num_tokens_per_expert)?,
        &want.num_tokens_per_expert,
    )?;
    // Raw bytes: a poisoned (unwritten) byte must not pass as `true`.
    let want_bytes: Vec<u8> = want.is_token_in_rank.iter().map(|&b| u8::from(b)).collect();
    compare(
        "is_token_in_rank",
        &stream.clone_dtoh(&out.is_token_in_rank)?,
        &want_bytes,
    )?;
    // The allocating entry point agrees too.
    let fresh = layout::get_dispatch_layout_cuda(stream, &topk_dev, t, k, &placement)?;
    if fresh.to_host(stream)? != want {
        return Err("get_dispatch_layout_cuda (allocating) differs from the host twin".into());
    }
    if time_it {
        let us = 1e3
            * time_ms(stream, 20, || {
                layout::get_dispatch_layout_cuda_into(
                    stream, &topk_dev, t, k, &placement, &mut out,
                )?;
                Ok(())
            })?;
        println!("       get_dispatch_layout T={t} K={k} E={e} R={r} P={p}: {us:.1} us");
    }
    Ok(())
}

/// Random bf16 activations: each token has its own magnitude in [1e-6, 1e3]; some groups
/// are all zero, some tiny (below the amax clamp), some contain exact powers of two.
fn random_x(rng: &mut StdRng, t: usize, h: usize) -> Vec<bf16> {
    let mut x = Vec::with_capacity(t * h);
    for _ in 0..t {
        let mag = 10f32.powf(rng.random_range(-6.0f32..3.0));
        for g in 0..h / FP8_GROUP {
            let kind = rng.random_range(0..10);
            for _ in 0..FP8_GROUP {
                let v = match kind {
                    0 => 0.0,
                    1 => rng.random_range(-1.0f32..1.0) * 1e-6,
                    2 => {
                        let s = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
                        s * 2f32.powi(rng.random_range(-8..8))
                    }
                    _ => rng.random_range(-1.0f32..1.0) * mag * (1.0 + g as f32 % 3.0),
                };
                x.push(bf16::from_f32(v));
            }
        }
    }
    x
}

fn quantize_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    t: usize,
    h: usize,
    format: ScaleFormat,
    time_it: bool,
) -> CaseResult {
    let x = random_x(rng, t, h);
    let (want_q, want_s) = fp8::quantize(&x, t, h, format)?;
    let x_dev = stream.clone_htod(&x)?;
    let mut q_dev = poisoned::<F8E4M3>(stream, t * h)?;
    let mut s_dev = poisoned::<f32>(stream, t * h / FP8_GROUP)?;
    fp8::quantize_cuda(stream, &x_dev, t, h, format, &mut q_dev, &mut s_dev)?;
    let got_q = stream.clone_dtoh(&q_dev)?;
    let got_s = stream.clone_dtoh(&s_dev)?;
    compare_bits("scales", &got_s, &want_s, f32::to_bits)?;
    compare_bits("q", &got_q, &want_q, |v: F8E4M3| v.to_bits())?;

    // And back: device dequantisation of the device result equals the host's.
    let want_y = fp8::dequantize(&want_q, &want_s, t, h)?;
    let mut y_dev = poisoned::<bf16>(stream, t * h)?;
    fp8::dequantize_cuda(stream, &q_dev, &s_dev, t, h, &mut y_dev)?;
    compare_bits(
        "dequantized",
        &stream.clone_dtoh(&y_dev)?,
        &want_y,
        bf16::to_bits,
    )?;

    if time_it {
        let us = 1e3
            * time_ms(stream, 20, || {
                fp8::quantize_cuda(stream, &x_dev, t, h, format, &mut q_dev, &mut s_dev)?;
                Ok(())
            })?;
        let gbs = (t * h * 3 + t * h / FP8_GROUP * 4) as f64 / (us as f64 * 1e-6) / 1e9;
        println!("       quantize_fp8_1x128 T={t} H={h} {format:?}: {us:.1} us ({gbs:.0} GB/s)");
    }
    Ok(())
}

/// Dequantisation of arbitrary finite fp8 bytes and positive scales.
fn dequantize_case(stream: &Arc<CudaStream>, rng: &mut StdRng, t: usize, h: usize) -> CaseResult {
    let q: Vec<F8E4M3> = (0..t * h)
        .map(|_| loop {
            let b: u8 = rng.random();
            if b & 0x7f != 0x7f {
                break F8E4M3::from_bits(b);
            }
        })
        .collect();
    let s: Vec<f32> = (0..t * h / FP8_GROUP)
        .map(|_| 10f32.powf(rng.random_range(-9.0f32..3.0)))
        .collect();
    let want = fp8::dequantize(&q, &s, t, h)?;
    let q_dev = stream.clone_htod(&q)?;
    let s_dev = stream.clone_htod(&s)?;
    let mut y_dev = poisoned::<bf16>(stream, t * h)?;
    fp8::dequantize_cuda(stream, &q_dev, &s_dev, t, h, &mut y_dev)?;
    compare_bits("y", &stream.clone_dtoh(&y_dev)?, &want, bf16::to_bits)
}

/// Launchers reject bad sizes before launching, naming the argument.
fn rejects_bad_sizes(stream: &Arc<CudaStream>) -> CaseResult {
    let placement = ExpertPlacement::new(16, 4, 2)?;
    let topk = stream.clone_htod(&[0i64; 10])?;
    let err = layout::get_dispatch_layout_cuda(stream, &topk, 3, 4, &placement)
        .err()
        .ok_or("layout accepted topk_idx of 10 entries for 3 x 4")?
        .to_string();
    if !err.contains("topk_idx") {
        return Err(format!("layout error does not name topk_idx: {err}").into());
    }
    let x = stream.clone_htod(&[bf16::ZERO; 100])?;
    let mut q = poisoned::<F8E4M3>(stream, 100)?;
    let mut s = poisoned::<f32>(stream, 1)?;
    let err = fp8::quantize_cuda(stream, &x, 1, 100, ScaleFormat::Float, &mut q, &mut s)
        .err()
        .ok_or("quantize accepted hidden = 100")?
        .to_string();
    if !(err.contains("hidden") && err.contains("100") && err.contains("128")) {
        return Err(format!("fp8 error does not name hidden, 100 and 128: {err}").into());
    }
    Ok(())
}

fn main() {
    let mut runner = Runner::from_env("gpu_layout_fp8");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => gpu_test_suite::skip(&format!("no CUDA device: {e}")),
    };

    // Every kernel of every cubin is loaded when the context's cache is created, so that no
    // op's launch is a kernel's first load (which may wait for the running kernels).
    runner.case("kernels: every entry point loaded up front", |_| {
        let kernels = ep_kernels::cuda::Kernels::for_stream(&stream)?;
        let mut total = 0;
        for file in ep_kernels::cuda::cubin_names() {
            let names = ep_kernels::cuda::cubin_entry_points(file)?;
            if names.is_empty() || names.iter().any(|n| n == "vprintf") {
                return Err(format!("{file}: entry points {names:?}").into());
            }
            for name in names {
                if !kernels.kernel(file, &name)?.is_loaded()? {
                    return Err(format!("{file}: `{name}` not loaded").into());
                }
                total += 1;
            }
        }
        let combine = ep_kernels::cuda::cubin_entry_points("intranode/copy_engine_combine")?;
        if combine != ["intranode_ce_combine", "intranode_ce_combine_roles"] {
            return Err(format!("copy_engine_combine: {combine:?}").into());
        }
        if ep_kernels::cuda::cubin_entry_points("no/such").is_ok() {
            return Err("an unknown cubin must be an error".into());
        }
        println!("  {total} kernels loaded");
        Ok(())
    });

    let distinct = Routing::Distinct { p_masked: 0.1 };
    // (T, K, E, R, P, routing, time it)
    let layout_cases: &[(usize, usize, usize, usize, usize, Routing, bool)] = &[
        (0, 8, 256, 8, 8, distinct, false),
        (1, 1, 8, 1, 1, distinct, false),
        (4096, 8, 256, 8, 8, distinct, true),
        (4096, 8, 256, 8, 2, distinct, false),
        (4096, 8, 256, 8, 1, distinct, false),
        (4096, 8, 256, 4, 4, distinct, false),
        (4096, 8, 256, 2, 1, distinct, false),
        (4096, 8, 256, 1, 1, distinct, false),
        (
            4096,
            8,
            288,
            4,
            2,
            Routing::Distinct { p_masked: 0.5 },
            false,
        ),
        (4096, 8, 256, 8, 4, Routing::Hot { hot: 3 }, false),
        (1000, 6, 64, 4, 2, Routing::WithRepeats, false),
        (333, 8, 256, 8, 8, Routing::AllMasked, false),
        (513, 9, 1024, 1024, 8, distinct, false),
        (700, 8, 384, 96, 3, distinct, false),
        (4096, 8, 256, 64, 8, distinct, true),
        // More tokens than the launch's threads (1024 blocks of 256): the grid-stride loop.
        (300_000, 8, 256, 8, 2, distinct, true),
    ];
    for &(t, k, e, r, p, routing, time_it) in layout_cases {
        let name = format!("layout T={t} K={k} E={e} R={r} P={p} {routing:?}");
        runner.case(&name, |rng| {
            layout_case(&stream, rng, t, k, e, r, p, routing, time_it)
        });
    }

    for format in [ScaleFormat::Float, ScaleFormat::Ue8m0] {
        for &(t, h, time_it) in &[
            (0, 7168, false),
            (1, 128, false),
            (7, 256, false),
            (129, 2048, false),
            (4096, 7168, true),
        ] {
            runner.case(&format!("fp8 quantize T={t} H={h} {format:?}"), |rng| {
                quantize_case(&stream, rng, t, h, format, time_it)
            });
        }
    }
    for &(t, h) in &[(0, 128), (3, 128), (257, 7168)] {
        runner.case(&format!("fp8 dequantize T={t} H={h}"), |rng| {
            dequantize_case(&stream, rng, t, h)
        });
    }
    runner.case("launchers reject bad sizes", |_| rejects_bad_sizes(&stream));
    runner.finish();
}
