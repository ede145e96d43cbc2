//! GPU tests: the gate, routing and expert-order kernels against their host twins, on fresh
//! random inputs written into poisoned outputs. Routing is compared bit for bit (ids and
//! weights), from scores and from logits (sigmoid and softmax are computed with the same f32
//! operations on both sides), including ties, negative biases and every group rule. The gate
//! logits (f32 sums on the device, f64 in the twin) must be within `GATE_RTOL` of the twin
//! relative to `sum_i |x_i w_i|`, the scale of a dot product's rounding error, and every
//! output must be written. The permute is checked by its invariants (counts equal, every pair
//! inside its expert's aligned range exactly once, rows copied bit for bit; the order within
//! an expert is the kernel's), the un-permute bit for bit given the kernel's positions.

mod common;

use std::sync::Arc;

use common::{compare, compare_bits, device, poisoned, CaseResult, Poison, Runner};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;
use ep_kernels::expert_order::{self, rows_bound};
use ep_kernels::routing::{self, GateInput, GateShape, GroupScore, Scoring, TopkInput, TopkSpec};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::Rng;

/// Scores in (0, 1); with `ties`, a third of them from 4 values (many exact ties).
fn random_scores(rng: &mut StdRng, len: usize, ties: bool) -> Vec<f32> {
    (0..len)
        .map(|_| {
            if ties && rng.random_bool(0.33) {
                [0.25f32, 0.5, 0.75, 0.125][rng.random_range(0..4)]
            } else {
                1.0 / (1.0 + (-rng.random_range(-6.0f32..6.0)).exp())
            }
        })
        .collect()
}

/// Logits in (-8, 8); with `ties`, a third of them from 4 values.
fn random_logits(rng: &mut StdRng, len: usize, ties: bool) -> Vec<f32> {
    (0..len)
        .map(|_| {
            if ties && rng.random_bool(0.33) {
                [-1.0f32, 0.0, 0.5, 2.0][rng.random_range(0..4)]
            } else {
                rng.random_range(-8.0f32..8.0)
            }
        })
        .collect()
}

fn routing_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    t: usize,
    spec: TopkSpec,
    input: TopkInput,
    with_bias: bool,
    ties: bool,
) -> CaseResult {
    let (e, k) = (spec.num_experts, spec.top_k);
    let scores = match input {
        TopkInput::Scores => random_scores(rng, t * e, ties),
        TopkInput::Logits(_) => random_logits(rng, t * e, ties),
    };
    let bias: Option<Vec<f32>> =
        with_bias.then(|| (0..e).map(|_| rng.random_range(-0.5f32..0.2)).collect());
    let mut want_idx = vec![0i64; t * k];
    let mut want_w = vec![0f32; t * k];
    routing::route_topk(
        &scores,
        input,
        bias.as_deref(),
        &spec,
        &mut want_idx,
        &mut want_w,
    )?;
    let s_dev = stream.clone_htod(&scores)?;
    let b_dev = match &bias {
        Some(b) => Some(stream.clone_htod(b)?),
        None => None,
    };
    let mut idx = poisoned::<i64>(stream, t * k)?;
    let mut w = poisoned::<f32>(stream, t * k)?;
    routing::route_topk_cuda(
        stream,
        &s_dev,
        input,
        b_dev
            .as_ref()
            .map(|b| b as &dyn cudarc::driver::DevicePtr<f32>),
        &spec,
        &mut idx,
        &mut w,
    )?;
    compare("topk_idx", &stream.clone_dtoh(&idx)?, &want_idx)?;
    compare_bits(
        "topk_weights",
        &stream.clone_dtoh(&w)?,
        &want_w,
        f32::to_bits,
    )?;
    Ok(())
}

/// Tolerance of the gate kernel: `|got - want| <= GATE_RTOL * sum_i |x_i w_i|` per logit. The
/// device sums in f32 (a thread adds its `H / 1024` products per token in order, `H / 256` on
/// the scalar path, then 5 shuffle levels and 8 warps): at `H = 7168`, fewer than 50
/// roundings, a worst case of about `50 * 2^-24 = 3e-6`; the twin sums in f64.
const GATE_RTOL: f64 = 1e-5;

