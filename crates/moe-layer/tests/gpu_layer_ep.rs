//! GPU tests of `MoeLayer` across GPUs: `N` ranks as threads of one process over the `N`
//! visible GPUs (at least 2; CUDA buffers over NVLink peer memory, experts split evenly), each
//! rank's output against the CPU reference, in both modes.
//!
//! The reference is the CPU `Experts` over all experts (f32, on the bf16-rounded weights) with
//! the routing the rank's GPU router chose, plus the shared experts, as in `gpu_layer`; same
//! tolerances (`1e-2` relative over the batch, `3e-2` per token). Cases: normal mode (a rank
//! without tokens, a hot expert, fp8 dispatch), low-latency mode with the combine per rank (the
//! default) and per expert, `Mode::Auto` with different token counts per rank, and a decode
//! step captured as a CUDA graph on every rank and replayed on fresh inputs (equal to eager
//! runs within 1e-3), and a normal step likewise (refused without worst-case outputs); all again with the two-batch overlap, the expert-group pipeline, and
//! worst-case dispatch outputs (`normal_max_tokens_per_rank`), and with fp8 experts (a
//! block-scaled fp8 checkpoint, with fp8 and bf16 dispatch, a hot expert) against the fp8
//! reference of `gpu_common/fp8.rs` and its tolerance; and with redundant experts (EPLB
//! placement of `E + 8 R` slots, bf16 and fp8 with a hot expert), where every forward also
//! checks the layer's load statistics against the router's picks, and a re-placement for the
//! opposite skew moves experts between the GPUs before steps and a captured decode step.
//!
//! Prints one line per case, then `N passed, N failed`; with fewer than 2 GPUs it runs nothing,
//! says so and fails unless `EP_GPU_ALLOW_SKIP=1` (`gpu-test-suite`). A first argument filters
//! cases by name.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use moe_layer::config::MoeConfig;
use moe_layer::ep_kernels::gemm::GemmGrid;
use moe_layer::ep_runtime::{Buffer, BufferConfig, LocalTransport, Reduction, Topology};
use moe_layer::{Mode, MoeLayer, MoeLayerOptions, SharedPlacement, StepGraph};

mod gpu_common;
use gpu_common::{cfg, on_device, rel, weights, R};

/// Low-latency slots per rank.
const LL_MAX: usize = 64;

/// One rank's GPU layer (its shard of the experts) and a CPU reference layer (all experts).
struct Rank {
    dev: Device,
    gpu: MoeLayer,
    cpu: MoeLayer,
    /// Experts loaded from a block-scaled fp8 checkpoint (the fp8 reference and tolerance).
    fp8_experts: bool,
}

/// A setup: the layer's configuration and options.
struct Setup {
    name: &'static str,
    cfg: MoeConfig,
    hot: bool,
    fp8: bool,
    /// Weights from a block-scaled fp8 checkpoint: fp8 experts on the fp8 grouped GEMMs.
    fp8_experts: bool,
    /// Redundant experts: `E + 8 R` slots placed by EPLB from skewed loads, with load stats.
    redundant: bool,
    reduction: Reduction,
    tbo: bool,
    shared_first: bool,
    /// `MoeLayerOptions::expert_groups`.
    groups: usize,
    /// `MoeLayerOptions::normal_gemm_grid`.
    grid: Option<GemmGrid>,
    /// `MoeLayerOptions::normal_max_tokens_per_rank`.
    worst: Option<usize>,
}

impl Setup {
    /// The default setup under `name`: 32 experts of a 1024-wide model, bf16 rows, the combine
    /// per rank, no overlap option.
    fn new(name: &'static str) -> Self {
        Self {
            name,
            cfg: cfg(1024, 128, 32, 4, (4, 2)),
            hot: false,
            fp8: false,
            fp8_experts: false,
            redundant: false,
            reduction: Reduction::PerRank,
            tbo: false,
            shared_first: false,
            groups: 1,
            grid: None,
            worst: None,
        }
    }
}

