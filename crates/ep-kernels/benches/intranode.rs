//! Intranode (NVLink) dispatch / combine benchmark in DeepEP's configuration: 4096 tokens per
//! rank, hidden 7168, top-8 of 256 experts (random scores, top-k), on all visible GPUs (2 or 4;
//! `EP_BENCH_RANKS` overrides). Reports bf16 and fp8 dispatch and bf16 combine, timed with CUDA
//! events per iteration (median across iterations and ranks), and GB/s counted as DeepEP
//! does: bytes of all received rows (local ones included) over time; fp8 bytes = bf16 bytes x
//! (1 + 4/128) / 2. Sweeps SM counts and chunk sizes. Every timed iteration starts with the
//! L2 cache flushed (a 256 MiB write queued before the start event) after warm-up iterations.
//!
//! With the `nccl` feature, two NCCL baselines of the bf16 dispatch, counted the same way:
//! - "rows only": a grouped send/recv all-to-all of exactly the dispatched rows, already packed
//!   (a lower bound for any NCCL dispatch);
//! - "full dispatch": what a user writes with NCCL: layout kernel -> all-gather of the per-rank
//!   counts -> host synchronisation (receive sizes) -> index list and row gather into a packed
//!   send buffer -> grouped send/recv of the rows; timed end to end (CUDA events and host time).
//!
//! Both transfer paths are measured: SM rings (`dispatch_cuda` / `combine_cuda`, swept over
//! SMs, chunks and ring sizes) and the copy-engine path (`ce_dispatch_cuda` /
//! `ce_combine_cuda`, swept over SMs and chunk sizes; `chunk` = first chunk rows, `ring` =
//! largest chunk rows in its rows). `EP_BENCH_PATH=ring|ce` limits the run to one of them.
//! `EP_BENCH_CE_SPLITS="ce:sms:blocks:push,..."` (e.g. `1:22:2:1`) and
//! `EP_BENCH_CE_CHUNKS="first:largest,..."` replace the copy-engine sweep's lists.
//!
//! Writes JSON to `$EP_BENCH_OUT` if set. `EP_BENCH_QUICK=1` runs a short sweep.
//! Run (GPU machine): `bench_intranode` (built by `scripts/gpu/package.sh`), or here
//! `cargo bench -p ep-kernels --features nccl --bench bench_intranode`.

mod common;

use std::fmt::Write as _;
use std::sync::Arc;

use common::{flush_l2, l2_flush_buffer, BoxError, Node};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut};
use ep_kernels::intranode::{
    buffer_size_hint, cached_notify_cuda, ce_buffer_size_hint, ce_combine_cuda, ce_dispatch_cuda,
    combine_cuda, dispatch_cuda, notify_dispatch_cuda, CeCombineArgs, CeConfig, CeDispatchArgs,
    CombineArgs, Config, CopyStreams, DispatchArgs, HostMappedI32, NotifyArgs, Payload,
    RecvPayload, RecvTopK, TopK, COMBINE_ROUND_TOKENS,
};
use ep_kernels::layout::{get_dispatch_layout, ExpertPlacement};
use ep_kernels::FP8_GROUP;
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

const TOKENS: usize = 4096;
const HIDDEN: usize = 7168;
const TOPK: usize = 8;
const EXPERTS: usize = 256;

/// One rank's device state for the benchmark.
struct RankState {
    x: CudaSlice<bf16>,
    x_fp8: CudaSlice<F8E4M3>,
    scales: CudaSlice<f32>,
    topk_idx: CudaSlice<i64>,
    topk_w: CudaSlice<f32>,
    in_rank: CudaSlice<u8>,
    per_rank: CudaSlice<i32>,
    per_expert: CudaSlice<i32>,
    num_recv: usize,
    recv_x: CudaSlice<bf16>,
    recv_fp8: CudaSlice<F8E4M3>,
    recv_scales: CudaSlice<f32>,
    recv_src: CudaSlice<i32>,
    recv_topk_idx: CudaSlice<i64>,
    recv_topk_w: CudaSlice<f32>,
    combined: CudaSlice<bf16>,
    /// Scratch overwritten before every timed iteration to flush the L2 cache.
    flush: CudaSlice<u8>,
    /// Tokens this rank sends to each rank (NCCL baseline).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    send_counts: Vec<usize>,
    /// Tokens each rank sends to this one (NCCL baseline).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    recv_counts: Vec<usize>,
}