/// Tokens whose logits are checked against the twin: all up to 64, else a spread of about 48
/// (the twin's f64 product is the slow part); every output is checked for poison.
fn checked_rows(t: usize) -> Vec<usize> {
    if t <= 64 {
        (0..t).collect()
    } else {
        let mut rows: Vec<usize> = (0..t).step_by(t / 48).collect();
        rows.push(t - 1);
        rows
    }
}

/// How a gate case computes the logits on the device.
#[derive(Clone, Copy)]
enum GateLaunch<'b> {
    /// The gate kernel (`W` in f32).
    Kernel,
    /// cuBLAS on the tensor cores (`x` and `W` in bf16; `W`'s values are drawn as bf16 values).
    Gemm(&'b CudaBlas),
}

/// The gate's logits on `t` random tokens of `x` (stored from element `offset` on, to test
/// misaligned inputs) against the host twin.
#[allow(clippy::too_many_arguments)]
fn gate_case<T: GateInput + cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    t: usize,
    e: usize,
    h: usize,
    offset: usize,
    make: fn(f32) -> T,
    launch: GateLaunch<'_>,
) -> CaseResult {
    let shape = GateShape {
        num_experts: e,
        hidden: h,
    };
    let x: Vec<T> = (0..offset + t * h)
        .map(|_| make(rng.random_range(-2.0f32..2.0)))
        .collect();
    // The GEMM's weight is bf16: draw bf16 values (the twin gets them as f32, exactly).
    let w: Vec<f32> = (0..e * h)
        .map(|_| {
            let v = rng.random_range(-0.05f32..0.05);
            match launch {
                GateLaunch::Kernel => v,
                GateLaunch::Gemm(_) => bf16::from_f32(v).to_f32(),
            }
        })
        .collect();
    let mut out = poisoned::<f32>(stream, (t * e).max(1))?;
    let logits = &mut out.slice_mut(0..t * e);
    match launch {
        GateLaunch::Kernel => {
            let (x_dev, w_dev) = (stream.clone_htod(&x)?, stream.clone_htod(&w)?);
            routing::gate_logits_cuda(stream, &x_dev.slice(offset..), &w_dev, shape, logits)?;
        }
        GateLaunch::Gemm(blas) => {
            // The GEMM takes bf16 only (the cases draw `x` as bf16 values).
            let x16: Vec<bf16> = x.iter().map(|v| bf16::from_f32(v.to_f32())).collect();
            let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let (x_dev, w_dev) = (stream.clone_htod(&x16)?, stream.clone_htod(&w16)?);
            routing::gate_logits_gemm_cuda(
                stream,
                blas,
                &x_dev.slice(offset..),
                &w_dev,
                shape,
                logits,
            )?;
        }
    }
    let got = stream.clone_dtoh(&out)?;
    let poison = u32::from_ne_bytes([0xAB; 4]);
    if t == 0 {
        // Nothing may be written: the one spare element keeps its poison.
        return compare("untouched spare element", &[got[0].to_bits()], &[poison]);
    }
    if let Some(i) = got.iter().position(|v| v.to_bits() == poison) {
        return Err(format!("logits[{i}] not written (poison)").into());
    }
    let x = &x[offset..];
    let mut want = vec![0f32; e];
    for r in checked_rows(t) {
        let xr = &x[r * h..(r + 1) * h];
        routing::gate_logits(xr, &w, shape, &mut want)?;
        for (j, (&g, &wt)) in got[r * e..(r + 1) * e].iter().zip(&want).enumerate() {
            let scale: f64 = xr
                .iter()
                .zip(&w[j * h..(j + 1) * h])
                .map(|(a, &b)| (f64::from(a.to_f32()) * f64::from(b)).abs())
                .sum();
            let err = (f64::from(g) - f64::from(wt)).abs();
            if err.is_nan() || err > GATE_RTOL * scale {
                return Err(format!(
                    "logits[{r}, {j}] = {g}, twin {wt}: error {err:.3e} > {GATE_RTOL} x {scale:.3e}"
                )
                .into());
            }
        }
    }
    Ok(())
}