fn build(
    rank: usize,
    world: usize,
    transport: LocalTransport,
    s: &Setup,
    w: &HashMap<String, Tensor>,
) -> R<Rank> {
    let dev = Device::new_cuda(rank)?;
    let c = &s.cfg;
    let on_dev = on_device(w, &dev)?;
    let placement = s
        .redundant
        .then(|| redundant_placement(c, world))
        .transpose()?;
    let slots = placement
        .as_ref()
        .map_or(c.n_routed_experts, |p| p.num_physical());
    let bcfg = BufferConfig::default()
        .with_low_latency(LL_MAX, c.hidden_size, slots)
        .with_timeout(Duration::from_secs(20));
    let buffer = Buffer::new(
        Arc::new(transport),
        Topology::new(rank, world, world)?,
        bcfg.clone(),
        &dev,
    )?;
    let opts = MoeLayerOptions {
        mode: Mode::Auto,
        low_latency_max_tokens: LL_MAX,
        fp8_dispatch: s.fp8,
        expert_alignment: 1,
        shared_placement: SharedPlacement::Auto,
        low_latency_tiles: None,
        low_latency_reduction: s.reduction,
        two_batch_overlap: s.tbo,
        prefill_in_low_latency_chunks: false,
        shared_before_dispatch: s.shared_first,
        expert_groups: s.groups,
        normal_gemm_grid: s.grid,
        normal_max_tokens_per_rank: s.worst,
    };
    let gpu = MoeLayer::load_placed(
        VarBuilder::from_tensors(on_dev, DType::BF16, &dev),
        c,
        Arc::new(buffer),
        opts,
        placement.as_ref(),
    )?
    .with_load_stats()?;
    let cpu = MoeLayer::load(
        VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu),
        c,
        Arc::new(Buffer::single(
            &Device::Cpu,
            bcfg.with_low_latency(LL_MAX, c.hidden_size, c.n_routed_experts),
        )?),
        MoeLayerOptions {
            fp8_dispatch: false,
            ..opts
        },
    )?;
    if gpu.experts().is_fp8() != s.fp8_experts {
        return Err(format!(
            "fp8 experts: {}, wanted {}",
            gpu.experts().is_fp8(),
            s.fp8_experts
        )
        .into());
    }
    Ok(Rank {
        dev,
        gpu,
        cpu,
        fp8_experts: s.fp8_experts,
    })
}

/// Redundant experts for `world` ranks: `E + 8 R` slots placed by EPLB (global policy) from
/// skewed loads (expert `x` draws `1 / (1 + 7x mod E)`; `reversed`: expert `E - 1 - x` does).
fn redundant_placement(c: &MoeConfig, world: usize) -> R<moe_layer::placement::Placement> {
    skewed_placement(c.n_routed_experts, world, false)
}

fn skewed_placement(e: usize, world: usize, reversed: bool) -> R<moe_layer::placement::Placement> {
    let mut loads: Vec<f64> = (0..e).map(|x| 1.0 / (1 + (x * 7) % e) as f64).collect();
    if reversed {
        loads.reverse();
    }
    Ok(moe_layer::placement::place(
        &loads,
        moe_layer::placement::PlacementShape {
            num_physical: e + 8 * world,
            num_groups: 1,
            num_nodes: 1,
            num_gpus: world,
        },
    )?)
}

/// The reference for this rank's GPU input `x` (see the file comment).
fn reference(r: &Rank, x: &Tensor) -> R<Tensor> {
    if r.fp8_experts {
        return gpu_common::fp8::reference(&r.gpu, &r.cpu, x);
    }
    gpu_common::reference(&r.gpu, &r.cpu, x)
}

/// The relative error bound of a replay against the reference over its batch.
fn batch_tolerance(r: &Rank) -> f64 {
    if r.fp8_experts {
        gpu_common::fp8::TOLERANCE.0
    } else {
        1e-2
    }
}

fn tokens(r: &Rank, t: usize, scale: f32) -> R<Tensor> {
    let h = r.gpu.router().hidden_size();
    Ok(if t == 0 {
        // CUDA refuses zero-byte allocations: an empty view of a real tensor.
        Tensor::zeros((1, h), DType::BF16, &r.dev)?.narrow(0, 0, 0)?
    } else {
        // Drawn on the CPU (a fresh generator per call): the ranks' GPU generators share a
        // seed and would give every rank the same tokens.
        Tensor::randn(0f32, scale, (t, h), &Device::Cpu)?
            .to_dtype(DType::BF16)?
            .to_device(&r.dev)?
    })
}

