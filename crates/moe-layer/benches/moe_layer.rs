//! `bench_moe_layer`: the layer a user calls, `MoeLayer`, at DeepSeek-V3 shapes (hidden 7168,
//! expert inner 2048, 256 routed experts top-8 in 8 groups, 1 shared expert, bf16), from 1 to
//! 8192 tokens per rank, beside its floors measured in the same run:
//!
//! - the weight-read floor: the bytes the step must read (the routed experts chosen at least
//!   once, the shared expert and the router) over the device-to-device copy bandwidth (read +
//!   write bytes of a 2 GiB copy, over time);
//! - dense cuBLAS (candle matmul) on the same routed FLOPs: `T x K` rows through one expert's
//!   MLP plus `T` rows through the shared expert's.
//!
//! Decode sizes (T <= 128) run in low-latency mode, eagerly and as a captured CUDA graph
//! (`MoeLayer::capture_decode`); larger ones in normal mode. The split (router, dispatch,
//! grouped GEMMs, combine, shared experts) times each part alone with events on the same
//! inputs (decode parts each captured as a graph: GPU time without launch overhead); their sum
//! against the layer's time shows what the overlap hides. Times are medians
//! of `EP_BENCH_ITERS` (default 10) event-timed runs after warm-up, each from a synchronised
//! device; normal steps and their compute parts are also timed back to back (`EP_BENCH_ITERS`
//! steps, one synchronisation: how a model runs its layers, the ranks kept in step by their
//! collectives instead of each step starting from the host's wake-up on every rank).
//!
//! One GPU by default; `EP_BENCH_RANKS=N` runs N ranks as threads over GPUs 0..N (NVLink
//! buffers, experts split evenly), and rank 0 reports: its floor counts the bytes of its own
//! experts that any rank's tokens chose (the ranks share their routing), its dense anchor the
//! routed FLOPs of its own tokens (on average what each rank computes), and "exposed" is the
//! layer's time beyond its compute parts measured alone (router, grouped GEMMs, shared
//! experts): the communication left on the critical path. `EP_BENCH_TBO=1` turns on the
//! two-batch overlap (`MoeLayerOptions::two_batch_overlap`). `EP_BENCH_TOKENS` overrides the token
//! counts (comma-separated); `EP_BENCH_OUT` names a JSON-lines output file;
//! `EP_BENCH_SMS=N` gives normal mode's dispatch and combine N SMs (`Config::num_sms`, default
//! 24); the fp8-experts layer sends its rows in fp8 (`MoeLayerOptions::fp8_dispatch`, both
//! modes: the dispatch quantizes and the fp8 GEMMs take its rows), the bf16 one in bf16;
//! `EP_BENCH_FP8=1|0` makes both send fp8 or bf16 rows;
//! `EP_BENCH_SHARED=grouped|overlap` forces where the shared expert runs in low-latency mode
//! (`MoeLayerOptions::shared_placement`; default `Auto`), `EP_BENCH_TILES=gemv|narrow|wide`
//! the low-latency grouped GEMMs' tiles (`MoeLayerOptions::low_latency_tiles`; default: the
//! layer's choice), `EP_BENCH_REDUCTION=expert` the low-latency combine per expert
//! (`MoeLayerOptions::low_latency_reduction`; default per rank), `EP_BENCH_SHARED_FIRST=0|1`
//! queues normal mode's shared expert after or before the dispatch
//! (`MoeLayerOptions::shared_before_dispatch`; default after), `EP_BENCH_EXPERT_GROUPS=N` pipelines normal
//! mode over N groups of each rank's experts (`MoeLayerOptions::expert_groups`),
//! `EP_BENCH_GEMM_GRID=persistent|per-tile|N` sets the grid of its grouped GEMMs
//! (`MoeLayerOptions::normal_gemm_grid`; N: persistent on N SMs). Normal rows across ranks also time the dispatch
//! with the shared expert beside it, issued in three orders, and the dispatch split: with its
//! layout computed beforehand, cached (reusing the handle: no notify, no host read of the
//! count), and into worst-case outputs (layout beforehand, notify, no host read; SM rings),
//! with the GB/s each moves (one line each after the table).
//! `EP_BENCH_NVL=rings|copy-engine` picks normal mode's NVLink transfer
//! (`BufferConfig::with_nvl_transfer`; default: copy engines at 2 ranks, rings above).
//! `EP_BENCH_WORST=N` gives normal mode worst-case outputs for at most N tokens per rank
//! (`MoeLayerOptions::normal_max_tokens_per_rank`: no host read of the received count; N must
//! cover every token count run), and times normal steps also as captured graphs
//! (`MoeLayer::capture_prefill`).
//! `EP_BENCH_NO_EVENT_TRACKING=1` turns off cudarc's per-slice events on each rank's context
//! before anything is allocated: what their host calls cost the layer (a measurement only).
//! `EP_BENCH_EXPERTS=bf16|fp8|both` (default bf16) picks the routed experts: bf16, block-scaled
//! fp8 (`Experts::from_fp8`: e4m3 weights with 128 x 128 scales, DeepSeek-V3's release
//! format; their rows are labelled `fp8 experts` and their floor counts one byte per routed
//! weight), or both layers, each token count run on the bf16 layer and then on the fp8 one.
//!
//! At one rank the layer's normal mode runs no dispatch or combine (every expert is local):
//! the split then reports them as 0.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::{DType, Device, Tensor, D};
use ep_kernels::cublas_sms::{sms_left, with_sm_count_target};
use ep_kernels::gemm::{GemmGrid, GemmTiles};
use moe_layer::ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
use moe_layer::ep_runtime::graph::capture;
use moe_layer::ep_runtime::{
    Buffer, BufferConfig, CombineArgs, DispatchArgs, EventOverlap, LocalTransport,
    LowLatencyCombineArgs, LowLatencyDispatchArgs, NvlTransfer, Reduction, Topology,
};
use moe_layer::{Mode, MoeLayer, MoeLayerOptions};