/// The router's device path: gate kernel, then the routing kernel on the logits; the routing
/// must equal the host twin's on the same (device) logits bit for bit.
fn gate_topk_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    t: usize,
    h: usize,
    spec: TopkSpec,
    scoring: Scoring,
) -> CaseResult {
    let (e, k) = (spec.num_experts, spec.top_k);
    let shape = GateShape {
        num_experts: e,
        hidden: h,
    };
    let x: Vec<bf16> = (0..t * h)
        .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect();
    let w: Vec<f32> = (0..e * h)
        .map(|_| rng.random_range(-0.05f32..0.05))
        .collect();
    let bias: Vec<f32> = (0..e).map(|_| rng.random_range(-0.3f32..0.3)).collect();
    let (x_dev, w_dev, b_dev) = (
        stream.clone_htod(&x)?,
        stream.clone_htod(&w)?,
        stream.clone_htod(&bias)?,
    );
    let mut logits = poisoned::<f32>(stream, t * e)?;
    routing::gate_logits_cuda(stream, &x_dev, &w_dev, shape, &mut logits)?;
    let mut idx = poisoned::<i64>(stream, t * k)?;
    let mut wts = poisoned::<f32>(stream, t * k)?;
    let input = TopkInput::Logits(scoring);
    let b: &dyn cudarc::driver::DevicePtr<f32> = &b_dev;
    routing::route_topk_cuda(stream, &logits, input, Some(b), &spec, &mut idx, &mut wts)?;
    let host_logits = stream.clone_dtoh(&logits)?;
    let mut want_idx = vec![0i64; t * k];
    let mut want_w = vec![0f32; t * k];
    routing::route_topk(
        &host_logits,
        input,
        Some(&bias),
        &spec,
        &mut want_idx,
        &mut want_w,
    )?;
    compare("topk_idx", &stream.clone_dtoh(&idx)?, &want_idx)?;
    compare_bits(
        "topk_weights",
        &stream.clone_dtoh(&wts)?,
        &want_w,
        f32::to_bits,
    )
}