/// The per-config handle (depends on the channel count).
struct Handle {
    rank_prefix: CudaSlice<i32>,
    channel_prefix: CudaSlice<i32>,
    channel_offset: CudaSlice<i32>,
    send_head: CudaSlice<i32>,
    /// Copy-engine path: notify's `send_index` and the rows from each source.
    send_index: CudaSlice<i32>,
    per_source: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    DispatchBf16,
    DispatchFp8,
    Combine,
    CeDispatchBf16,
    CeDispatchFp8,
    CeCombine,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::DispatchBf16 => "dispatch-bf16",
            Op::DispatchFp8 => "dispatch-fp8",
            Op::Combine => "combine-bf16",
            Op::CeDispatchBf16 => "ce-dispatch-bf16",
            Op::CeDispatchFp8 => "ce-dispatch-fp8",
            Op::CeCombine => "ce-combine-bf16",
        }
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// `$name` as comma-separated tuples of `:`-separated numbers, each of `arity` numbers; `None`
/// when unset, an error naming the variable when malformed.
fn env_tuples(name: &str, arity: usize) -> Result<Option<Vec<Vec<usize>>>, BoxError> {
    let Ok(v) = std::env::var(name) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for item in v.split(',').filter(|s| !s.is_empty()) {
        let nums = item
            .split(':')
            .map(|x| x.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{name}: {item:?}: {e}"))?;
        if nums.len() != arity {
            return Err(format!("{name}: {item:?} needs {arity} numbers separated by ':'").into());
        }
        out.push(nums);
    }
    Ok(Some(out))
}

fn median(v: &mut [f32]) -> f32 {
    v.sort_by(f32::total_cmp);
    if v.is_empty() {
        f32::NAN
    } else {
        v[v.len() / 2]
    }
}

fn setup(node: &Node, rng: &mut StdRng) -> Result<Vec<RankState>, BoxError> {
    let r = node.num_ranks();
    let placement = ExpertPlacement::new(EXPERTS, r, r)?;
    let mut layouts = Vec::new();
    let mut topks = Vec::new();
    for _ in 0..r {
        // Random scores then top-k == K distinct experts uniformly at random.
        let mut topk = Vec::with_capacity(TOKENS * TOPK);
        for _ in 0..TOKENS {
            topk.extend(sample(rng, EXPERTS, TOPK).into_iter().map(|e| e as i64));
        }
        layouts.push(get_dispatch_layout(&topk, TOKENS, TOPK, &placement)?);
        topks.push(topk);
    }
    let mut states = Vec::new();
    for (rank, stream) in node.streams.iter().enumerate() {
        let l = &layouts[rank];
        let recv_counts: Vec<usize> = (0..r)
            .map(|s| layouts[s].num_tokens_per_rank[rank] as usize)
            .collect();
        let n: usize = recv_counts.iter().sum();
        let x: Vec<bf16> = (0..TOKENS * HIDDEN)
            .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
            .collect();
        let xq: Vec<F8E4M3> = (0..TOKENS * HIDDEN)
            .map(|_| F8E4M3::from_bits(rng.random::<u8>() & 0x7e))
            .collect();
        let w: Vec<f32> = (0..TOKENS * TOPK).map(|_| rng.random()).collect();
        states.push(RankState {
            x: stream.clone_htod(&x)?,
            x_fp8: stream.clone_htod(&xq)?,
            scales: stream.clone_htod(&vec![1.0f32; TOKENS * HIDDEN / FP8_GROUP])?,
            topk_idx: stream.clone_htod(&topks[rank])?,
            topk_w: stream.clone_htod(&w)?,
            in_rank: stream.clone_htod(
                &l.is_token_in_rank
                    .iter()
                    .map(|&b| b as u8)
                    .collect::<Vec<_>>(),
            )?,
            per_rank: stream.clone_htod(&l.num_tokens_per_rank)?,
            per_expert: stream.clone_htod(&l.num_tokens_per_expert)?,
            num_recv: n,
            recv_x: stream.alloc_zeros(n * HIDDEN)?,
            recv_fp8: stream.alloc_zeros(n * HIDDEN)?,
            recv_scales: stream.alloc_zeros(n * HIDDEN / FP8_GROUP)?,
            recv_src: stream.alloc_zeros(n)?,
            recv_topk_idx: stream.alloc_zeros(n * TOPK)?,
            recv_topk_w: stream.alloc_zeros(n * TOPK)?,
            combined: stream.alloc_zeros(TOKENS * HIDDEN)?,
            flush: l2_flush_buffer(stream)?,
            send_counts: l.num_tokens_per_rank.iter().map(|&v| v as usize).collect(),
            recv_counts,
        });
    }
    for s in &node.streams {
        s.synchronize()?;
    }
    Ok(states)
}

/// Runs notify for `channels` channels on every rank and returns the handles.
fn notify_all(node: &Node, states: &[RankState], config: &Config) -> Result<Vec<Handle>, BoxError> {
    let r = node.num_ranks();
    let c = config.num_channels();
    let counters: Vec<(HostMappedI32, HostMappedI32)> = (0..r)
        .map(|i| {
            Ok((
                HostMappedI32::new(&node.ctxs[i], 1 + r, -1)?,
                HostMappedI32::new(&node.ctxs[i], EXPERTS / r, -1)?,
            ))
        })
        .collect::<Result<_, ep_kernels::Error>>()?;
    let handles = node.per_rank(|rank| {
        let stream = &node.streams[rank];
        let st = &states[rank];
        let mut h = Handle {
            rank_prefix: stream.alloc_zeros(r * r)?,
            channel_prefix: stream.alloc_zeros(r * c)?,
            channel_offset: stream.alloc_zeros(r * c)?,
            send_head: stream.alloc_zeros(TOKENS * r)?,
            send_index: stream.alloc_zeros(TOKENS * r)?,
            per_source: Vec::new(),
        };
        notify_dispatch_cuda(
            stream,
            &node.peers[rank],
            config,
            NotifyArgs {
                num_tokens_per_rank: st.per_rank.as_view(),
                num_tokens_per_expert: st.per_expert.as_view(),
                is_token_in_rank: st.in_rank.as_view(),
                num_tokens: TOKENS,
                num_experts: EXPERTS,
                expert_alignment: 1,
                rank_prefix_matrix: h.rank_prefix.as_view_mut(),
                channel_prefix_matrix: h.channel_prefix.as_view_mut(),
                moe_recv_counter: &counters[rank].0,
                moe_recv_expert_counter: &counters[rank].1,
                send_index: Some(h.send_index.as_view_mut()),
            },
        )?;
        let n = counters[rank]
            .0
            .poll_nonneg(0, std::time::Duration::from_secs(30), rank)? as usize;
        h.per_source = (0..r)
            .map(|s| counters[rank].0.get(1 + s) as usize)
            .collect();
        if n != st.num_recv {
            return Err(format!(
                "rank {rank}: notify says {n} tokens, host layout {}",
                st.num_recv
            )
            .into());
        }
        stream.synchronize()?;
        Ok(h)
    })?;
    node.sync_and_check()?;
    Ok(handles)
}

/// The views of one rank's state that both dispatch paths send and fill.
struct DispatchViews<'a> {
    x: Payload<'a>,
    topk: TopK<'a>,
    /// `[T, R]` routing bytes (the ring path's `is_token_in_rank`; the copy-engine path uses
    /// notify's `send_index` instead).
    in_rank: CudaView<'a, u8>,
    recv_x: RecvPayload<'a>,
    recv_src_idx: CudaViewMut<'a, i32>,
    recv_topk: RecvTopK<'a>,
}

/// Builds the payload (bf16, or fp8 with its scales), routing and receive views of `st` for a
/// dispatch of all its tokens into its `num_recv` receive rows.
fn dispatch_views(st: &mut RankState, fp8: bool) -> DispatchViews<'_> {
    let n = st.num_recv;
    let (x, recv_x) = if fp8 {
        (
            Payload::Fp8 {
                x: st.x_fp8.as_view(),
                scales: st.scales.as_view(),
            },
            RecvPayload::Fp8 {
                x: st.recv_fp8.slice_mut(0..n * HIDDEN),
                scales: st.recv_scales.slice_mut(0..n * HIDDEN / FP8_GROUP),
            },
        )
    } else {
        (
            Payload::Bf16(st.x.as_view()),
            RecvPayload::Bf16(st.recv_x.slice_mut(0..n * HIDDEN)),
        )
    };
    DispatchViews {
        x,
        topk: TopK {
            idx: st.topk_idx.as_view(),
            weights: st.topk_w.as_view(),
        },
        in_rank: st.in_rank.as_view(),
        recv_x,
        recv_src_idx: st.recv_src.slice_mut(0..n),
        recv_topk: RecvTopK {
            idx: st.recv_topk_idx.slice_mut(0..n * TOPK),
            weights: st.recv_topk_w.slice_mut(0..n * TOPK),
        },
    }
}

