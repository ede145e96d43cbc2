//! The MoE layer under skewed routing, with fixed expert placement against EPLB placement
//! (`moe_layer::placement`, redundant experts through `MoeLayer::with_placement`), across
//! `EP_BENCH_RANKS` GPUs (default 2; ranks as threads, NVLink buffers) at DeepSeek-V3's shapes
//! (256 experts of 2048, top-8 of 4 groups, hidden 7168, bf16).
//!
//! Routing: the router's correction bias skews which experts tokens pick
//! (`EP_BENCH_ROUTING`, comma-separated, default all): `uniform` (a bias of std 0.01),
//! `zipf1` / `zipf1.5` (expert of popularity rank `j`, in a random order, gets
//! `0.1 * s * ln(1 / j)`), `hot8` (8 experts get +0.5: a few take most tokens). The expert loads
//! these give are measured, not assumed: each configuration first runs one step with load
//! statistics (`MoeLayer::with_load_stats`), sums them over the ranks, and prints max / mean
//! per expert and, for every placement, max / mean per GPU.
//!
//! Placements: `fixed` (`E / R` experts a rank, as without EPLB), `eplb r=0` (the same slots,
//! experts re-packed onto GPUs by load) and `eplb r=8R` (8 redundant slots a GPU), both computed
//! by `placement::place` from the measured loads. Expert weights are random per slot (a
//! replica's values do not change the time). Each layer runs `EP_BENCH_TOKENS` tokens a rank
//! (default 128 and 4096: low-latency mode up to 128, normal mode above); time: median of
//! `EP_BENCH_ITERS` steps each from a synchronised device, and back to back, on rank 0 (which
//! waits for the busiest rank in the combine). `EP_BENCH_OUT` names a JSON-lines file.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::{DType, Device, Tensor};
use moe_layer::ep_runtime::{Buffer, BufferConfig, LocalTransport, Topology};
use moe_layer::expert_map::ExpertMap;
use moe_layer::placement::{imbalance, place, Placement, PlacementShape};
use moe_layer::{Experts, Mlp, Mode, MoeLayer, MoeLayerOptions, Router};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

#[allow(dead_code)] // the layer builders of the other benchmarks
mod layer_common;
use layer_common::timing::{stream_of, time_b2b_ms, time_ms};
use layer_common::{config, randn_bf16, BoxError, E, H, I, LL_MAX};

/// Redundant slots per GPU of the `eplb r=8R` placement.
const REDUNDANT_PER_GPU: usize = 8;

/// The router of routing `kind`: the same on every rank (seeded host draws).
fn router(kind: &str, dev: &Device) -> Result<Router, BoxError> {
    let mut rng = StdRng::seed_from_u64(7);
    let std = 1.0 / (H as f32).sqrt();
    let gate: Vec<f32> = (0..E * H)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
            std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect();
    let mut order: Vec<usize> = (0..E).collect();
    order.shuffle(&mut rng);
    let mut bias = vec![0f32; E];
    match kind {
        "uniform" => {
            for b in &mut bias {
                *b = 0.01 * (rng.random::<f32>() - 0.5) * 3.46;
            }
        }
        "zipf1" | "zipf1.5" => {
            let s: f32 = if kind == "zipf1" { 1.0 } else { 1.5 };
            for (j, &x) in order.iter().enumerate() {
                bias[x] = 0.1 * s * (1.0 / (j + 1) as f32).ln();
            }
        }
        "hot8" => {
            for &x in &order[..8] {
                bias[x] = 0.5;
            }
        }
        other => {
            return Err(format!("EP_BENCH_ROUTING={other}: uniform, zipf1, zipf1.5 or hot8").into())
        }
    }
    let gate = Tensor::from_vec(gate, (E, H), &Device::Cpu)?
        .to_dtype(DType::BF16)?
        .to_device(dev)?;
    let bias = Tensor::from_vec(bias, E, dev)?;
    Ok(Router::new(gate, Some(bias), &config())?)
}