mod layer_common;
mod moe_layer_report;
use layer_common::timing::{stream_of, time_b2b_ms, time_ms};
use layer_common::{build_layer, build_layer_fp8, randn_bf16, BoxError, E, H, I, K, LL_MAX};
use moe_layer_report::{Row, StepTimes};

/// Median milliseconds of one replay of `f` captured as a CUDA graph: the GPU time of the work
/// without the host's launch overhead.
fn graph_ms(
    dev: &Device,
    iters: usize,
    f: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<f64, BoxError> {
    f()?;
    let (graph, ()) = capture(dev, || {
        f().map_err(|e| moe_layer::ep_runtime::Error::Unsupported(e.to_string()))
    })?;
    time_ms(&stream_of(dev), iters, &mut || {
        graph.launch()?;
        Ok(())
    })
}

/// The layer options the environment asks for (see the file comment).
fn bench_options(fp8_experts: bool) -> MoeLayerOptions {
    MoeLayerOptions {
        mode: Mode::Auto,
        low_latency_max_tokens: LL_MAX,
        fp8_dispatch: fp8_dispatch(fp8_experts),
        expert_alignment: 1,
        shared_placement: match std::env::var("EP_BENCH_SHARED").as_deref() {
            Ok("grouped") => moe_layer::SharedPlacement::Grouped,
            Ok("overlap") => moe_layer::SharedPlacement::Overlap,
            _ => moe_layer::SharedPlacement::Auto,
        },
        low_latency_tiles: match std::env::var("EP_BENCH_TILES").as_deref() {
            Ok("gemv") => Some(GemmTiles::Gemv),
            Ok("narrow") => Some(GemmTiles::Narrow),
            Ok("wide") => Some(GemmTiles::Wide),
            _ => None,
        },
        low_latency_reduction: match std::env::var("EP_BENCH_REDUCTION").as_deref() {
            Ok("expert") => Reduction::PerExpert,
            _ => Reduction::PerRank,
        },
        two_batch_overlap: std::env::var("EP_BENCH_TBO").as_deref() == Ok("1"),
        prefill_in_low_latency_chunks: false,
        shared_before_dispatch: match std::env::var("EP_BENCH_SHARED_FIRST").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => MoeLayerOptions::default().shared_before_dispatch,
        },
        expert_groups: expert_groups(),
        normal_gemm_grid: match std::env::var("EP_BENCH_GEMM_GRID").as_deref() {
            Ok("persistent") => Some(GemmGrid::Persistent),
            Ok("per-tile") => Some(GemmGrid::PerTile),
            Ok(v) => Some(GemmGrid::PersistentOn(v.parse().expect(
                "EP_BENCH_GEMM_GRID: persistent, per-tile or a number of SMs",
            ))),
            Err(_) => None,
        },
        normal_max_tokens_per_rank: std::env::var("EP_BENCH_WORST").ok().map(|v| {
            v.parse()
                .expect("EP_BENCH_WORST: the most tokens a rank sends in a normal step")
        }),
    }
}