fn launch_dispatch(
    node: &Node,
    rank: usize,
    st: &mut RankState,
    h: &mut Handle,
    config: &Config,
    fp8: bool,
) -> Result<(), BoxError> {
    let stream = &node.streams[rank];
    let n = st.num_recv;
    let v = dispatch_views(st, fp8);
    dispatch_cuda(
        stream,
        &node.peers[rank],
        config,
        DispatchArgs {
            x: v.x,
            topk: Some(v.topk),
            num_experts: EXPERTS,
            is_token_in_rank: v.in_rank,
            rank_prefix_matrix: h.rank_prefix.as_view(),
            channel_prefix_matrix: h.channel_prefix.as_view(),
            recv_x: v.recv_x,
            recv_src_idx: v.recv_src_idx,
            recv_topk: Some(v.recv_topk),
            recv_channel_offset: h.channel_offset.as_view_mut(),
            send_head: h.send_head.as_view_mut(),
            num_recv_tokens: n,
            hidden: HIDDEN,
            num_topk: TOPK,
        },
    )?;
    Ok(())
}

fn launch_combine(
    node: &Node,
    rank: usize,
    st: &mut RankState,
    h: &Handle,
    config: &Config,
) -> Result<(), BoxError> {
    let stream = &node.streams[rank];
    let n = st.num_recv;
    combine_cuda(
        stream,
        &node.peers[rank],
        config,
        CombineArgs {
            x: st.recv_x.slice(0..n * HIDDEN),
            topk_weights: None,
            rank_prefix_matrix: h.rank_prefix.as_view(),
            recv_channel_offset: h.channel_offset.as_view(),
            send_head: h.send_head.as_view(),
            combined_x: st.combined.as_view_mut(),
            combined_topk_weights: None,
            num_recv_tokens: n,
            hidden: HIDDEN,
            num_topk: 0,
        },
    )?;
    Ok(())
}

fn launch_ce_dispatch(
    node: &Node,
    rank: usize,
    st: &mut RankState,
    h: &Handle,
    copies: &CopyStreams,
    ce: &CeConfig,
    fp8: bool,
) -> Result<(), BoxError> {
    let stream = &node.streams[rank];
    let v = dispatch_views(st, fp8);
    ce_dispatch_cuda(
        stream,
        copies,
        &node.peers[rank],
        ce,
        CeDispatchArgs {
            x: v.x,
            topk: Some(v.topk),
            num_experts: EXPERTS,
            send_index: h.send_index.as_view(),
            rank_prefix_matrix: h.rank_prefix.as_view(),
            recv_per_source: &h.per_source,
            recv_x: v.recv_x,
            recv_src_idx: v.recv_src_idx,
            recv_topk: Some(v.recv_topk),
            hidden: HIDDEN,
            num_topk: TOPK,
        },
    )?;
    Ok(())
}

fn launch_ce_combine(
    node: &Node,
    rank: usize,
    st: &mut RankState,
    h: &Handle,
    copies: &CopyStreams,
    ce: &CeConfig,
) -> Result<(), BoxError> {
    let stream = &node.streams[rank];
    let n = st.num_recv;
    ce_combine_cuda(
        stream,
        copies,
        &node.peers[rank],
        ce,
        CeCombineArgs {
            x: st.recv_x.slice(0..n * HIDDEN),
            topk_weights: None,
            rank_prefix_matrix: h.rank_prefix.as_view(),
            send_index: h.send_index.as_view(),
            recv_per_source: &h.per_source,
            combined_x: st.combined.as_view_mut(),
            combined_topk_weights: None,
            hidden: HIDDEN,
            num_topk: 0,
        },
    )?;
    Ok(())
}