/// This rank's layer: its `slots` random experts (`map`: redundant experts' map, if any).
fn layer(
    dev: &Device,
    kind: &str,
    buffer: Arc<Buffer>,
    map: Option<ExpertMap>,
) -> Result<MoeLayer, BoxError> {
    let topo = buffer.topology();
    let p = map.as_ref().map_or(E, ExpertMap::num_physical);
    let l = p / topo.num_ranks;
    let (std_in, std_out) = (1.0 / (H as f32).sqrt(), 1.0 / (I as f32).sqrt());
    let experts = Experts::from_stacked(
        topo.rank * l,
        randn_bf16(dev, &[l, 2 * I, H], std_in)?,
        randn_bf16(dev, &[l, H, I], std_out)?,
    )?;
    let shared = Mlp::new(
        randn_bf16(dev, &[I, H], std_in)?,
        randn_bf16(dev, &[I, H], std_in)?,
        randn_bf16(dev, &[H, I], std_out)?,
    )?;
    let opts = MoeLayerOptions {
        mode: Mode::Auto,
        low_latency_max_tokens: LL_MAX,
        ..Default::default()
    };
    let router = router(kind, dev)?;
    Ok(match map {
        Some(m) => MoeLayer::with_placement(router, experts, Some(shared), buffer, opts, m)?,
        None => MoeLayer::new(router, experts, Some(shared), buffer, opts)?,
    })
}

/// `t` unit-scale bf16 tokens of rank `rank` (different on every rank).
fn tokens(dev: &Device, rank: usize, t: usize) -> Result<Tensor, BoxError> {
    let mut rng = StdRng::seed_from_u64(1000 + rank as u64);
    let v: Vec<f32> = (0..t * H)
        .map(|_| rng.random::<f32>() * 3.46 - 1.73)
        .collect();
    Ok(Tensor::from_vec(v, (t, H), &Device::Cpu)?
        .to_dtype(DType::BF16)?
        .to_device(dev)?)
}

/// Sums `v` over the ranks (threads of this process).
struct Sum {
    acc: Mutex<Vec<f64>>,
    barrier: Barrier,
}

impl Sum {
    fn all(&self, v: &[f64]) -> Vec<f64> {
        {
            let mut a = self.acc.lock().expect("no rank panicked");
            if a.len() != v.len() {
                *a = vec![0.0; v.len()];
            }
            for (x, y) in a.iter_mut().zip(v) {
                *x += y;
            }
        }
        self.barrier.wait();
        let out = self.acc.lock().expect("no rank panicked").clone();
        if self.barrier.wait().is_leader() {
            self.acc.lock().expect("no rank panicked").clear();
        }
        self.barrier.wait();
        out
    }
}

struct Row {
    routing: String,
    placement: String,
    tokens: usize,
    expert_imbalance: f64,
    gpu_imbalance: f64,
    ms: f64,
    b2b_ms: f64,
}