/// What the rank threads share: each rank's experts chosen by its tokens, for the floors.
struct Exchange {
    barrier: Barrier,
    used: Mutex<Vec<Vec<bool>>>,
    compute: Mutex<Vec<[f64; 2]>>,
}

impl Exchange {
    fn new(world: usize) -> Self {
        Self {
            barrier: Barrier::new(world),
            used: Mutex::new(vec![Vec::new(); world]),
            compute: Mutex::new(vec![[0.0; 2]; world]),
        }
    }

    /// Publishes this rank's compute parts (router + grouped GEMMs + shared experts, timed
    /// each way) and returns the largest over ranks: the compute on the step's critical path,
    /// which runs through the busiest rank (a collective of the rank threads).
    fn busiest(&self, rank: usize, mine: [f64; 2]) -> [f64; 2] {
        self.compute.lock().expect("exchange")[rank] = mine;
        self.barrier.wait();
        let most = self
            .compute
            .lock()
            .expect("exchange")
            .iter()
            .fold([0.0f64; 2], |acc, c| [acc[0].max(c[0]), acc[1].max(c[1])]);
        self.barrier.wait();
        most
    }

    /// Publishes `mine` (experts chosen by this rank's tokens) and returns the union over
    /// all ranks (a collective of the rank threads).
    fn union(&self, rank: usize, mine: Vec<bool>) -> Vec<bool> {
        self.used.lock().expect("exchange")[rank] = mine;
        self.barrier.wait();
        let all = self
            .used
            .lock()
            .expect("exchange")
            .iter()
            .fold(vec![false; E], |acc, u| {
                acc.iter().zip(u).map(|(a, b)| *a || *b).collect()
            });
        self.barrier.wait();
        all
    }
}