/// One forward in `mode` of `t` tokens on this rank, checked against the reference.
fn forward_case(r: &Rank, t: usize, mode: Mode) -> R<String> {
    let h = r.gpu.router().hidden_size();
    let x = tokens(r, t, 1.0)?;
    r.gpu.take_expert_load()?; // the earlier cases' counts
    let y = r.gpu.forward_with_mode(&x, mode)?;
    if y.dims() != [t, h] {
        return Err(format!("output shape {:?}, want [{t}, {h}]", y.dims()).into());
    }
    if t == 0 {
        return Ok("T=0".into());
    }
    // The load statistics count this step's logical picks (read on the host, after the step).
    let picks: Vec<u32> = r
        .gpu
        .router()
        .forward(&x)?
        .topk_idx
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_vec1()?;
    let load = r.gpu.take_expert_load()?.ok_or("no load statistics")?;
    let mut want = vec![0.0; load.len()];
    for p in picks {
        want[p as usize] += 1.0;
    }
    if load != want {
        return Err(format!("load statistics {load:?}, routed {want:?}").into());
    }
    let (all, worst) = rel(&y, &reference(r, &x)?)?;
    let ok = if r.fp8_experts {
        gpu_common::fp8::within(t, all, worst)
    } else {
        all <= 1e-2 && worst <= 3e-2
    };
    if !ok {
        return Err(format!("T={t}: relative error {all:.2e} (worst token {worst:.2e})").into());
    }
    Ok(format!("T={t}: rel {all:.1e}, worst token {worst:.1e}"))
}

/// Re-places the experts for the opposite skew while the layer lives (slots change GPU over
/// the buffer's host transport, weights written in place), then steps in both modes and a
/// captured decode step against the reference.
fn replace_case(r: &mut Rank, world: usize) -> R<String> {
    let next = skewed_placement(r.gpu.router().num_experts(), world, true)?;
    let done = r.gpu.replace_experts(next.clone())?;
    if done.moved_slots == 0 || r.gpu.expert_map().map(|m| m.placement()) != Some(&next) {
        return Err(format!("re-placement moved {} slots", done.moved_slots).into());
    }
    let normal = forward_case(r, 300, Mode::Normal)?;
    let ll = forward_case(r, 7, Mode::LowLatency)?;
    let graph = graph_case(r, 8, 3)?;
    Ok(format!(
        "{} slots moved, {:.1} MiB sent in {:.1} ms; {normal}; {ll}; {graph}",
        done.moved_slots,
        done.bytes_sent as f64 / (1 << 20) as f64,
        done.elapsed.as_secs_f64() * 1e3
    ))
}

/// A decode step captured on every rank at once, replayed on fresh inputs.
fn graph_case(r: &Rank, t: usize, steps: usize) -> R<String> {
    let g = r.gpu.capture_decode(t, DType::BF16)?;
    let done = replays(r, &g, Mode::LowLatency, steps)?;
    r.gpu.buffer().low_latency_check()?;
    Ok(done)
}

/// A normal step captured on every rank at once and replayed on fresh inputs (equal to eager
/// runs within 1e-3 and to the reference), with worst-case dispatch outputs; refused on every
/// rank, naming the option, without them.
fn prefill_graph_case(r: &Rank, t: usize, steps: usize) -> R<String> {
    if r.gpu.options().normal_max_tokens_per_rank.is_none() {
        return match r.gpu.capture_prefill(t, DType::BF16) {
            Err(e) if e.to_string().contains("normal_max_tokens_per_rank") => {
                Ok("refused without worst-case outputs".into())
            }
            Err(e) => Err(format!("refused with `{e}`").into()),
            Ok(_) => Err("captured a normal step that reads its count on the host".into()),
        };
    }
    let g = r.gpu.capture_prefill(t, DType::BF16)?;
    replays(r, &g, Mode::Normal, steps)
}