fn event(stream: &Arc<CudaStream>) -> Result<CudaEvent, BoxError> {
    Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Times `op` with `config` (a dispatch is run first for combine, to fill the handle).
/// Returns per-rank median milliseconds.
#[allow(clippy::too_many_arguments)]
fn time_op(
    node: &Node,
    states: &mut [RankState],
    handles: &mut [Handle],
    op: Op,
    config: &Config,
    dispatch_config: &Config,
    ce: (&[CopyStreams], &CeConfig),
    warmup: usize,
    iters: usize,
) -> Result<Vec<f32>, BoxError> {
    let (copies, ce) = ce;
    let states_ptr: Vec<std::sync::Mutex<(&mut RankState, &mut Handle)>> = states
        .iter_mut()
        .zip(handles.iter_mut())
        .map(std::sync::Mutex::new)
        .collect();
    let times = node.per_rank(|rank| {
        let mut guard = states_ptr[rank].lock().map_err(|_| "poisoned")?;
        let (st, h) = &mut *guard;
        let stream = &node.streams[rank];
        if op == Op::Combine {
            cached_notify_cuda(stream, &node.peers[rank])?;
            launch_dispatch(node, rank, st, h, dispatch_config, false)?;
        }
        if op == Op::CeCombine {
            cached_notify_cuda(stream, &node.peers[rank])?;
            launch_ce_dispatch(node, rank, st, h, &copies[rank], ce, false)?;
        }
        let mut evs = Vec::new();
        for i in 0..warmup + iters {
            // Untimed: flush L2, then the cached notify (its barrier also lines the ranks up).
            flush_l2(stream, &mut st.flush)?;
            cached_notify_cuda(stream, &node.peers[rank])?;
            let e0 = event(stream)?;
            match op {
                Op::DispatchBf16 => launch_dispatch(node, rank, st, h, config, false)?,
                Op::DispatchFp8 => launch_dispatch(node, rank, st, h, config, true)?,
                Op::Combine => launch_combine(node, rank, st, h, config)?,
                Op::CeDispatchBf16 => {
                    launch_ce_dispatch(node, rank, st, h, &copies[rank], ce, false)?
                }
                Op::CeDispatchFp8 => {
                    launch_ce_dispatch(node, rank, st, h, &copies[rank], ce, true)?
                }
                Op::CeCombine => launch_ce_combine(node, rank, st, h, &copies[rank], ce)?,
            }
            let e1 = event(stream)?;
            if i >= warmup {
                evs.push((e0, e1));
            }
        }
        stream.synchronize()?;
        let mut ms: Vec<f32> = evs
            .iter()
            .map(|(a, b)| a.elapsed_ms(b))
            .collect::<Result<_, _>>()?;
        Ok(median(&mut ms))
    })?;
    node.sync_and_check()?;
    Ok(times)
}

/// Turns per-rank median milliseconds into a row (and prints it).
fn make_row(
    op: Op,
    num_sms: usize,
    chunk: usize,
    ring: usize,
    ms: &[f32],
    states: &[RankState],
    split: String,
) -> Row {
    let per_rank: Vec<f32> = ms
        .iter()
        .zip(states)
        .map(|(&t, s)| (bytes(op, s.num_recv) / 1e9 / (t as f64 / 1e3)) as f32)
        .collect();
    let mut all = ms.to_vec();
    let row = Row {
        op,
        num_sms,
        chunk,
        ring,
        us: median(&mut all) * 1e3,
        gbps: per_rank.iter().sum::<f32>() / per_rank.len() as f32,
        gbps_min_rank: per_rank.iter().copied().fold(f32::INFINITY, f32::min),
        split,
    };
    println!(
        "{:<16} sms {:>3} chunk {:>4} ring {:>4}: {:>8.1} us  {:>7.1} GB/s (NVL, mean of ranks; min {:.1}) {}",
        op.name(), num_sms, chunk, ring, row.us, row.gbps, row.gbps_min_rank, row.split
    );
    row
}

/// One measured configuration.
struct Row {
    op: Op,
    num_sms: usize,
    chunk: usize,
    ring: usize,
    us: f32,
    gbps: f32,
    gbps_min_rank: f32,
    /// Copy-engine path split: "ce<copy-engine peers>+<pack/reduce SMs>+<SM-copy blocks>".
    split: String,
}

/// One NCCL baseline's figures (bf16 dispatch bytes).
#[derive(Debug, Clone, Copy)]
struct Baseline {
    /// Median over ranks of the per-rank median device time (CUDA events), microseconds.
    us: f32,
    /// Mean over ranks of each rank's received bytes over its median time.
    gbps: f32,
    /// Median host wall time per iteration, microseconds (full dispatch: it synchronises).
    host_us: Option<f32>,
    /// Median over ranks of the device time before the rows' all-to-all starts (layout, count
    /// exchange, host sync, packing), microseconds (full dispatch).
    prep_us: Option<f32>,
}

impl Baseline {
    fn json(b: Option<Self>) -> String {
        let opt = |v: Option<f32>| v.map_or("null".to_owned(), |v| format!("{v:.2}"));
        match b {
            Some(b) => format!(
                "{{\"time_us\": {:.2}, \"gbps\": {:.2}, \"host_us\": {}, \"prep_us\": {}}}",
                b.us,
                b.gbps,
                opt(b.host_us),
                opt(b.prep_us)
            ),
            None => "null".into(),
        }
    }
}

/// From per-rank lists of per-iteration milliseconds: (median over ranks of the per-rank
/// medians in microseconds, mean over ranks of the per-rank bf16-dispatch GB/s).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
fn summarize(per_rank_ms: &[Vec<f32>], states: &[RankState]) -> (f32, f32) {
    let mut medians: Vec<f32> = per_rank_ms.iter().map(|v| median(&mut v.clone())).collect();
    let gbps: Vec<f32> = medians
        .iter()
        .zip(states)
        .map(|(&m, st)| (bytes(Op::DispatchBf16, st.num_recv) / 1e9 / (m as f64 / 1e3)) as f32)
        .collect();
    let g = gbps.iter().sum::<f32>() / gbps.len().max(1) as f32;
    (median(&mut medians) * 1e3, g)
}

fn bytes(op: Op, n: usize) -> f64 {
    let bf16 = (n * HIDDEN * 2) as f64;
    match op {
        Op::DispatchFp8 | Op::CeDispatchFp8 => bf16 * (1.0 + 4.0 / 128.0) / 2.0,
        _ => bf16,
    }
}

fn main() -> Result<(), BoxError> {
    let gpus = common::device_count();
    let r = env_usize("EP_BENCH_RANKS").unwrap_or(if gpus >= 4 { 4 } else { gpus.min(2) });
    if r < 1 || gpus < r {
        println!("intranode bench: needs {r} GPU(s), found {gpus}; nothing to run");
        return Ok(());
    }
    let quick = std::env::var("EP_BENCH_QUICK").is_ok_and(|v| v == "1");
    let sms: Vec<usize> = if quick {
        vec![24]
    } else {
        vec![16, 20, 24, 32, 48]
    };
    let dispatch_chunks: Vec<usize> = if quick {
        vec![6, 24]
    } else {
        vec![4, 6, 8, 12, 16, 24, 32]
    };
    let combine_chunks: Vec<usize> = if quick {
        vec![9]
    } else {
        vec![4, 6, 9, 12, 16, 24]
    };
    let rings: Vec<usize> = if quick {
        vec![256]
    } else {
        vec![128, 256, 512]
    };
    let max_cfg = Config::new(
        *sms.iter().max().unwrap_or(&48),
        32,
        *rings.iter().max().unwrap_or(&256),
    )?;
    let node = Node::new(
        r,
        buffer_size_hint(HIDDEN, TOPK, r, &max_cfg)
            .max(ce_buffer_size_hint(TOKENS, HIDDEN, TOPK, r)),
    )?;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut states = setup(&node, &mut rng)?;
    let (warmup, iters) = (3, if quick { 10 } else { 20 });
    println!(
        "intranode bench: EP{r}, {TOKENS} tokens/rank, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}; recv tokens per rank {:?}",
        states.iter().map(|s| s.num_recv).collect::<Vec<_>>()
    );
    let path = std::env::var("EP_BENCH_PATH").unwrap_or_default();
    let copies: Vec<CopyStreams> = node
        .ctxs
        .iter()
        .map(|c| CopyStreams::new(c, r))
        .collect::<Result<_, _>>()?;
    let mut rows: Vec<Row> = Vec::new();
    if path != "ring" {
        let notify_cfg = Config::new(24, 1, 1)?;
        let mut handles = notify_all(&node, &states, &notify_cfg)?;
        // (copy-engine peers, pack/reduce SMs, SM-copy blocks, dispatch push): SMs in all = the
        // middle two.
        let splits: Vec<(usize, usize, usize, bool)> = if quick {
            let mut v = vec![
                (1, 16, 8, true),
                (1, 20, 4, true),
                (1, 22, 2, true),
                (1, 12, 12, true),
                (0, 12, 12, true),
                (r - 1, 20, 4, true),
                (1, 24, 16, true),
            ];
            if r > 2 {
                v.extend([
                    (1, 16, 8, false),
                    (1, 12, 12, false),
                    (0, 12, 12, false),
                    (1, 20, 4, false),
                ]);
            }
            v
        } else {
            let mut v = Vec::new();
            for ce_peers in [0, 1, r - 1] {
                for (a, b) in [
                    (8, 8),
                    (12, 12),
                    (16, 8),
                    (20, 4),
                    (22, 2),
                    (24, 8),
                    (32, 16),
                ] {
                    v.push((ce_peers, a, b, true));
                    if r > 2 && ce_peers < r - 1 {
                        v.push((ce_peers, a, b, false));
                    }
                }
            }
            v.dedup();
            v
        };
        let splits = match env_tuples("EP_BENCH_CE_SPLITS", 4)? {
            Some(v) => v.iter().map(|t| (t[0], t[1], t[2], t[3] != 0)).collect(),
            None => splits,
        };
        let ce_chunks: Vec<(usize, usize)> = if let Some(v) = env_tuples("EP_BENCH_CE_CHUNKS", 2)? {
            v.iter().map(|t| (t[0], t[1])).collect()
        } else if quick {
            vec![(256, 1024), (512, 2048), (768, 4096), (1024, 4096)]
        } else {
            vec![(128, 512), (256, 1024), (512, 2048), (1024, 4096)]
        };
        // Dispatch variants to compare, "own_rows_last:copy_lanes:local_copy_out" (`CeConfig`):
        // 1:2:x = own rows last, two copy streams per copy-engine peer, pushed rows copied out by
        // the local copy engines (x = 1) or by SMs (x = 0); 0:1:0 = one pack pass, one stream.
        // Default: `CeConfig::dispatch_for`'s choice for this rank count.
        let variants: Vec<(bool, usize, bool)> = match env_tuples("EP_BENCH_CE_VARIANTS", 3)? {
            Some(v) => v.iter().map(|t| (t[0] != 0, t[1], t[2] != 0)).collect(),
            None => {
                let d = CeConfig::dispatch_for(r, 24);
                vec![(d.own_rows_last, d.copy_lanes, d.local_copy_out)]
            }
        };
        for &(copy_engine_peers, num_sms, sm_blocks, dispatch_push) in &splits {
            for &(first, max) in &ce_chunks {
                for (vi, &(own_rows_last, copy_lanes, local_copy_out)) in
                    variants.iter().enumerate()
                {
                    let ce = CeConfig {
                        num_sms,
                        first_chunk_rows: first,
                        max_chunk_rows: max,
                        copy_engine_peers,
                        sm_blocks,
                        dispatch_push,
                        own_rows_last,
                        copy_lanes,
                        local_copy_out,
                    };
                    // Combine does not depend on the variant: timed once.
                    let ops: &[Op] = if vi == 0 {
                        &[Op::CeDispatchBf16, Op::CeDispatchFp8, Op::CeCombine]
                    } else {
                        &[Op::CeDispatchBf16, Op::CeDispatchFp8]
                    };
                    for &op in ops {
                        let ms = time_op(
                            &node,
                            &mut states,
                            &mut handles,
                            op,
                            &notify_cfg,
                            &notify_cfg,
                            (&copies, &ce),
                            warmup,
                            iters,
                        )?;
                        // Combine launches the SM-copy kernel only when some home is not served by
                        // copy engines; dispatch always does (metadata).
                        let sm_used = op != Op::CeCombine || copy_engine_peers < r - 1;
                        let total = num_sms + if sm_used { sm_blocks } else { 0 };
                        let split = format!(
                            "ce{copy_engine_peers}+{num_sms}+{}{}{}{}{}",
                            if sm_used { sm_blocks } else { 0 },
                            if dispatch_push || op == Op::CeCombine {
                                ""
                            } else {
                                " pull"
                            },
                            if own_rows_last || op == Op::CeCombine {
                                ""
                            } else {
                                " one-pass"
                            },
                            if op == Op::CeCombine {
                                String::new()
                            } else {
                                format!(" lanes{copy_lanes}")
                            },
                            if local_copy_out && op != Op::CeCombine {
                                " ce-out"
                            } else {
                                ""
                            }
                        );
                        let row = make_row(op, total, first, max, &ms, &states, split);
                        rows.push(row);
                    }
                }
            }
        }
    }
    let sms: Vec<usize> = if path == "ce" { Vec::new() } else { sms };
    for &num_sms in &sms {
        let notify_cfg = Config::new(num_sms, 1, 1)?;
        let mut handles = notify_all(&node, &states, &notify_cfg)?;
        for &ring in &rings {
            for op in [Op::DispatchBf16, Op::DispatchFp8, Op::Combine] {
                let chunks = if op == Op::Combine {
                    &combine_chunks
                } else {
                    &dispatch_chunks
                };
                for &chunk in chunks.iter() {
                    if op == Op::Combine && ring < chunk + COMBINE_ROUND_TOKENS || chunk > ring {
                        continue;
                    }
                    let cfg = Config::new(num_sms, chunk, ring)?;
                    let dcfg = Config::new(num_sms, 6.min(ring), ring)?;
                    let ce = CeConfig::default();
                    let ms = time_op(
                        &node,
                        &mut states,
                        &mut handles,
                        op,
                        &cfg,
                        &dcfg,
                        (&copies, &ce),
                        warmup,
                        iters,
                    )?;
                    rows.push(make_row(
                        op,
                        num_sms,
                        chunk,
                        ring,
                        &ms,
                        &states,
                        String::new(),
                    ));
                }
            }
        }
    }
    let (nccl_rows, nccl_full) = nccl_baselines(&node, &mut states, warmup, iters)?;
    // Summary: best per op, and the 24-SM numbers DeepEP reports.
    println!("\n== summary (EP{r}) ==");
    println!(
        "{:<16} {:>5} {:>6} {:>5} {:>10} {:>10}",
        "op", "sms", "chunk", "ring", "time_us", "GB/s"
    );
    for op in [
        Op::DispatchBf16,
        Op::DispatchFp8,
        Op::Combine,
        Op::CeDispatchBf16,
        Op::CeDispatchFp8,
        Op::CeCombine,
    ] {
        if let Some(b) = rows
            .iter()
            .filter(|x| x.op == op)
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "{:<16} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (best) {}",
                op.name(),
                b.num_sms,
                b.chunk,
                b.ring,
                b.us,
                b.gbps,
                b.split
            );
        }
        if let Some(b) = rows
            .iter()
            .filter(|x| x.op == op && x.num_sms <= 24)
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "{:<16} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (best at <= 24 SMs) {}",
                op.name(),
                b.num_sms,
                b.chunk,
                b.ring,
                b.us,
                b.gbps,
                b.split
            );
        }
    }
    if let Some(b) = nccl_rows {
        println!(
            "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (NCCL send/recv of the packed rows only)",
            "nccl-rows-bf16", "-", "-", "-", b.us, b.gbps
        );
    }
    if let Some(b) = nccl_full {
        println!(
            "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (NCCL full dispatch: layout, counts, sync, gather, send/recv; host {:.1} us)",
            "nccl-full-bf16",
            "-",
            "-",
            "-",
            b.us,
            b.gbps,
            b.host_us.unwrap_or(f32::NAN)
        );
        if let Some(best) = rows
            .iter()
            .filter(|x| matches!(x.op, Op::DispatchBf16 | Op::CeDispatchBf16))
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "dispatch-bf16 best vs NCCL full dispatch: {:.2}x the bandwidth",
                best.gbps / b.gbps
            );
        }
    }
    if let Ok(path) = std::env::var("EP_BENCH_OUT") {
        let mut json = String::from("{\n  \"bench\": \"intranode\",\n");
        let _ = writeln!(json, "  \"num_ranks\": {r}, \"tokens\": {TOKENS}, \"hidden\": {HIDDEN}, \"topk\": {TOPK}, \"experts\": {EXPERTS},");
        let _ = writeln!(json, "  \"nccl_rows_only\": {},", Baseline::json(nccl_rows));
        let _ = writeln!(
            json,
            "  \"nccl_full_dispatch\": {},",
            Baseline::json(nccl_full)
        );
        json.push_str("  \"rows\": [\n");
        for (i, x) in rows.iter().enumerate() {
            let _ = writeln!(
                json,
                "    {{\"op\": \"{}\", \"num_sms\": {}, \"chunk\": {}, \"ring\": {}, \"split\": \"{}\", \"time_us\": {:.2}, \"gbps\": {:.2}, \"gbps_min_rank\": {:.2}}}{}",
                x.op.name(), x.num_sms, x.chunk, x.ring, x.split, x.us, x.gbps, x.gbps_min_rank,
                if i + 1 < rows.len() { "," } else { "" }
            );
        }
        json.push_str("  ]\n}\n");
        std::fs::write(&path, json)?;
        println!("wrote {path}");
    }
    Ok(())
}