#[allow(clippy::too_many_arguments)]
fn bench_tokens(
    layer: &MoeLayer,
    dev: &Device,
    t: usize,
    iters: usize,
    copy_gbs: f64,
    dense: &(Tensor, Tensor),
    exchange: &Exchange,
) -> Result<Row, BoxError> {
    let stream = stream_of(dev);
    let x = randn_bf16(dev, &[t, H], 1.0)?;
    let mode = if t <= LL_MAX {
        Mode::LowLatency
    } else {
        Mode::Normal
    };
    let fp8 = layer.experts().is_fp8();
    let mut row = Row {
        tokens: t,
        mode: match (mode == Mode::LowLatency, fp8) {
            (true, false) => "low-latency",
            (true, true) => "low-latency, fp8 experts",
            (false, false) => "normal",
            (false, true) => "normal, fp8 experts",
        },
        fp8_dispatch: layer.options().fp8_dispatch,
        ..Default::default()
    };
    row.step.layer_ms = time_ms(&stream, iters, &mut || {
        layer.forward_with_mode(&x, mode)?;
        Ok(())
    })?;
    // Decode steps, and prefill steps with worst-case dispatch outputs (no host read), also
    // as captured graphs.
    let graph = if mode == Mode::LowLatency {
        Some(layer.capture_decode(t, DType::BF16)?)
    } else if layer.options().normal_max_tokens_per_rank.is_some() {
        Some(layer.capture_prefill(t, DType::BF16)?)
    } else {
        None
    };
    // Normal steps also back to back, as a model's layers run (`time_b2b_ms`).
    let mut b2b = (mode == Mode::Normal).then(StepTimes::default);
    if let Some(b) = b2b.as_mut() {
        b.layer_ms = time_b2b_ms(&stream, iters, &mut || {
            layer.forward_with_mode(&x, mode)?;
            Ok(())
        })?;
    }
    if let Some(g) = graph {
        g.input().slice_set(&x, 0, 0)?;
        let mut replay = || -> Result<(), BoxError> {
            g.replay_in_place()?;
            Ok(())
        };
        row.step.graph_ms = Some(time_ms(&stream, iters, &mut replay)?);
        if let Some(b) = b2b.as_mut() {
            b.graph_ms = Some(time_b2b_ms(&stream, iters, &mut replay)?);
        }
    }
    // The split, each part alone on the same inputs (decode parts as captured graphs, so that
    // they show GPU time, not the host's launch overhead; prefill parts eagerly).
    let routing = layer.router().forward(&x)?;
    let (idx, w) = (&routing.topk_idx, &routing.topk_weights);
    let buf = layer.buffer();
    let shared = layer.shared().ok_or("no shared expert")?;
    let part = |f: &mut dyn FnMut() -> Result<(), BoxError>| -> Result<f64, BoxError> {
        if mode == Mode::LowLatency {
            graph_ms(dev, iters, f)
        } else {
            time_ms(&stream, iters, f)
        }
    };
    let mut route = || -> Result<(), BoxError> {
        layer.router().forward(&x)?;
        Ok(())
    };
    row.step.router_ms = part(&mut route)?;
    let mut run_shared = || -> Result<(), BoxError> {
        shared.forward(&x)?;
        Ok(())
    };
    if let Some(b) = b2b.as_mut() {
        b.router_ms = time_b2b_ms(&stream, iters, &mut route)?;
        b.shared_ms = time_b2b_ms(&stream, iters, &mut run_shared)?;
    }
    // With the shared expert inside the low-latency grouped GEMMs, its time is in "GEMMs".
    row.step.shared_ms = if mode == Mode::LowLatency && layer.shared_in_grouped_gemm(t) {
        0.0
    } else {
        part(&mut run_shared)?
    };
    if mode == Mode::LowLatency {
        // As the layer dispatches and combines (per rank: the weights travel with the tokens).
        let red = layer.options().low_latency_reduction;
        let mut args = LowLatencyDispatchArgs::new(&x, idx, LL_MAX, E);
        if red == Reduction::PerRank {
            args = args.weights(w);
        }
        if layer.options().fp8_dispatch {
            args = args.fp8(false);
        }
        row.dispatch_ms = part(&mut || {
            buf.low_latency_dispatch(&args)?;
            Ok(())
        })?;
        let out = buf.low_latency_dispatch(&args)?;
        row.step.gemm_ms = part(&mut || {
            layer.low_latency_experts(&out, &x)?;
            Ok(())
        })?;
        let (y, _) = layer.low_latency_experts(&out, &x)?;
        row.combine_ms = part(&mut || {
            buf.low_latency_combine(
                &LowLatencyCombineArgs::new(&y, idx, w, &out.handle).reduction(red),
            )?;
            Ok(())
        })?;
    } else if buf.topology().num_ranks == 1 {
        // The layer runs the routed experts on its tokens as they are (`MoeLayer`'s one-rank
        // normal mode): no layout, dispatch or combine.
        let mut run_experts = || -> Result<(), BoxError> {
            layer.experts().forward_grouped(&x, idx, w)?;
            Ok(())
        };
        row.step.gemm_ms = part(&mut run_experts)?;
        if let Some(b) = b2b.as_mut() {
            b.gemm_ms = time_b2b_ms(&stream, iters, &mut run_experts)?;
        }
    } else {
        // As the layer sends: bf16 rows, or fp8 rows and scales cast on the compute stream
        // (counted in the dispatch) and cast back before the GEMMs (counted in them).
        let send = |x: &Tensor| -> Result<(Tensor, Option<Tensor>), BoxError> {
            Ok(if layer.options().fp8_dispatch {
                let (q, s) = per_token_cast_to_fp8(x, false)?;
                (q, Some(s))
            } else {
                (x.clone(), None)
            })
        };
        let dispatch = |x: &Tensor| -> Result<_, BoxError> {
            let layout = buf.get_dispatch_layout(idx, E)?;
            let (q, s) = send(x)?;
            let mut args = DispatchArgs::new(&q).topk(idx, w).layout(&layout);
            if let Some(s) = &s {
                args = args.x_scales(s);
            }
            Ok(buf.dispatch(&args)?)
        };
        row.dispatch_ms = part(&mut || {
            dispatch(&x)?;
            Ok(())
        })?;
        // The dispatch on the communication stream after an event, the shared expert on the
        // compute stream, which then waits for the dispatch: what overlapping leaves of the two.
        let beside = |shared_first: bool, sms: u32| -> Result<(), BoxError> {
            let layout = buf.get_dispatch_layout(idx, E)?;
            let (q, s) = send(&x)?;
            let ready = EventOverlap::record(dev)?;
            let run_shared = || -> Result<(), BoxError> {
                with_sm_count_target(&dev.as_cuda_device()?.cublas_handle(), sms, || {
                    shared.forward(&x)
                })??;
                Ok(())
            };
            if shared_first {
                run_shared()?;
            }
            let mut args = DispatchArgs::new(&q)
                .topk(idx, w)
                .layout(&layout)
                .previous_event(&ready)
                .async_finish(true);
            if let Some(s) = &s {
                args = args.x_scales(s);
            }
            let out = buf.dispatch(&args)?;
            if !shared_first {
                run_shared()?;
            }
            out.event.compute_wait(dev)?;
            Ok(())
        };
        let left = sms_left(stream.context(), buf.config().config.num_sms)?;
        row.overlap_ms = Some([
            part(&mut || beside(false, 0))?,
            part(&mut || beside(true, 0))?,
            part(&mut || beside(true, left))?,
        ]);
        let out = dispatch(&x)?;
        let layout = buf.get_dispatch_layout(idx, E)?;
        let (q, s) = send(&x)?;
        let with_layout = || {
            let args = DispatchArgs::new(&q).topk(idx, w).layout(&layout);
            match &s {
                Some(s) => args.x_scales(s),
                None => args,
            }
        };
        let cached = || {
            let args = DispatchArgs::new(&q).cached(&out.handle);
            match &s {
                Some(s) => args.x_scales(s),
                None => args,
            }
        };
        row.dispatch_split = Some((
            [
                part(&mut || {
                    buf.dispatch(&with_layout())?;
                    Ok(())
                })?,
                part(&mut || {
                    buf.dispatch(&cached())?;
                    Ok(())
                })?,
                part(&mut || {
                    let worst = with_layout().num_worst_tokens(buf.topology().num_ranks * t);
                    buf.dispatch(&worst)?;
                    Ok(())
                })?,
            ],
            out.recv_x.dims()[0],
        ));
        let (ri, rw) = (
            out.recv_topk_idx.as_ref().ok_or("no routing")?,
            out.recv_topk_weights.as_ref().ok_or("no weights")?,
        );
        let experts = || -> Result<Tensor, BoxError> {
            let rx = match &out.recv_x_scales {
                Some(s) => per_token_cast_back(&out.recv_x, s, DType::BF16)?,
                None => out.recv_x.clone(),
            };
            // As the layer runs them: with the per-tile grid sized by the counts the dispatch
            // reported.
            Ok(if layer.normal_gemm_grid() == GemmGrid::PerTile {
                layer.experts().forward_grouped_counted(
                    &rx,
                    ri,
                    rw,
                    &out.num_recv_tokens_per_expert,
                )?
            } else {
                layer.experts().forward_grouped(&rx, ri, rw)?
            })
        };
        let mut run_experts = || -> Result<(), BoxError> {
            experts()?;
            Ok(())
        };
        row.step.gemm_ms = part(&mut run_experts)?;
        if let Some(b) = b2b.as_mut() {
            b.gemm_ms = time_b2b_ms(&stream, iters, &mut run_experts)?;
        }
        let y = experts()?;
        row.combine_ms = part(&mut || {
            buf.combine(&CombineArgs::new(&y, &out.handle))?;
            Ok(())
        })?;
    }
    row.b2b = b2b;
    let [busiest, busiest_b2b] = exchange.busiest(
        buf.topology().rank,
        [
            row.step.router_ms + row.step.gemm_ms + row.step.shared_ms,
            b2b.map_or(0.0, |b| b.router_ms + b.gemm_ms + b.shared_ms),
        ],
    );
    row.step.busiest_compute_ms = busiest;
    if let Some(b) = row.b2b.as_mut() {
        b.busiest_compute_ms = busiest_b2b;
    }
    // Floors: bytes over the copy bandwidth, and dense cuBLAS on the same FLOPs.
    let chosen: Vec<i64> = idx.flatten_all()?.to_vec1()?;
    let mut used = vec![false; E];
    for &e in &chosen {
        used[e as usize] = true;
    }
    // This rank's experts that any rank's tokens chose.
    let topo = buf.topology();
    let l = E / topo.num_ranks;
    let used = exchange.union(topo.rank, used);
    let experts_read = used[topo.rank * l..(topo.rank + 1) * l]
        .iter()
        .filter(|&&u| u)
        .count() as f64;
    let shared_bytes = (3 * H * I * 2) as f64;
    let per_expert = (3 * H * I * if fp8 { 1 } else { 2 }) as f64;
    let bytes = experts_read * per_expert + shared_bytes + (E * H * 4) as f64;
    row.floor_gb = bytes / 1e9;
    row.floor_ms = bytes / (copy_gbs * 1e9) * 1e3;
    let xr = randn_bf16(dev, &[t * K, H], 1.0)?;
    let (w1t, w2t) = dense;
    row.dense_ms = time_ms(&stream, iters, &mut || {
        let h = xr.matmul(w1t)?;
        let act = (h.narrow(D::Minus1, 0, I)?.silu()? * h.narrow(D::Minus1, I, I)?)?;
        act.matmul(w2t)?;
        let si = shared.intermediate_size();
        let hs = x.matmul(&shared.gate_up().t()?)?;
        let act = (hs.narrow(D::Minus1, 0, si)?.silu()? * hs.narrow(D::Minus1, si, si)?)?;
        act.matmul(&shared.down_proj().t()?)?;
        Ok(())
    })?;
    Ok(row)
}