/// Replays the captured step `g` on `steps` fresh inputs, each against an eager step in `mode`
/// (within 1e-3) and the reference (1e-2).
fn replays(r: &Rank, g: &StepGraph<'_>, mode: Mode, steps: usize) -> R<String> {
    let t = g.input().dims()[0];
    let mut last = 0.0;
    for step in 0..steps {
        let x = tokens(r, t, 1.0 + step as f32 * 0.1)?;
        let replayed = g.replay(&x)?;
        let eager = r.gpu.forward_with_mode(&x, mode)?;
        let (all, worst) = rel(&replayed, &eager)?;
        if all > 1e-3 || worst > 1e-3 {
            return Err(format!(
                "step {step}: replay differs from eager by {all:.2e} (worst {worst:.2e})"
            )
            .into());
        }
        let (refd, _) = rel(&replayed, &reference(r, &x)?)?;
        if refd > batch_tolerance(r) {
            return Err(format!("step {step}: replay vs reference {refd:.2e}").into());
        }
        last = refd;
    }
    Ok(format!("{steps} replays, last vs reference {last:.1e}"))
}

/// The cases every rank runs, in the same order (the layer's ops are collectives): names and
/// per-rank bodies.
type CaseFn = Box<dyn Fn(&mut Rank, usize) -> R<String> + Sync>;
type Case = (String, CaseFn);

fn cases(world: usize, redundant: bool) -> Vec<Case> {
    let mut v: Vec<Case> = Vec::new();
    let mut add = |name: String, f: CaseFn| {
        v.push((name, f));
    };
    for t in [300usize, 1200] {
        add(
            format!("normal/T={t}"),
            Box::new(move |r, _| forward_case(r, t, Mode::Normal)),
        );
    }
    add(
        "normal/rank0-empty".into(),
        Box::new(|r, rank| forward_case(r, if rank == 0 { 0 } else { 200 }, Mode::Normal)),
    );
    for t in [1usize, 7, LL_MAX] {
        add(
            format!("low-latency/T={t}"),
            Box::new(move |r, _| forward_case(r, t, Mode::LowLatency)),
        );
    }
    add(
        "low-latency/last-rank-empty".into(),
        Box::new(move |r, rank| {
            forward_case(r, if rank == world - 1 { 0 } else { 5 }, Mode::LowLatency)
        }),
    );
    // Auto: the ranks agree on the mode by the largest count (low latency here, then normal).
    add(
        "auto/uneven".into(),
        Box::new(|r, rank| forward_case(r, 3 + 20 * rank, Mode::Auto)),
    );
    add(
        "auto/one-rank-over-the-limit".into(),
        Box::new(|r, rank| forward_case(r, if rank == 0 { LL_MAX + 40 } else { 9 }, Mode::Auto)),
    );
    add(
        "decode-graph/T=8".into(),
        Box::new(|r, _| graph_case(r, 8, 4)),
    );
    add(
        "prefill-graph/T=300".into(),
        Box::new(|r, _| prefill_graph_case(r, 300, 3)),
    );
    if redundant {
        add(
            "re-placed/normal-low-latency-decode-graph".into(),
            Box::new(move |r, _| replace_case(r, world)),
        );
    }
    v
}