/// The NCCL baselines `(rows only, full dispatch)`; both `None` without the `nccl` feature.
#[cfg(not(feature = "nccl"))]
fn nccl_baselines(
    _: &Node,
    _: &mut [RankState],
    _: usize,
    _: usize,
) -> Result<(Option<Baseline>, Option<Baseline>), BoxError> {
    println!("(NCCL baselines skipped: build with --features nccl)");
    Ok((None, None))
}

/// The NCCL baselines `(rows only, full dispatch)`, on one communicator per rank
/// (`ncclCommInitAll`), driven from this thread.
#[cfg(feature = "nccl")]
fn nccl_baselines(
    node: &Node,
    states: &mut [RankState],
    warmup: usize,
    iters: usize,
) -> Result<(Option<Baseline>, Option<Baseline>), BoxError> {
    let comms = nccl(cudarc::nccl::Comm::from_devices(node.streams.clone()))?;
    let rows_only = nccl_rows_only(node, &comms, states, warmup, iters)?;
    println!(
        "nccl rows only      : {:>8.1} us  {:>7.1} GB/s (mean of ranks)",
        rows_only.us, rows_only.gbps
    );
    let full = nccl_full_dispatch(node, &comms, states, warmup, iters)?;
    println!(
        "nccl full dispatch  : {:>8.1} us  {:>7.1} GB/s (mean of ranks); host {:.1} us; before the rows' all-to-all {:.1} us",
        full.us,
        full.gbps,
        full.host_us.unwrap_or(f32::NAN),
        full.prep_us.unwrap_or(f32::NAN)
    );
    Ok((Some(rows_only), Some(full)))
}