/// Random local ids: each token picks `k` distinct experts among `num_local` plus `-1`s
/// (`p_none`), or with `hot`, expert 0 first.
fn random_local_idx(
    rng: &mut StdRng,
    n: usize,
    k: usize,
    num_local: usize,
    p_none: f64,
    hot: bool,
) -> Vec<i64> {
    let mut out = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut row: Vec<i64> = Vec::with_capacity(k);
        if hot {
            row.push(0);
        }
        while row.len() < k {
            if rng.random_bool(p_none) {
                row.push(-1);
                continue;
            }
            let e = rng.random_range(0..num_local as i64);
            if !row.contains(&e) || row.len() >= num_local {
                row.push(if row.contains(&e) { -1 } else { e });
            }
        }
        out.extend(row);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn order_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    n: usize,
    k: usize,
    num_local: usize,
    alignment: usize,
    row: usize,
    p_none: f64,
    hot: bool,
) -> CaseResult {
    let idx = random_local_idx(rng, n, k, num_local, p_none, hot);
    let x: Vec<bf16> = (0..n * row)
        .map(|_| bf16::from_f32(rng.random_range(-3.0f32..3.0)))
        .collect();
    let rows = rows_bound(n, k, num_local, alignment);
    let mut a_host = vec![bf16::ZERO; rows * row];
    let want = expert_order::permute(&x, &idx, k, num_local, alignment, row, &mut a_host)?;

    let x_dev = stream.clone_htod(&x)?;
    let i_dev = stream.clone_htod(&idx)?;
    let mut a = poisoned::<bf16>(stream, rows.max(1) * row)?;
    let mut counts = poisoned::<i32>(stream, num_local)?;
    let mut fill = poisoned::<i32>(stream, num_local)?;
    let mut positions = poisoned::<i32>(stream, (n * k).max(1))?;
    let mut pos_view = positions.slice_mut(0..n * k);
    expert_order::permute_cuda(
        stream,
        &x_dev,
        &i_dev,
        k,
        num_local,
        alignment,
        row,
        &mut a,
        &mut counts,
        &mut fill,
        &mut pos_view,
    )?;
    compare("counts", &stream.clone_dtoh(&counts)?, &want.counts)?;
    let pos = stream.clone_dtoh(&pos_view)?;
    let a_got = stream.clone_dtoh(&a)?;
    let starts = ep_kernels::gemm::group_starts(
        &want.counts,
        ep_kernels::gemm::GroupLayout::Contiguous { alignment },
        rows.max(1),
    )?;
    let mut seen = vec![false; rows.max(1)];
    for (p, (&e, &r)) in idx.iter().zip(&pos).enumerate() {
        if e < 0 {
            if r != -1 {
                return Err(
                    format!("positions[{p}] = {r} for a slot without a local expert").into(),
                );
            }
            continue;
        }
        let (lo, hi) = (
            starts[e as usize],
            starts[e as usize] + want.counts[e as usize] as usize,
        );
        let r = usize::try_from(r).map_err(|_| format!("positions[{p}] = {r} for expert {e}"))?;
        if r < lo || r >= hi || seen[r] {
            return Err(format!(
                "positions[{p}] = {r}: outside expert {e}'s rows {lo}..{hi} or taken twice"
            )
            .into());
        }
        seen[r] = true;
        let tok = p / k;
        if a_got[r * row..(r + 1) * row]
            .iter()
            .zip(&x[tok * row..(tok + 1) * row])
            .any(|(g, w)| g.to_bits() != w.to_bits())
        {
            return Err(format!("row {r} of a is not token {tok}'s row").into());
        }
    }
    // Un-permute: y = a scaled per row, weights random; compare with the host twin at the
    // kernel's positions.
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(0.0f32..1.0)).collect();
    let y: Vec<bf16> = (0..rows.max(1) * row)
        .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect();
    let mut want_out = vec![bf16::ZERO; n * row];
    expert_order::unpermute(&y, &pos, &w, k, row, &mut want_out)?;
    let y_dev = stream.clone_htod(&y)?;
    let w_dev = stream.clone_htod(&w)?;
    let mut out = poisoned::<bf16>(stream, (n * row).max(1))?;
    let mut out_view = out.slice_mut(0..n * row);
    expert_order::unpermute_cuda(stream, &y_dev, &pos_view, &w_dev, k, row, &mut out_view)?;
    compare_bits(
        "unpermute",
        &stream.clone_dtoh(&out_view)?,
        &want_out,
        bf16::to_bits,
    )?;
    Ok(())
}

/// The fp8 rows of a dispatch in expert-major order: the e4m3 rows through `permute_cuda`, their
/// scales through `scatter_cuda` at the same positions; every placed row and scale row must be
/// its token's, bit for bit, and rows no slot lands on keep their poison.
fn fp8_order_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    n: usize,
    k: usize,
    num_local: usize,
    hidden: usize,
) -> CaseResult {
    let idx = random_local_idx(rng, n, k, num_local, 0.3, false);
    let xq: Vec<float8::F8E4M3> = (0..n * hidden)
        .map(|_| float8::F8E4M3::from_f32(rng.random_range(-400.0f32..400.0)))
        .collect();
    let groups = hidden / 128;
    let xs: Vec<f32> = (0..n * groups)
        .map(|_| rng.random_range(0.01f32..1.0))
        .collect();
    let rows = rows_bound(n, k, num_local, 1);
    let xq_dev = stream.clone_htod(&xq)?;
    let xs_dev = stream.clone_htod(&xs)?;
    let i_dev = stream.clone_htod(&idx)?;
    let mut a = poisoned::<float8::F8E4M3>(stream, rows * hidden)?;
    let mut a_s = poisoned::<f32>(stream, rows * groups)?;
    let mut counts = poisoned::<i32>(stream, num_local)?;
    let mut fill = poisoned::<i32>(stream, num_local)?;
    let mut positions = poisoned::<i32>(stream, n * k)?;
    expert_order::permute_cuda(
        stream,
        &xq_dev,
        &i_dev,
        k,
        num_local,
        1,
        hidden,
        &mut a,
        &mut counts,
        &mut fill,
        &mut positions,
    )?;
    expert_order::scatter_cuda(stream, &xs_dev, &positions, k, groups, &mut a_s)?;
    let pos = stream.clone_dtoh(&positions)?;
    let a_got = stream.clone_dtoh(&a)?;
    let s_got = stream.clone_dtoh(&a_s)?;
    // The host twin of the scatter at the kernel's positions.
    let mut s_want = s_got.clone();
    s_want.iter_mut().for_each(|v| *v = f32::poison());
    expert_order::scatter(&xs, &pos, k, groups, &mut s_want)?;
    compare_bits("scales", &s_got, &s_want, f32::to_bits)?;
    for (p, &r) in pos.iter().enumerate() {
        if r < 0 {
            continue;
        }
        let (r, t) = (r as usize, p / k);
        if a_got[r * hidden..(r + 1) * hidden]
            .iter()
            .zip(&xq[t * hidden..(t + 1) * hidden])
            .any(|(g, w)| g.to_bits() != w.to_bits())
        {
            return Err(format!("row {r} of a is not token {t}'s e4m3 row").into());
        }
    }
    Ok(())
}