fn main() {
    let filter = std::env::args().nth(1);
    let gpus = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map_or(0, |n| n.max(0) as usize);
    if gpus < 2 {
        gpu_test_suite::skip(&format!(
            "{gpus} GPU(s) visible: the multi-rank layer cases need 2 or more"
        ));
    }
    let world = gpus.min(8);
    let hot = || cfg(512, 64, 16 * world, 4, (1, 1));
    let setups = [
        Setup::new("bf16"),
        Setup {
            reduction: Reduction::PerExpert,
            ..Setup::new("bf16-per-expert")
        },
        Setup {
            fp8: true,
            ..Setup::new("fp8")
        },
        Setup {
            tbo: true,
            ..Setup::new("two-batch-overlap")
        },
        Setup {
            tbo: true,
            fp8: true,
            ..Setup::new("two-batch-overlap-fp8")
        },
        Setup {
            shared_first: true,
            ..Setup::new("shared-before-dispatch")
        },
        Setup {
            groups: 2,
            ..Setup::new("expert-groups-2")
        },
        // Uneven groups (3 of the 8 or 16 local experts), fp8 rows, the shared experts first.
        Setup {
            groups: 3,
            fp8: true,
            shared_first: true,
            ..Setup::new("expert-groups-3-fp8-shared-first")
        },
        Setup {
            groups: 4,
            cfg: hot(),
            hot: true,
            ..Setup::new("expert-groups-4-hot-expert")
        },
        Setup {
            groups: 2,
            grid: Some(GemmGrid::PersistentOn(100)),
            ..Setup::new("expert-groups-2-persistent-on-100-sms")
        },
        Setup {
            grid: Some(GemmGrid::PerTile),
            ..Setup::new("per-tile-gemm-grid")
        },
        Setup {
            cfg: hot(),
            hot: true,
            ..Setup::new("hot-expert")
        },
        // Worst-case outputs (no host read of the count), bound by the largest normal step
        // of the cases (1200 tokens).
        Setup {
            worst: Some(1200),
            ..Setup::new("worst-case-outputs")
        },
        Setup {
            worst: Some(1200),
            fp8: true,
            grid: Some(GemmGrid::PerTile),
            cfg: hot(),
            hot: true,
            ..Setup::new("worst-case-outputs-fp8-per-tile-hot-expert")
        },
        Setup {
            worst: Some(1200),
            groups: 2,
            tbo: false,
            shared_first: true,
            ..Setup::new("worst-case-outputs-expert-groups-2-shared-first")
        },
        Setup {
            fp8_experts: true,
            fp8: true,
            ..Setup::new("fp8-experts")
        },
        Setup {
            redundant: true,
            ..Setup::new("redundant-experts")
        },
        Setup {
            redundant: true,
            fp8_experts: true,
            fp8: true,
            cfg: cfg(512, 128, 16 * world, 4, (1, 1)),
            hot: true,
            ..Setup::new("redundant-fp8-experts-hot-expert")
        },
        Setup {
            fp8_experts: true,
            ..Setup::new("fp8-experts-bf16-dispatch")
        },
        Setup {
            fp8_experts: true,
            fp8: true,
            // The hot-expert shape with an inner width the fp8 GEMMs take (128).
            cfg: cfg(512, 128, 16 * world, 4, (1, 1)),
            hot: true,
            worst: Some(1200),
            ..Setup::new("fp8-experts-hot-expert-worst-case-outputs")
        },
    ];
    let (mut passed, mut failed) = (0usize, 0usize);
    for s in &setups {
        let all_cases = cases(world, s.redundant);
        let wanted: Vec<&Case> = all_cases
            .iter()
            .filter(|(n, _)| {
                filter
                    .as_deref()
                    .is_none_or(|f| format!("ep{world}/{}/{n}", s.name).contains(f))
            })
            .collect();
        if wanted.is_empty() {
            continue;
        }
        let w = match weights(&s.cfg, s.hot).and_then(|w| {
            if s.fp8_experts {
                gpu_common::fp8::checkpoint(&w)
            } else {
                Ok(w)
            }
        }) {
            Ok(w) => w,
            Err(e) => {
                failed += 1;
                println!("FAILED ep{world}/{}/weights: {e}", s.name);
                continue;
            }
        };
        let transports = LocalTransport::group(world);
        // Per rank: per case, the outcome (or the rank's setup error).
        let per_rank: Vec<Result<Vec<Result<String, String>>, String>> = std::thread::scope(|sc| {
            let handles: Vec<_> = transports
                .into_iter()
                .enumerate()
                .map(|(rank, tr)| {
                    let (w, wanted) = (&w, &wanted);
                    sc.spawn(move || -> Result<Vec<Result<String, String>>, String> {
                        let mut r = build(rank, world, tr, s, w).map_err(|e| e.to_string())?;
                        Ok(wanted
                            .iter()
                            .map(|(_, f)| f(&mut r, rank).map_err(|e| e.to_string()))
                            .collect())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
                .collect()
        });
        for (i, (name, _)) in wanted.iter().enumerate() {
            let full = format!("ep{world}/{}/{name}", s.name);
            let mut errs = Vec::new();
            let mut notes = Vec::new();
            for (rank, r) in per_rank.iter().enumerate() {
                match r {
                    Ok(v) => match &v[i] {
                        Ok(n) => notes.push(format!("rank {rank}: {n}")),
                        Err(e) => errs.push(format!("rank {rank}: {e}")),
                    },
                    Err(e) => errs.push(format!("rank {rank} setup: {e}")),
                }
            }
            if errs.is_empty() {
                passed += 1;
                println!("ok     {full}: {}", notes.join("; "));
            } else {
                failed += 1;
                println!("FAILED {full}: {}", errs.join("; "));
            }
        }
    }
    gpu_test_suite::finish(passed, failed);
}