/// NCCL results as errors of the bench (`NcclError` is not a `std::error::Error`).
#[cfg(feature = "nccl")]
fn nccl<T>(r: Result<T, cudarc::nccl::result::NcclError>) -> Result<T, BoxError> {
    r.map_err(|e| format!("NCCL: {e:?}").into())
}

/// "Rows only": an NCCL grouped send/recv all-to-all moving exactly the dispatched rows,
/// already packed per destination (no layout, no count exchange, no packing), timed with CUDA
/// events per rank around the group.
#[cfg(feature = "nccl")]
fn nccl_rows_only(
    node: &Node,
    comms: &[cudarc::nccl::Comm],
    states: &mut [RankState],
    warmup: usize,
    iters: usize,
) -> Result<Baseline, BoxError> {
    use cudarc::nccl::{group_end, group_start};
    let r = node.num_ranks();
    // Per rank: one send buffer packed by destination, one receive buffer packed by source.
    let mut send: Vec<CudaSlice<bf16>> = Vec::new();
    let mut recv: Vec<CudaSlice<bf16>> = Vec::new();
    for (st, stream) in states.iter().zip(&node.streams) {
        let n_send: usize = st.send_counts.iter().sum();
        send.push(stream.alloc_zeros(n_send.max(1) * HIDDEN)?);
        recv.push(stream.alloc_zeros(st.num_recv.max(1) * HIDDEN)?);
    }
    let mut evs: Vec<Vec<(CudaEvent, CudaEvent)>> = (0..r).map(|_| Vec::new()).collect();
    for i in 0..warmup + iters {
        for (st, stream) in states.iter_mut().zip(&node.streams) {
            flush_l2(stream, &mut st.flush)?;
        }
        let starts: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        nccl(group_start())?;
        for (rank, comm) in comms.iter().enumerate() {
            let st = &states[rank];
            let mut off = 0;
            for (d, &c) in st.send_counts.iter().enumerate() {
                nccl(comm.send(
                    &send[rank].slice(off * HIDDEN..(off + c) * HIDDEN),
                    d as i32,
                ))?;
                off += c;
            }
            let mut off = 0;
            for (s, &c) in st.recv_counts.iter().enumerate() {
                let mut view = recv[rank].slice_mut(off * HIDDEN..(off + c) * HIDDEN);
                nccl(comm.recv(&mut view, s as i32))?;
                off += c;
            }
        }
        nccl(group_end())?;
        let ends: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        if i >= warmup {
            for (rank, (a, b)) in starts.into_iter().zip(ends).enumerate() {
                evs[rank].push((a, b));
            }
        }
    }
    node.sync_and_check()?;
    let per_rank_ms = evs
        .iter()
        .map(|e| {
            e.iter()
                .map(|(a, b)| a.elapsed_ms(b))
                .collect::<Result<Vec<f32>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (us, gbps) = summarize(&per_rank_ms, states);
    Ok(Baseline {
        us,
        gbps,
        host_us: None,
        prep_us: None,
    })
}

/// One rank's buffers for [`nccl_full_dispatch`].
#[cfg(feature = "nccl")]
struct FullDispatchRank {
    /// Output of the layout kernel.
    layout: ep_kernels::layout::DeviceDispatchLayout,
    /// `[R, R]` all-gathered `num_tokens_per_rank`: row `s` = what rank `s` sends to each rank.
    counts: CudaSlice<i32>,
    /// `[send rows]` token ids, grouped by destination rank (token order within a group).
    index: CudaSlice<i32>,
    /// `[send rows, H]` the gathered rows, grouped by destination.
    send_x: CudaSlice<bf16>,
    /// `[recv rows, H]` the received rows, grouped by source rank (token order within one).
    recv_x: CudaSlice<bf16>,
    /// Host copies made at the synchronisation point.
    counts_host: Vec<i32>,
    in_rank_host: Vec<u8>,
    index_host: Vec<i32>,
    /// Rows sent to each rank / received from each rank, learned from `counts_host`.
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
}

/// From the all-gathered counts and this rank's `is_token_in_rank`, fills the send/receive
/// sizes and the send index list (tokens grouped by destination, in token order), checking
/// that the two agree.
#[cfg(feature = "nccl")]
fn build_send_index(rank: usize, r: usize, f: &mut FullDispatchRank) -> Result<(), BoxError> {
    let count = |v: i32| usize::try_from(v).map_err(|_| format!("negative count {v}"));
    f.send_counts = (0..r)
        .map(|d| count(f.counts_host[rank * r + d]))
        .collect::<Result<_, _>>()?;
    f.recv_counts = (0..r)
        .map(|s| count(f.counts_host[s * r + rank]))
        .collect::<Result<_, _>>()?;
    let mut cursor = Vec::with_capacity(r);
    let mut end = Vec::with_capacity(r);
    let mut total = 0;
    for &c in &f.send_counts {
        cursor.push(total);
        total += c;
        end.push(total);
    }
    f.index_host.clear();
    f.index_host.resize(total, -1);
    for (t, row) in f.in_rank_host.chunks_exact(r).enumerate() {
        for (d, &b) in row.iter().enumerate() {
            if b != 0 {
                if cursor[d] == end[d] {
                    return Err(format!(
                        "rank {rank}: is_token_in_rank has more tokens for rank {d} than its count {}",
                        f.send_counts[d]
                    )
                    .into());
                }
                f.index_host[cursor[d]] = t as i32;
                cursor[d] += 1;
            }
        }
    }
    if cursor != end {
        return Err(
            format!("rank {rank}: is_token_in_rank has fewer tokens than the counts say").into(),
        );
    }
    Ok(())
}

/// "Full dispatch": what a user writes with NCCL for the same dispatch, per iteration and
/// timed end to end: the layout kernel (`get_dispatch_layout_cuda`) -> NCCL all-gather of the
/// per-rank counts -> copy the counts and `is_token_in_rank` to the host and synchronise (the
/// receive sizes are needed to post the receives) -> build the send index list on the host,
/// copy it up, gather the rows into one send buffer grouped by destination (`gather_rows_cuda`)
/// -> NCCL grouped send/recv of the rows. CUDA events per rank (start to end) and host wall
/// time per iteration; the received rows are checked against the inputs after the loop.
#[cfg(feature = "nccl")]
fn nccl_full_dispatch(
    node: &Node,
    comms: &[cudarc::nccl::Comm],
    states: &mut [RankState],
    warmup: usize,
    iters: usize,
) -> Result<Baseline, BoxError> {
    use cudarc::nccl::{group_end, group_start};
    use ep_kernels::layout::permute::gather_rows_cuda;
    use ep_kernels::layout::{get_dispatch_layout_cuda_into, DeviceDispatchLayout};
    use std::time::Instant;

    let r = node.num_ranks();
    let placement = ExpertPlacement::new(EXPERTS, r, r)?;
    // Buffers sized by the sizes this (fixed) routing produces, as a caching allocator would
    // hand them out after the first iteration; each iteration checks that they fit.
    let mut full: Vec<FullDispatchRank> = Vec::new();
    for (st, stream) in states.iter().zip(&node.streams) {
        let n_send: usize = st.send_counts.iter().sum();
        full.push(FullDispatchRank {
            layout: DeviceDispatchLayout::alloc(stream, TOKENS, &placement)?,
            counts: stream.alloc_zeros(r * r)?,
            index: stream.alloc_zeros(n_send.max(1))?,
            send_x: stream.alloc_zeros(n_send.max(1) * HIDDEN)?,
            recv_x: stream.alloc_zeros(st.num_recv.max(1) * HIDDEN)?,
            counts_host: vec![0; r * r],
            in_rank_host: vec![0; TOKENS * r],
            index_host: Vec::with_capacity(n_send),
            send_counts: vec![0; r],
            recv_counts: vec![0; r],
        });
    }
    node.sync_and_check()?;
    let mut evs: Vec<Vec<(CudaEvent, CudaEvent, CudaEvent)>> = (0..r).map(|_| Vec::new()).collect();
    let mut host_ms: Vec<f32> = Vec::new();
    for i in 0..warmup + iters {
        for (st, stream) in states.iter_mut().zip(&node.streams) {
            flush_l2(stream, &mut st.flush)?;
        }
        // The host clock starts with every GPU idle (flush done).
        for s in &node.streams {
            s.synchronize()?;
        }
        let t0 = Instant::now();
        let starts: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        // 1. Layout: counts per rank and is_token_in_rank.
        for ((f, st), stream) in full.iter_mut().zip(states.iter()).zip(&node.streams) {
            get_dispatch_layout_cuda_into(
                stream,
                &st.topk_idx,
                TOKENS,
                TOPK,
                &placement,
                &mut f.layout,
            )?;
        }
        // 2. Count exchange: every rank learns what every rank sends to every rank.
        nccl(group_start())?;
        for (f, comm) in full.iter_mut().zip(comms) {
            nccl(comm.all_gather(&f.layout.num_tokens_per_rank, &mut f.counts))?;
        }
        nccl(group_end())?;
        // 3. Host synchronisation: receive sizes (and the membership matrix for packing).
        for (f, stream) in full.iter_mut().zip(&node.streams) {
            stream.memcpy_dtoh(&f.counts, &mut f.counts_host)?;
            stream.memcpy_dtoh(&f.layout.is_token_in_rank, &mut f.in_rank_host)?;
        }
        for s in &node.streams {
            s.synchronize()?;
        }
        // 4. Pack: index list per destination, then gather the rows into the send buffer.
        for (rank, ((f, st), stream)) in full
            .iter_mut()
            .zip(states.iter())
            .zip(&node.streams)
            .enumerate()
        {
            build_send_index(rank, r, f)?;
            let n_send = f.index_host.len();
            let n_recv: usize = f.recv_counts.iter().sum();
            if n_send * HIDDEN > f.send_x.len() || n_recv * HIDDEN > f.recv_x.len() {
                return Err(format!(
                    "rank {rank}: {n_send} rows to send / {n_recv} to receive exceed the buffers"
                )
                .into());
            }
            if n_send > 0 {
                stream.memcpy_htod(&f.index_host, &mut f.index.slice_mut(0..n_send))?;
                gather_rows_cuda(
                    stream,
                    &st.x,
                    &f.index.slice(0..n_send),
                    HIDDEN,
                    &mut f.send_x.slice_mut(0..n_send * HIDDEN),
                )?;
            }
        }
        let mids: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        // 5. The rows: grouped send/recv, packed by destination / source.
        nccl(group_start())?;
        for (f, comm) in full.iter_mut().zip(comms) {
            let mut off = 0;
            for (d, &c) in f.send_counts.iter().enumerate() {
                nccl(comm.send(&f.send_x.slice(off * HIDDEN..(off + c) * HIDDEN), d as i32))?;
                off += c;
            }
            let mut off = 0;
            for (s, &c) in f.recv_counts.iter().enumerate() {
                let mut view = f.recv_x.slice_mut(off * HIDDEN..(off + c) * HIDDEN);
                nccl(comm.recv(&mut view, s as i32))?;
                off += c;
            }
        }
        nccl(group_end())?;
        let ends: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        for s in &node.streams {
            s.synchronize()?;
        }
        let host = t0.elapsed().as_secs_f32() * 1e3;
        if i >= warmup {
            host_ms.push(host);
            for (rank, ((a, m), b)) in starts.into_iter().zip(mids).zip(ends).enumerate() {
                evs[rank].push((a, m, b));
            }
        }
    }
    node.sync_and_check()?;
    check_full_dispatch(node, states, &full)?;
    let mut per_rank_ms = Vec::new();
    let mut prep_ms = Vec::new();
    for e in &evs {
        per_rank_ms.push(
            e.iter()
                .map(|(a, _, b)| a.elapsed_ms(b))
                .collect::<Result<Vec<f32>, _>>()?,
        );
        let mut p = e
            .iter()
            .map(|(a, m, _)| a.elapsed_ms(m))
            .collect::<Result<Vec<f32>, _>>()?;
        prep_ms.push(median(&mut p));
    }
    let (us, gbps) = summarize(&per_rank_ms, states);
    Ok(Baseline {
        us,
        gbps,
        host_us: Some(median(&mut host_ms) * 1e3),
        prep_us: Some(median(&mut prep_ms) * 1e3),
    })
}

/// Checks the last iteration of [`nccl_full_dispatch`]: rank `d` must hold, for each source
/// rank `s` in order, the rows of `x_s` of the tokens that go to `d` (per the host layout
/// uploaded by [`setup`]), in token order, bit for bit.
#[cfg(feature = "nccl")]
fn check_full_dispatch(
    node: &Node,
    states: &[RankState],
    full: &[FullDispatchRank],
) -> Result<(), BoxError> {
    let r = node.num_ranks();
    let xs: Vec<Vec<bf16>> = states
        .iter()
        .zip(&node.streams)
        .map(|(st, s)| s.clone_dtoh(&st.x))
        .collect::<Result<_, _>>()?;
    let in_rank: Vec<Vec<u8>> = states
        .iter()
        .zip(&node.streams)
        .map(|(st, s)| s.clone_dtoh(&st.in_rank))
        .collect::<Result<_, _>>()?;
    for (d, (f, stream)) in full.iter().zip(&node.streams).enumerate() {
        let n = states[d].num_recv;
        let got = stream.clone_dtoh(&f.recv_x.slice(0..n * HIDDEN))?;
        let mut row = 0;
        for (s, x) in xs.iter().enumerate() {
            for t in (0..TOKENS).filter(|&t| in_rank[s][t * r + d] != 0) {
                let want = &x[t * HIDDEN..(t + 1) * HIDDEN];
                let have = got.get(row * HIDDEN..(row + 1) * HIDDEN).ok_or_else(|| {
                    format!(
                        "NCCL full dispatch: rank {d} received fewer than {} rows",
                        row + 1
                    )
                })?;
                if !want
                    .iter()
                    .zip(have)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                {
                    return Err(format!(
                        "NCCL full dispatch: rank {d}, received row {row} is not token {t} of rank {s}"
                    )
                    .into());
                }
                row += 1;
            }
        }
        if row != n {
            return Err(
                format!("NCCL full dispatch: rank {d} received {n} rows, expected {row}").into(),
            );
        }
    }
    println!("nccl full dispatch  : received rows checked bit for bit on every rank");
    Ok(())
}
