//! Intranode (NVLink) dispatch / combine benchmark in DeepEP's configuration: 4096 tokens per
//! rank, hidden 7168, top-8 of 256 experts (random scores, top-k), on all visible GPUs (2 or 4;
//! `EP_BENCH_RANKS` overrides). Reports bf16 and fp8 dispatch and bf16 combine, timed with CUDA
//! events per iteration (median across iterations and ranks), and GB/s counted as DeepEP
//! does: bytes of all received rows (local ones included) over time; fp8 bytes = bf16 bytes x
//! (1 + 4/128) / 2. Sweeps SM counts and chunk sizes; with the `nccl` feature also times an
//! NCCL grouped send/recv all-to-all of exactly the dispatched rows ("rows only").
//! Writes JSON to `$EP_BENCH_OUT` if set. `EP_BENCH_QUICK=1` runs a short sweep.

mod common;

use std::fmt::Write as _;
use std::sync::Arc;

use common::{BoxError, Node};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use ep_kernels::intranode::{
    buffer_size_hint, cached_notify_cuda, combine_cuda, dispatch_cuda, notify_dispatch_cuda,
    CombineArgs, Config, DispatchArgs, HostMappedI32, NotifyArgs, Payload, RecvPayload, RecvTopK,
    TopK, COMBINE_ROUND_TOKENS,
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
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    DispatchBf16,
    DispatchFp8,
    Combine,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::DispatchBf16 => "dispatch-bf16",
            Op::DispatchFp8 => "dispatch-fp8",
            Op::Combine => "combine-bf16",
        }
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
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
                HostMappedI32::new(&node.ctxs[i], 1, -1)?,
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
            },
        )?;
        let n = counters[rank]
            .0
            .poll_nonneg(0, std::time::Duration::from_secs(30), rank)? as usize;
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
    dispatch_cuda(
        stream,
        &node.peers[rank],
        config,
        DispatchArgs {
            x,
            topk: Some(TopK {
                idx: st.topk_idx.as_view(),
                weights: st.topk_w.as_view(),
            }),
            num_experts: EXPERTS,
            is_token_in_rank: st.in_rank.as_view(),
            rank_prefix_matrix: h.rank_prefix.as_view(),
            channel_prefix_matrix: h.channel_prefix.as_view(),
            recv_x,
            recv_src_idx: st.recv_src.slice_mut(0..n),
            recv_topk: Some(RecvTopK {
                idx: st.recv_topk_idx.slice_mut(0..n * TOPK),
                weights: st.recv_topk_w.slice_mut(0..n * TOPK),
            }),
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
    warmup: usize,
    iters: usize,
) -> Result<Vec<f32>, BoxError> {
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
        let mut evs = Vec::new();
        for i in 0..warmup + iters {
            cached_notify_cuda(stream, &node.peers[rank])?;
            let e0 = event(stream)?;
            match op {
                Op::DispatchBf16 => launch_dispatch(node, rank, st, h, config, false)?,
                Op::DispatchFp8 => launch_dispatch(node, rank, st, h, config, true)?,
                Op::Combine => launch_combine(node, rank, st, h, config)?,
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

/// One measured configuration.
struct Row {
    op: Op,
    num_sms: usize,
    chunk: usize,
    ring: usize,
    us: f32,
    gbps: f32,
    gbps_min_rank: f32,
}

fn bytes(op: Op, n: usize) -> f64 {
    let bf16 = (n * HIDDEN * 2) as f64;
    match op {
        Op::DispatchFp8 => bf16 * (1.0 + 4.0 / 128.0) / 2.0,
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
    let node = Node::new(r, buffer_size_hint(HIDDEN, TOPK, r, &max_cfg))?;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut states = setup(&node, &mut rng)?;
    let (warmup, iters) = (3, if quick { 10 } else { 20 });
    println!(
        "intranode bench: EP{r}, {TOKENS} tokens/rank, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}; recv tokens per rank {:?}",
        states.iter().map(|s| s.num_recv).collect::<Vec<_>>()
    );
    let mut rows: Vec<Row> = Vec::new();
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
                    let ms = time_op(
                        &node,
                        &mut states,
                        &mut handles,
                        op,
                        &cfg,
                        &dcfg,
                        warmup,
                        iters,
                    )?;
                    let per_rank: Vec<f32> = ms
                        .iter()
                        .zip(&states)
                        .map(|(&t, s)| (bytes(op, s.num_recv) / 1e9 / (t as f64 / 1e3)) as f32)
                        .collect();
                    let mut all = ms.clone();
                    let row = Row {
                        op,
                        num_sms,
                        chunk,
                        ring,
                        us: median(&mut all) * 1e3,
                        gbps: per_rank.iter().sum::<f32>() / per_rank.len() as f32,
                        gbps_min_rank: per_rank.iter().copied().fold(f32::INFINITY, f32::min),
                    };
                    println!(
                        "{:<14} sms {:>3} chunk {:>3} ring {:>4}: {:>8.1} us  {:>7.1} GB/s (NVL, mean of ranks; min {:.1})",
                        op.name(), num_sms, chunk, ring, row.us, row.gbps, row.gbps_min_rank
                    );
                    rows.push(row);
                }
            }
        }
    }
    let nccl = nccl_baseline(&node, &states, warmup, iters)?;
    // Summary: best per op, and the 24-SM numbers DeepEP reports.
    println!("\n== summary (EP{r}) ==");
    println!(
        "{:<14} {:>5} {:>6} {:>5} {:>10} {:>10}",
        "op", "sms", "chunk", "ring", "time_us", "GB/s"
    );
    for op in [Op::DispatchBf16, Op::DispatchFp8, Op::Combine] {
        if let Some(b) = rows
            .iter()
            .filter(|x| x.op == op)
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (best)",
                op.name(),
                b.num_sms,
                b.chunk,
                b.ring,
                b.us,
                b.gbps
            );
        }
        if let Some(b) = rows
            .iter()
            .filter(|x| x.op == op && x.num_sms == 24)
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (best at 24 SMs)",
                op.name(),
                b.num_sms,
                b.chunk,
                b.ring,
                b.us,
                b.gbps
            );
        }
    }
    if let Some((us, gbps)) = nccl {
        println!(
            "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (NCCL send/recv, rows only)",
            "nccl-a2a-bf16", "-", "-", "-", us, gbps
        );
    }
    if let Ok(path) = std::env::var("EP_BENCH_OUT") {
        let mut json = String::from("{\n  \"bench\": \"intranode\",\n");
        let _ = writeln!(json, "  \"num_ranks\": {r}, \"tokens\": {TOKENS}, \"hidden\": {HIDDEN}, \"topk\": {TOPK}, \"experts\": {EXPERTS},");
        let _ = writeln!(
            json,
            "  \"nccl_rows_only\": {},",
            match nccl {
                Some((us, g)) => format!("{{\"time_us\": {us:.2}, \"gbps\": {g:.2}}}"),
                None => "null".into(),
            }
        );
        json.push_str("  \"rows\": [\n");
        for (i, x) in rows.iter().enumerate() {
            let _ = writeln!(
                json,
                "    {{\"op\": \"{}\", \"num_sms\": {}, \"chunk\": {}, \"ring\": {}, \"time_us\": {:.2}, \"gbps\": {:.2}, \"gbps_min_rank\": {:.2}}}{}",
                x.op.name(), x.num_sms, x.chunk, x.ring, x.us, x.gbps, x.gbps_min_rank,
                if i + 1 < rows.len() { "," } else { "" }
            );
        }
        json.push_str("  ]\n}\n");
        std::fs::write(&path, json)?;
        println!("wrote {path}");
    }
    Ok(())
}

