//! GPU tests: the routing kernel and the expert-order kernels against their host twins, on
//! fresh random inputs written into poisoned outputs. Routing is compared bit for bit (ids and
//! weights), including ties, negative biases and every group rule; the permute by its
//! invariants (counts equal, every pair inside its expert's aligned range exactly once, rows
//! copied bit for bit; the order within an expert is the kernel's), the un-permute bit for bit
//! given the kernel's positions.

mod common;

use std::sync::Arc;

use common::{compare, compare_bits, device, poisoned, CaseResult, Runner};
use cudarc::driver::CudaStream;
use ep_kernels::expert_order::{self, rows_bound};
use ep_kernels::routing::{self, GroupScore, TopkSpec};
use half::bf16;
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

fn routing_case(
    stream: &Arc<CudaStream>,
    rng: &mut StdRng,
    t: usize,
    spec: TopkSpec,
    with_bias: bool,
    ties: bool,
) -> CaseResult {
    let (e, k) = (spec.num_experts, spec.top_k);
    let scores = random_scores(rng, t * e, ties);
    let bias: Option<Vec<f32>> =
        with_bias.then(|| (0..e).map(|_| rng.random_range(-0.5f32..0.2)).collect());
    let mut want_idx = vec![0i64; t * k];
    let mut want_w = vec![0f32; t * k];
    routing::route_topk(&scores, bias.as_deref(), &spec, &mut want_idx, &mut want_w)?;
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

fn main() {
    let mut runner = Runner::from_env("gpu_expert_path");
    let (_ctx, stream) = match device() {
        Ok(d) => d,
        Err(e) => {
            println!("FAILED setup: no CUDA device: {e}");
            println!("0 passed, 1 failed");
            std::process::exit(1);
        }
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
            routing_case(&stream, rng, t, spec, bias, ties)
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
    runner.finish();
}