fn main() {
    let mut runner = Runner::from_env("gpu_expert_path");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => gpu_test_suite::skip(&format!("no CUDA device: {e}")),
    };
    let v3 = TopkSpec {
        num_experts: 256,
        top_k: 8,
        n_group: 8,
        topk_group: 4,
        group_score: GroupScore::Top2Sum,
        norm_topk_prob: true,
        scaling: 2.5,
    };
    let v2 = TopkSpec {
        num_experts: 64,
        top_k: 6,
        n_group: 8,
        topk_group: 3,
        group_score: GroupScore::Max,
        norm_topk_prob: false,
        scaling: 1.0,
    };
    let greedy = TopkSpec {
        num_experts: 60,
        top_k: 4,
        n_group: 1,
        topk_group: 1,
        group_score: GroupScore::None,
        norm_topk_prob: true,
        scaling: 1.0,
    };
    let wide = TopkSpec {
        num_experts: 1024,
        top_k: 32,
        n_group: 32,
        topk_group: 3,
        group_score: GroupScore::Top2Sum,
        norm_topk_prob: true,
        scaling: 1.0,
    };
    let odd_groups = TopkSpec {
        num_experts: 96,
        top_k: 5,
        n_group: 3,
        topk_group: 2,
        group_score: GroupScore::Top2Sum,
        norm_topk_prob: false,
        scaling: 0.5,
    };
    for (name, t, spec, bias, ties) in [
        ("v3/4096-tokens/bias", 4096, v3, true, false),
        ("v3/ties/bias", 513, v3, true, true),
        ("v3/one-token", 1, v3, true, false),
        ("v3/no-tokens", 0, v3, true, false),
        ("v2/group-max/ties", 300, v2, false, true),
        ("greedy/softmax-like", 777, greedy, false, true),
        ("1024-experts/top-32", 64, wide, true, true),
        ("groups-of-32/bias", 200, odd_groups, true, false),
    ] {
        runner.case(&format!("routing/{name}"), |rng| {
            routing_case(&stream, rng, t, spec, TopkInput::Scores, bias, ties)
        });
    }
    use Scoring::{Sigmoid, Softmax};
    for (name, t, spec, scoring, bias, ties) in [
        ("v3/sigmoid/one-token", 1, v3, Sigmoid, true, false),
        ("v3/sigmoid/ties", 700, v3, Sigmoid, true, true),
        ("v3/softmax/bias", 300, v3, Softmax, true, false),
        ("v2/softmax/group-max/ties", 257, v2, Softmax, false, true),
        ("greedy/softmax", 100, greedy, Softmax, false, false),
        ("1024-experts/sigmoid/ties", 64, wide, Sigmoid, true, true),
        ("1024-experts/softmax", 33, wide, Softmax, true, false),
        (
            "groups-of-32/softmax",
            200,
            odd_groups,
            Softmax,
            true,
            false,
        ),
    ] {
        runner.case(&format!("routing-from-logits/{name}"), |rng| {
            let input = TopkInput::Logits(scoring);
            routing_case(&stream, rng, t, spec, input, bias, ties)
        });
    }
    // The gate kernel on bf16 tokens: (name, tokens, experts, hidden, offset of x).
    let mut bf16_gates: Vec<(String, usize, usize, usize, usize)> = [1, 3, 64, 129, 1000]
        .iter()
        .map(|&t| (format!("{t}x7168-to-256"), t, 256, 7168, 0))
        .collect();
    bf16_gates.extend([
        ("5x136-to-72".to_string(), 5, 72, 136, 0),
        ("40x136-to-72".to_string(), 40, 72, 136, 0),
        ("scalar/odd-hidden-17x131-to-72".to_string(), 17, 72, 131, 0),
        (
            "scalar/misaligned-x/1x7168-to-256".to_string(),
            1,
            256,
            7168,
            1,
        ),
        ("no-tokens".to_string(), 0, 256, 7168, 0),
    ]);
    let kernel = GateLaunch::Kernel;
    for (name, t, e, h, offset) in bf16_gates {
        runner.case(&format!("gate/bf16/{name}"), |rng| {
            gate_case(&stream, rng, t, e, h, offset, bf16::from_f32, kernel)
        });
    }
    runner.case("gate/f16/9x136-to-72", |rng| {
        gate_case(&stream, rng, 9, 72, 136, 0, f16::from_f32, kernel)
    });
    runner.case("gate/f32/3x7168-to-256", |rng| {
        gate_case(&stream, rng, 3, 256, 7168, 0, |v| v, kernel)
    });
    // The tensor-core GEMM the router uses past `GATE_KERNEL_MAX_TOKENS_BESIDE_GEMM` bf16
    // tokens (and 9 to 64 of them).
    let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("cuBLAS handle: {e}"));
    for (t, e, h) in [
        (9, 256, 7168),
        (64, 256, 7168),
        (65, 256, 7168),
        (2048, 256, 7168),
        (77, 72, 136),
        (0, 256, 7168),
    ] {
        runner.case(&format!("gate-gemm/bf16/{t}x{h}-to-{e}"), |rng| {
            let blas = blas.as_ref().map_err(String::clone)?;
            gate_case(
                &stream,
                rng,
                t,
                e,
                h,
                0,
                bf16::from_f32,
                GateLaunch::Gemm(blas),
            )
        });
    }
    for (name, t, h, spec, scoring) in [
        ("v3/sigmoid/one-token", 1, 7168, v3, Sigmoid),
        ("v3/sigmoid/64-tokens", 64, 7168, v3, Sigmoid),
        ("greedy/softmax/3-tokens", 3, 512, greedy, Softmax),
    ] {
        runner.case(&format!("gate+routing/{name}"), |rng| {
            gate_topk_case(&stream, rng, t, h, spec, scoring)
        });
    }
    for (name, n, k, l, align, row, p_none, hot) in [
        ("ds-v3/4096x8-of-256", 4096, 8, 256, 1, 7168, 0.0, false),
        ("ep8/recv-with-minus-1", 3000, 8, 32, 1, 7168, 0.6, false),
        ("aligned-128/hot-expert", 500, 8, 16, 128, 1000, 0.2, true),
        ("one-token", 1, 8, 256, 1, 7168, 0.0, false),
        ("no-tokens", 0, 8, 8, 1, 64, 0.0, false),
        ("all-minus-1", 40, 4, 8, 4, 64, 1.0, false),
        ("top-32", 70, 32, 64, 1, 128, 0.1, false),
    ] {
        runner.case(&format!("expert-order/{name}"), |rng| {
            order_case(&stream, rng, n, k, l, align, row, p_none, hot)
        });
    }
    for (name, n, k, l, h) in [
        ("ds-v3/2048x8-of-32", 2048, 8, 32, 7168),
        ("v2-lite/300x6-of-64", 300, 6, 64, 2048),
    ] {
        runner.case(&format!("expert-order-fp8/{name}"), |rng| {
            fp8_order_case(&stream, rng, n, k, l, h)
        });
    }
    runner.finish();
}