/// NCCL grouped send/recv moving exactly the dispatched rows (packed per destination), timed
/// like the kernels; `None` without the `nccl` feature.
#[cfg(not(feature = "nccl"))]
fn nccl_baseline(
    _: &Node,
    _: &[RankState],
    _: usize,
    _: usize,
) -> Result<Option<(f32, f32)>, BoxError> {
    println!("(NCCL baseline skipped: build with --features nccl)");
    Ok(None)
}

#[cfg(feature = "nccl")]
fn nccl_baseline(
    node: &Node,
    states: &[RankState],
    warmup: usize,
    iters: usize,
) -> Result<Option<(f32, f32)>, BoxError> {
    use cudarc::nccl::{group_end, group_start, Comm};
    let r = node.num_ranks();
    let comms =
        Comm::from_devices(node.streams.clone()).map_err(|e| format!("ncclCommInitAll: {e:?}"))?;
    let row = HIDDEN * 2;
    // One buffer per (rank, peer) so every view of a group is a distinct borrow.
    let mut send: Vec<Vec<CudaSlice<u8>>> = Vec::new();
    let mut recv: Vec<Vec<CudaSlice<u8>>> = Vec::new();
    for (st, stream) in states.iter().zip(&node.streams) {
        send.push(
            st.send_counts
                .iter()
                .map(|&n| stream.alloc_zeros::<u8>(n.max(1) * row))
                .collect::<Result<_, _>>()?,
        );
        recv.push(
            st.recv_counts
                .iter()
                .map(|&n| stream.alloc_zeros::<u8>(n.max(1) * row))
                .collect::<Result<_, _>>()?,
        );
    }
    let mut evs: Vec<Vec<(CudaEvent, CudaEvent)>> = (0..r).map(|_| Vec::new()).collect();
    for i in 0..warmup + iters {
        let starts: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        group_start().map_err(|e| format!("{e:?}"))?;
        for ((rank, comm), recv_bufs) in comms.iter().enumerate().zip(recv.iter_mut()) {
            let st = &states[rank];
            let mut g = comm.group();
            for (d, buf) in send[rank].iter().enumerate() {
                g.send(buf.slice(0..st.send_counts[d] * row), d as i32)
                    .map_err(|e| format!("{e:?}"))?;
            }
            for (s, buf) in recv_bufs.iter_mut().enumerate() {
                g.recv(buf.slice_mut(0..st.recv_counts[s] * row), s as i32)
                    .map_err(|e| format!("{e:?}"))?;
            }
            drop(g);
        }
        group_end().map_err(|e| format!("{e:?}"))?;
        let ends: Vec<CudaEvent> = node.streams.iter().map(event).collect::<Result<_, _>>()?;
        if i >= warmup {
            for (rank, (a, b)) in starts.into_iter().zip(ends).enumerate() {
                evs[rank].push((a, b));
            }
        }
    }
    for s in &node.streams {
        s.synchronize()?;
    }
    let mut per_rank_ms = Vec::new();
    let mut gbps = Vec::new();
    for (rank, e) in evs.iter().enumerate() {
        let mut ms: Vec<f32> = e
            .iter()
            .map(|(a, b)| a.elapsed_ms(b))
            .collect::<Result<_, _>>()?;
        let m = median(&mut ms);
        per_rank_ms.push(m);
        gbps.push((bytes(Op::DispatchBf16, states[rank].num_recv) / 1e9 / (m as f64 / 1e3)) as f32);
    }
    let us = median(&mut per_rank_ms) * 1e3;
    let g = gbps.iter().sum::<f32>() / gbps.len() as f32;
    println!("nccl-a2a-bf16 (rows only): {us:.1} us  {g:.1} GB/s (mean of ranks)");
    Ok(Some((us, g)))
}