fn run_rank(
    rank: usize,
    world: usize,
    transport: LocalTransport,
    tokens: &[usize],
    iters: usize,
    exchange: &Exchange,
) -> Result<Vec<Row>, BoxError> {
    let dev = Device::new_cuda(rank)?;
    let stream = stream_of(&dev);
    if std::env::var("EP_BENCH_NO_EVENT_TRACKING").as_deref() == Ok("1") {
        // SAFETY: nothing has been allocated on this context yet. Without cudarc's per-slice
        // events a slice freed on one stream while another still uses it could be reused too
        // early; the layer orders its streams with its own events (the compute stream waits
        // for every transfer before a later step), which this measurement relies on.
        unsafe { stream.context().disable_event_tracking() };
    }
    let mut bcfg = BufferConfig::default().with_low_latency(LL_MAX, H, E);
    if let Some(sms) = std::env::var("EP_BENCH_SMS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        bcfg.config.num_sms = sms;
    }
    match std::env::var("EP_BENCH_NVL").as_deref() {
        Ok("rings") => bcfg = bcfg.with_nvl_transfer(NvlTransfer::SmRings),
        Ok("copy-engine") => bcfg = bcfg.with_nvl_transfer(NvlTransfer::CopyEngine),
        Ok(v) => return Err(format!("EP_BENCH_NVL={v}: rings or copy-engine").into()),
        Err(_) => {}
    }
    let buffer = Arc::new(Buffer::new(
        Arc::new(transport),
        Topology::new(rank, world, world)?,
        bcfg,
        &dev,
    )?);
    // Copy bandwidth (read + write bytes).
    let bytes = 2usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    let copy_ms = time_ms(&stream, iters, &mut || {
        stream.memcpy_dtod(&src, &mut dst)?;
        Ok(())
    })?;
    drop((src, dst));
    let copy_gbs = 2.0 * bytes as f64 / (copy_ms * 1e-3) / 1e9;
    let mut layers = Vec::new();
    let which = std::env::var("EP_BENCH_EXPERTS").unwrap_or_else(|_| "bf16".into());
    if which != "bf16" && which != "fp8" && which != "both" {
        return Err(format!("EP_BENCH_EXPERTS={which}: bf16, fp8 or both").into());
    }
    if which != "fp8" {
        layers.push(build_layer(&dev, buffer.clone(), bench_options(false))?);
    }
    if which != "bf16" {
        layers.push(build_layer_fp8(&dev, buffer, bench_options(true))?);
    }
    // The dense anchor: one expert's bf16 weights.
    let dense = (
        randn_bf16(&dev, &[2 * I, H], 0.02)?.t()?,
        randn_bf16(&dev, &[H, I], 0.02)?.t()?,
    );
    let mut rows = Vec::new();
    for &t in tokens {
        for layer in &layers {
            let row = bench_tokens(layer, &dev, t, iters, copy_gbs, &dense, exchange)?;
            if rank == 0 {
                println!(
                    "T={t} {}: layer {:.3} ms{} (floor {:.3} ms, dense {:.3} ms)",
                    row.mode,
                    row.step.layer_ms,
                    row.step
                        .graph_ms
                        .map_or(String::new(), |g| format!(", graph {g:.3} ms")),
                    row.floor_ms,
                    row.dense_ms
                );
            }
            rows.push(row);
        }
    }
    if rank == 0 {
        println!("copy bandwidth {copy_gbs:.0} GB/s");
    }
    Ok(rows)
}