fn run_rank(
    rank: usize,
    world: usize,
    transport: LocalTransport,
    sum: &Sum,
    (kinds, counts, iters): (&[String], &[usize], usize),
) -> Result<Vec<Row>, BoxError> {
    let dev = Device::new_cuda(rank)?;
    let stream = stream_of(&dev);
    let physical = E + REDUNDANT_PER_GPU * world;
    let bcfg = BufferConfig::default().with_low_latency(LL_MAX, H, physical);
    let buffer = Arc::new(Buffer::new(
        Arc::new(transport),
        Topology::new(rank, world, world)?,
        bcfg,
        &dev,
    )?);
    let mut rows = Vec::new();
    for kind in kinds {
        for &t in counts {
            let x = tokens(&dev, rank, t)?;
            // The loads of this routing, measured with the fixed layer.
            let fixed = layer(&dev, kind, buffer.clone(), None)?.with_load_stats()?;
            fixed.forward(&x)?;
            let local = fixed.take_expert_load()?.ok_or("no load statistics")?;
            let loads = sum.all(&local);
            let expert_imbalance = imbalance(&loads);
            let shape = |p| PlacementShape {
                num_physical: p,
                num_groups: config().n_group,
                num_nodes: 1,
                num_gpus: world,
            };
            let placements: Vec<(String, Option<Placement>)> = vec![
                ("fixed".into(), None),
                ("eplb r=0".into(), Some(place(&loads, shape(E))?)),
                (
                    format!("eplb r={}", physical - E),
                    Some(place(&loads, shape(physical))?),
                ),
            ];
            let mut fixed = Some(fixed);
            for (name, placement) in placements {
                let gpu_imbalance = match &placement {
                    Some(p) => p.imbalance(&loads, world),
                    None => Placement::identity(E).imbalance(&loads, world),
                };
                let l = match (fixed.take(), placement) {
                    (Some(l), None) => l,
                    (_, p) => {
                        let map = p.map(|p| ExpertMap::new(p, &dev)).transpose()?;
                        // Counting too, as the measured fixed layer does.
                        layer(&dev, kind, buffer.clone(), map)?.with_load_stats()?
                    }
                };
                let mut step = || -> Result<(), BoxError> {
                    l.forward_with_mode(
                        &x,
                        if t <= LL_MAX {
                            Mode::LowLatency
                        } else {
                            Mode::Normal
                        },
                    )?;
                    Ok(())
                };
                let ms = time_ms(&stream, iters, &mut step)?;
                let b2b_ms = time_b2b_ms(&stream, iters, &mut step)?;
                if rank == 0 {
                    println!(
                        "{kind:>8} T={t:<5} {name:<12} expert max/mean {expert_imbalance:5.2}  \
                         GPU max/mean {gpu_imbalance:5.3}  layer {ms:.3} ms (back to back {b2b_ms:.3})"
                    );
                }
                rows.push(Row {
                    routing: kind.clone(),
                    placement: name,
                    tokens: t,
                    expert_imbalance,
                    gpu_imbalance,
                    ms,
                    b2b_ms,
                });
                drop(l);
                stream.synchronize()?;
            }
        }
    }
    Ok(rows)
}

fn main() -> Result<(), BoxError> {
    let env = |k: &str| std::env::var(k).ok();
    let world: usize = env("EP_BENCH_RANKS")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let iters: usize = env("EP_BENCH_ITERS")
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let counts: Vec<usize> = env("EP_BENCH_TOKENS")
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![128, 4096]);
    let kinds: Vec<String> = env("EP_BENCH_ROUTING")
        .unwrap_or_else(|| "uniform,zipf1,zipf1.5,hot8".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let sum = Sum {
        acc: Mutex::new(Vec::new()),
        barrier: Barrier::new(world),
    };
    let results: Vec<Result<Vec<Row>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalTransport::group(world)
            .into_iter()
            .enumerate()
            .map(|(rank, tr)| {
                let (sum, kinds, counts) = (&sum, &kinds, &counts);
                s.spawn(move || {
                    run_rank(rank, world, tr, sum, (kinds, counts, iters))
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    });
    let mut rows = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) if rank == 0 => rows = v,
            Ok(_) => {}
            Err(e) => return Err(format!("rank {rank}: {e}").into()),
        }
    }
    if let Some(path) = env("EP_BENCH_OUT") {
        let lines: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"bench\": \"eplb\", \"ranks\": {world}, \"routing\": \"{}\", \"placement\": \"{}\", \"tokens\": {}, \
                     \"expert_max_over_mean\": {:.4}, \"gpu_max_over_mean\": {:.4}, \"layer_ms\": {:.4}, \"b2b_ms\": {:.4}}}",
                    r.routing, r.placement, r.tokens, r.expert_imbalance, r.gpu_imbalance, r.ms, r.b2b_ms
                )
            })
            .collect();
        std::fs::write(path, lines.join("\n") + "\n")?;
    }
    Ok(())
}