fn main() -> Result<(), BoxError> {
    let iters: usize = std::env::var("EP_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let world: usize = std::env::var("EP_BENCH_RANKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let tokens: Vec<usize> = std::env::var("EP_BENCH_TOKENS")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 8, 32, 128, 512, 1024, 2048, 4096, 8192]);
    let transports = LocalTransport::group(world);
    let exchange = Exchange::new(world);
    let results: Vec<Result<Vec<Row>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let (tokens, exchange) = (&tokens, &exchange);
                s.spawn(move || {
                    run_rank(rank, world, t, tokens, iters, exchange).map_err(|e| e.to_string())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    });
    let mut rows = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) if rank == 0 => rows = Some(v),
            Ok(_) => {}
            Err(e) => return Err(format!("rank {rank}: {e}").into()),
        }
    }
    let rows = rows.ok_or("rank 0 reported nothing")?;
    moe_layer_report::report(&rows, world, iters)
}

/// Whether a layer sends fp8 rows (`MoeLayerOptions::fp8_dispatch`): `EP_BENCH_FP8=1|0` for
/// every layer, else the fp8-experts layer only.
fn fp8_dispatch(fp8_experts: bool) -> bool {
    match std::env::var("EP_BENCH_FP8").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => fp8_experts,
    }
}

/// `EP_BENCH_EXPERT_GROUPS` (default 1: no pipeline).
fn expert_groups() -> usize {
    std::env::var("EP_BENCH_EXPERT_GROUPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}
