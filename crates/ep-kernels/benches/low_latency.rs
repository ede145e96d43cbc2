//! Low-latency (decode) dispatch / combine benchmark in DeepEP's configuration: 128 tokens per
//! rank, hidden 7168, top-8 of 256 and 288 experts, fp8 dispatch (1x128 scales), bf16 combine,
//! on all visible GPUs (`EP_BENCH_RANKS` overrides).
//!
//! Every op is captured in a CUDA graph per rank and replayed back to back on all ranks at
//! once; latency is the median over replays of each rank's event-timed replay, then the median
//! across ranks. A single-op replay includes the graph launch (several us); the "x16 graph"
//! rows capture 16 ops back to back and report time / 16, closer to a kernel's duration. Reported: dispatch, combine, dispatch + combine, and the send and receive
//! phases apart (send graph, a 100 us device delay standing for other work, receive graph),
//! each with DeepEP's per-expert combine and again "per rank" ([`Reduction::PerRank`]: the
//! dispatch carries the top-k weights, the combine sends one row per (token, rank)).
//! Bandwidth counts bytes as DeepEP's low-latency test does: per (token, expert) selection of
//! the rank, dispatch fp8 `H + H/128*4 + 16` bytes and combine bf16 `2H` bytes. With the
//! `nccl` feature, an NCCL grouped send/recv all-to-all of the same bytes per peer is timed
//! too. Prints a table; writes JSON to `$EP_BENCH_OUT` if set. `EP_BENCH_ITERS` sets the
//! number of timed replays (default 200), `EP_BENCH_TOKENS` the tokens per rank (default 128,
//! the decode batch), `EP_BENCH_EXPERTS` the expert counts (default `256,288`),
//! `EP_BENCH_REDUCTIONS` the combines (`expert,rank`, the default, or either). Per-rank rows
//! count bytes as the per-expert ones (DeepEP's counting, not the bytes sent), so that the
//! GB/s of both compare as 1 / time.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream};
use ep_kernels::low_latency::{
    combine_cuda, delay_cuda, dispatch_cuda, enable_peer_access, LowLatencyBuffer,
    LowLatencyFormat, LowLatencyLayout, LowLatencyRecv, Phases, Reduction,
};
use ep_kernels::FP8_GROUP;
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[cfg(feature = "nvshmem")]
mod ll_nvshmem;

/// Tokens per rank unless `EP_BENCH_TOKENS` says otherwise.
const DEFAULT_TOKENS: usize = 128;
const HIDDEN: usize = 7168;
const TOPK: usize = 8;
const FORMAT: LowLatencyFormat = LowLatencyFormat::Fp8;
/// Device delay between a send and a receive phase when timing them apart.
const HOOK_GAP: Duration = Duration::from_micros(100);

/// One rank: stream, buffer, inputs and outputs.
struct Rank {
    /// Tokens this rank dispatches per op (also the buffer's `max_tokens_per_rank`).
    tokens: usize,
    stream: Arc<CudaStream>,
    buf: LowLatencyBuffer,
    x: CudaSlice<bf16>,
    topk: CudaSlice<i64>,
    w: CudaSlice<f32>,
    recv: LowLatencyRecv,
    expert_out: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    /// Selections (token, expert) this rank sends to each rank.
    send_counts: Vec<usize>,
    /// How combines reduce (per rank: dispatches carry the weights).
    red: Reduction,
}

impl Rank {
    fn dispatch(&mut self, phases: Phases) -> Result<(), BoxError> {
        let w = self.w.as_view();
        dispatch_cuda(
            &self.stream,
            &self.buf,
            &self.x,
            &self.topk,
            (self.red == Reduction::PerRank).then_some(&w),
            self.tokens,
            TOPK,
            FORMAT,
            phases,
            &mut self.recv,
        )?;
        Ok(())
    }

    fn combine(&mut self, phases: Phases) -> Result<(), BoxError> {
        combine_cuda(
            &self.stream,
            &self.buf,
            &self.expert_out,
            &self.recv,
            &self.topk,
            &self.w,
            self.tokens,
            TOPK,
            phases,
            self.red,
            &mut self.out,
        )?;
        Ok(())
    }

    /// Captures `f` into a graph on this rank's stream.
    fn capture(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<(), BoxError>,
    ) -> Result<CudaGraph, BoxError> {
        let stream = self.stream.clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        f(self)?;
        Ok(stream
            .end_capture(CUgraphInstantiate_flags(0))?
            .ok_or("empty graph")?)
    }
}

fn setup(
    num_ranks: usize,
    num_experts: usize,
    tokens: usize,
    seed: u64,
) -> Result<Vec<Rank>, BoxError> {
    let layout = LowLatencyLayout::new(tokens, HIDDEN, num_ranks, num_experts)?;
    let ctxs = (0..num_ranks)
        .map(CudaContext::new)
        .collect::<Result<Vec<_>, _>>()?;
    for ctx in &ctxs {
        // SAFETY: every slice of this benchmark lives on its rank's single stream, so no
        // cross-stream events are needed (and they would break graph capture).
        unsafe { ctx.disable_event_tracking() };
    }
    for a in &ctxs {
        for b in &ctxs {
            enable_peer_access(a, b)?;
        }
    }
    let mut ranks = Vec::with_capacity(num_ranks);
    for (r, ctx) in ctxs.iter().enumerate() {
        let stream = ctx.new_stream()?;
        let buf = LowLatencyBuffer::new(&stream, layout, r)?;
        ranks.push(make_rank(r, stream, buf, seed)?);
    }
    let bases: Vec<u64> = ranks.iter().map(|r| r.buf.base_ptr()).collect();
    for rank in &mut ranks {
        let stream = rank.stream.clone();
        // SAFETY: `bases` are the ranks' buffers of this layout, peer-accessible in this
        // process, and live as long as the ranks (dropped after every kernel finished).
        unsafe { rank.buf.connect(&stream, &bases) }?;
    }
    Ok(ranks)
}

/// Rank `r`'s inputs (drawn from `seed` and `r`) and outputs around its buffer.
fn make_rank(
    r: usize,
    stream: Arc<CudaStream>,
    buf: LowLatencyBuffer,
    seed: u64,
) -> Result<Rank, BoxError> {
    let layout = *buf.layout();
    let (tokens, num_experts) = (layout.max_tokens_per_rank, layout.num_experts);
    let l = layout.num_local_experts();
    let rows = l * layout.recv_rows_per_expert();
    let mut rng = StdRng::seed_from_u64(seed ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9));
    let mut topk = Vec::with_capacity(tokens * TOPK);
    let mut send_counts = vec![0usize; layout.num_ranks];
    for _ in 0..tokens {
        for e in sample(&mut rng, num_experts, TOPK) {
            topk.push(e as i64);
            send_counts[e / l] += 1;
        }
    }
    let x: Vec<bf16> = (0..tokens * HIDDEN)
        .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect();
    let w: Vec<f32> = (0..tokens * TOPK)
        .map(|_| rng.random_range(0.0f32..1.0))
        .collect();
    let expert_out: Vec<bf16> = (0..rows * HIDDEN)
        .map(|i| bf16::from_f32(((i % 251) as f32 - 125.0) / 64.0))
        .collect();
    Ok(Rank {
        x: stream.clone_htod(&x)?,
        topk: stream.clone_htod(&topk)?,
        w: stream.clone_htod(&w)?,
        recv: LowLatencyRecv::alloc(&stream, &layout, FORMAT, true)?,
        expert_out: stream.clone_htod(&expert_out)?,
        out: stream.alloc_zeros(tokens * HIDDEN)?,
        tokens,
        stream,
        buf,
        send_counts,
        red: Reduction::PerExpert,
    })
}

/// The process mode (`EP_BENCH_NVSHMEM`): a child times its rank of every configuration, the
/// parent starts the children and prints the medians.
#[cfg(feature = "nvshmem")]
fn nvshmem_main(
    num_ranks: usize,
    gpn: usize,
    iters: usize,
    tokens: usize,
    experts_list: &[usize],
    reductions: &[(Reduction, &str)],
    header: &str,
) -> Result<(), BoxError> {
    let Some(c) = ll_nvshmem::child(num_ranks)? else {
        return ll_nvshmem::parent(num_ranks, gpn, header);
    };
    let ctx = CudaContext::new(c.rank)?;
    // SAFETY: as in `setup`: one stream per rank.
    unsafe { ctx.disable_event_tracking() };
    for &experts in experts_list {
        if experts % num_ranks != 0 {
            continue;
        }
        let layout = LowLatencyLayout::new(tokens, HIDDEN, num_ranks, experts)?;
        let stream = ctx.new_stream()?;
        let node = c.rank / gpn;
        let buf = LowLatencyBuffer::new_nvshmem(&stream, layout, &c.nv, |r| r / gpn == node)?;
        let mut rank = make_rank(c.rank, stream, buf, 0x5eed ^ experts as u64)?;
        for &(red, _) in reductions {
            rank.red = red;
            ll_nvshmem::report(experts, red, &mut rank, 20, iters)?;
        }
    }
    Ok(())
}

/// Runs `f` on one thread per rank, concurrently.
fn each<T: Send>(
    ranks: &mut [Rank],
    f: impl Fn(usize, &mut Rank) -> Result<T, BoxError> + Sync,
) -> Result<Vec<T>, BoxError> {
    let f = &f;
    let results: Vec<Result<T, BoxError>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .enumerate()
            .map(|(r, rank)| s.spawn(move || f(r, rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    });
    results.into_iter().collect()
}

fn event(stream: &Arc<CudaStream>) -> Result<CudaEvent, BoxError> {
    Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Per-rank graphs of every timed op.
struct Graphs {
    dispatch: CudaGraph,
    combine: CudaGraph,
    both: CudaGraph,
    dispatch_send: CudaGraph,
    dispatch_recv: CudaGraph,
    combine_send: CudaGraph,
    combine_recv: CudaGraph,
    /// [`REPS`] dispatches, combines, and dispatch + combine pairs back to back.
    dispatch_reps: CudaGraph,
    combine_reps: CudaGraph,
    both_reps: CudaGraph,
}

/// Ops per graph for the back-to-back (launch overhead amortised) timings.
const REPS: usize = 16;

/// The names of [`Timings`]' slots.
const OP_NAMES: [&str; 10] = [
    "dispatch",
    "combine",
    "dispatch+combine",
    "dispatch send",
    "dispatch recv",
    "combine send",
    "combine recv",
    "dispatch (x16 graph)",
    "combine (x16 graph)",
    "disp+comb (x16 graph)",
];

/// Median microseconds per rank of: dispatch, combine, both (one graph replay each, launch
/// included), dispatch send, dispatch recv, combine send, combine recv, then dispatch,
/// combine, both per op from graphs of [`REPS`] ops back to back.
type Timings = [f64; 10];

fn time_rank(rank: &mut Rank, warmup: usize, iters: usize) -> Result<Timings, BoxError> {
    // Warm-up outside capture: loads the module and sets the kernels' attributes.
    rank.dispatch(Phases::Both)?;
    rank.combine(Phases::Both)?;
    rank.stream.synchronize()?;
    let g = Graphs {
        dispatch: rank.capture(|r| r.dispatch(Phases::Both))?,
        combine: rank.capture(|r| r.combine(Phases::Both))?,
        both: rank.capture(|r| {
            r.dispatch(Phases::Both)?;
            r.combine(Phases::Both)
        })?,
        dispatch_send: rank.capture(|r| r.dispatch(Phases::Send))?,
        dispatch_recv: rank.capture(|r| r.dispatch(Phases::Recv))?,
        combine_send: rank.capture(|r| r.combine(Phases::Send))?,
        combine_recv: rank.capture(|r| r.combine(Phases::Recv))?,
        dispatch_reps: rank.capture(|r| (0..REPS).try_for_each(|_| r.dispatch(Phases::Both)))?,
        combine_reps: rank.capture(|r| (0..REPS).try_for_each(|_| r.combine(Phases::Both)))?,
        both_reps: rank.capture(|r| {
            (0..REPS).try_for_each(|_| {
                r.dispatch(Phases::Both)?;
                r.combine(Phases::Both)
            })
        })?,
    };
    let s = rank.stream.clone();
    let mut out = [0f64; 10];
    // Whole ops. Every rank replays the same sequence, so the ops pair up across ranks.
    for (slot, graph, ops) in [
        (0, &g.dispatch, 1),
        (1, &g.combine, 1),
        (2, &g.both, 1),
        (7, &g.dispatch_reps, REPS),
        (8, &g.combine_reps, REPS),
        (9, &g.both_reps, REPS),
    ] {
        let iters = if ops > 1 {
            iters.div_ceil(ops).max(10)
        } else {
            iters
        };
        let mut evs = Vec::with_capacity(warmup + iters);
        for i in 0..warmup + iters {
            let a = event(&s)?;
            graph.launch()?;
            let b = event(&s)?;
            if i >= warmup {
                evs.push((a, b));
            }
        }
        s.synchronize()?;
        let mut us: Vec<f64> = evs
            .iter()
            .map(|(a, b)| a.elapsed_ms(b).map(|ms| f64::from(ms) * 1e3))
            .collect::<Result<_, _>>()?;
        out[slot] = median(&mut us) / ops as f64;
    }
    // Phases apart, with a gap standing for other work.
    for (slot, send, recv) in [
        (3, &g.dispatch_send, &g.dispatch_recv),
        (5, &g.combine_send, &g.combine_recv),
    ] {
        let mut evs = Vec::with_capacity(warmup + iters);
        for i in 0..warmup + iters {
            let a = event(&s)?;
            send.launch()?;
            let b = event(&s)?;
            delay_cuda(&s, HOOK_GAP)?;
            let c = event(&s)?;
            recv.launch()?;
            let d = event(&s)?;
            if i >= warmup {
                evs.push((a, b, c, d));
            }
        }
        s.synchronize()?;
        let mut send_us = Vec::new();
        let mut recv_us = Vec::new();
        for (a, b, c, d) in &evs {
            send_us.push(f64::from(a.elapsed_ms(b)?) * 1e3);
            recv_us.push(f64::from(c.elapsed_ms(d)?) * 1e3);
        }
        out[slot] = median(&mut send_us);
        out[slot + 1] = median(&mut recv_us);
    }
    rank.buf.check_active_ranks(&s, "low_latency")?;
    Ok(out)
}

/// Bytes one selection moves: fp8 dispatch message, bf16 combine row.
fn dispatch_bytes_per_sel() -> f64 {
    (HIDDEN + HIDDEN / FP8_GROUP * 4 + 16) as f64
}

fn combine_bytes_per_sel() -> f64 {
    (2 * HIDDEN) as f64
}

/// NCCL grouped send/recv all-to-all moving `bytes_per_sel` per selection between each pair;
/// median microseconds per rank.
#[cfg(feature = "nccl")]
fn nccl_alltoall(
    ranks: &[Rank],
    bytes_per_sel: usize,
    warmup: usize,
    iters: usize,
) -> Result<Option<Vec<f64>>, BoxError> {
    use cudarc::nccl::{group_end, group_start, Comm};
    let n = ranks.len();
    let streams: Vec<Arc<CudaStream>> = ranks.iter().map(|r| r.stream.clone()).collect();
    let comms =
        Comm::from_devices(streams.clone()).map_err(|e| format!("ncclCommInitAll: {e:?}"))?;
    // recv_counts[r][s] = send_counts[s][r].
    let mut send: Vec<Vec<CudaSlice<u8>>> = Vec::new();
    let mut recv: Vec<Vec<CudaSlice<u8>>> = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let mut sb = Vec::new();
        let mut rb = Vec::new();
        for (p, peer) in ranks.iter().enumerate() {
            let out_bytes = rank.send_counts[p] * bytes_per_sel;
            let in_bytes = peer.send_counts[r] * bytes_per_sel;
            sb.push(rank.stream.alloc_zeros::<u8>(out_bytes.max(1))?);
            rb.push(rank.stream.alloc_zeros::<u8>(in_bytes.max(1))?);
        }
        send.push(sb);
        recv.push(rb);
    }
    let mut evs: Vec<Vec<(CudaEvent, CudaEvent)>> = (0..n).map(|_| Vec::new()).collect();
    for i in 0..warmup + iters {
        let starts: Vec<CudaEvent> = streams.iter().map(event).collect::<Result<_, _>>()?;
        group_start().map_err(|e| format!("{e:?}"))?;
        for (r, (comm, rbufs)) in comms.iter().zip(recv.iter_mut()).enumerate() {
            let mut g = comm.group();
            for (p, buf) in send[r].iter().enumerate() {
                let len = ranks[r].send_counts[p] * bytes_per_sel;
                g.send(buf.slice(0..len), p as i32)
                    .map_err(|e| format!("{e:?}"))?;
            }
            for (p, buf) in rbufs.iter_mut().enumerate() {
                let len = ranks[p].send_counts[r] * bytes_per_sel;
                g.recv(buf.slice_mut(0..len), p as i32)
                    .map_err(|e| format!("{e:?}"))?;
            }
            drop(g);
        }
        group_end().map_err(|e| format!("{e:?}"))?;
        let ends: Vec<CudaEvent> = streams.iter().map(event).collect::<Result<_, _>>()?;
        if i >= warmup {
            for (r, ab) in starts.into_iter().zip(ends).enumerate() {
                evs[r].push(ab);
            }
        }
    }
    for s in &streams {
        s.synchronize()?;
    }
    let mut per_rank = Vec::new();
    for e in &evs {
        let mut us: Vec<f64> = e
            .iter()
            .map(|(a, b)| a.elapsed_ms(b).map(|ms| f64::from(ms) * 1e3))
            .collect::<Result<_, _>>()?;
        per_rank.push(median(&mut us));
    }
    Ok(Some(per_rank))
}

#[cfg(not(feature = "nccl"))]
fn nccl_alltoall(_: &[Rank], _: usize, _: usize, _: usize) -> Result<Option<Vec<f64>>, BoxError> {
    Ok(None)
}

fn main() -> Result<(), BoxError> {
    let gpus = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    if gpus == 0 {
        return Err("no CUDA device".into());
    }
    let num_ranks = std::env::var("EP_BENCH_RANKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(gpus)
        .clamp(1, gpus);
    let iters: usize = std::env::var("EP_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
        .max(1);
    let tokens: usize = std::env::var("EP_BENCH_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_TOKENS)
        .max(1);
    let experts_list: Vec<usize> = std::env::var("EP_BENCH_EXPERTS")
        .ok()
        .map(|v| v.split(',').filter_map(|e| e.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![256, 288]);
    let reductions: Vec<(Reduction, &str)> = std::env::var("EP_BENCH_REDUCTIONS")
        .unwrap_or_else(|_| "expert,rank".into())
        .split(',')
        .filter_map(|v| match v.trim() {
            "expert" => Some((Reduction::PerExpert, "")),
            "rank" => Some((Reduction::PerRank, " per rank")),
            _ => None,
        })
        .collect();
    let warmup = 20;
    let header = format!(
        "low-latency EP{num_ranks}: {tokens} tokens/rank, hidden {HIDDEN}, top-{TOPK}, fp8 dispatch, \
         bf16 combine; {iters} CUDA-graph replays (median of replays, then of ranks)"
    );
    #[cfg(feature = "nvshmem")]
    if let Some(gpn) = ll_nvshmem::gpus_per_node() {
        return nvshmem_main(
            num_ranks,
            gpn.max(1),
            iters,
            tokens,
            &experts_list,
            &reductions,
            &header,
        );
    }
    println!("{header}");
    let mut table = String::new();
    let _ = writeln!(
        table,
        "{:>8} {:<22} {:>10} {:>10}",
        "experts", "op", "us", "GB/s/rank"
    );
    let mut json = Vec::new();
    for experts in experts_list {
        if experts % num_ranks != 0 {
            continue;
        }
        let mut ranks = setup(num_ranks, experts, tokens, 0x5eed ^ experts as u64)?;
        let mut row_json = Vec::new();
        for &(red, suffix) in &reductions {
            for r in ranks.iter_mut() {
                r.red = red;
            }
            let per_rank = each(&mut ranks, |_, rank| time_rank(rank, warmup, iters))?;
            let sels: Vec<f64> = ranks
                .iter()
                .map(|r| r.send_counts.iter().sum::<usize>() as f64)
                .collect();
            for (i, name) in OP_NAMES.iter().enumerate() {
                let name = format!("{name}{suffix}");
                let mut us: Vec<f64> = per_rank.iter().map(|t| t[i]).collect();
                let bytes_per_sel = match i {
                    0 | 3 | 4 | 7 => dispatch_bytes_per_sel(),
                    1 | 5 | 6 | 8 => combine_bytes_per_sel(),
                    _ => dispatch_bytes_per_sel() + combine_bytes_per_sel(),
                };
                // GB/s per rank: that rank's bytes over its time; mean over ranks.
                let gbps: f64 = per_rank
                    .iter()
                    .zip(&sels)
                    .map(|(t, &s)| s * bytes_per_sel / (t[i] * 1e-6) / 1e9)
                    .sum::<f64>()
                    / num_ranks as f64;
                let med = median(&mut us);
                let _ = writeln!(table, "{experts:>8} {name:<22} {med:>10.1} {gbps:>10.1}");
                row_json.push(format!(
                "{{\"op\": \"{name}\", \"us\": {med:.2}, \"gbps_per_rank\": {gbps:.2}, \"us_per_rank\": {:?}}}",
                per_rank.iter().map(|t| (t[i] * 100.0).round() / 100.0).collect::<Vec<_>>()
            ));
            }
        }
        let sels: Vec<f64> = ranks
            .iter()
            .map(|r| r.send_counts.iter().sum::<usize>() as f64)
            .collect();
        for (name, bps) in [
            (
                "nccl a2a (dispatch bytes)",
                dispatch_bytes_per_sel() as usize,
            ),
            ("nccl a2a (combine bytes)", combine_bytes_per_sel() as usize),
        ] {
            if let Some(per) = nccl_alltoall(&ranks, bps, warmup, iters)? {
                let gbps: f64 = per
                    .iter()
                    .zip(&sels)
                    .map(|(&t, &s)| s * bps as f64 / (t * 1e-6) / 1e9)
                    .sum::<f64>()
                    / num_ranks as f64;
                let mut us = per.clone();
                let med = median(&mut us);
                let _ = writeln!(table, "{experts:>8} {name:<22} {med:>10.1} {gbps:>10.1}");
                row_json.push(format!(
                    "{{\"op\": \"{name}\", \"us\": {med:.2}, \"gbps_per_rank\": {gbps:.2}}}"
                ));
            }
        }
        if !cfg!(feature = "nccl") {
            let _ = writeln!(
                table,
                "{experts:>8} (NCCL baseline skipped: build with --features nccl)"
            );
        }
        json.push(format!(
            "{{\"experts\": {experts}, \"results\": [{}]}}",
            row_json.join(", ")
        ));
        drop(ranks);
    }
    print!("{table}");
    let doc = format!(
        "{{\"bench\": \"low_latency\", \"ranks\": {num_ranks}, \"tokens\": {tokens}, \"hidden\": {HIDDEN}, \
         \"topk\": {TOPK}, \"iters\": {iters}, \"configs\": [{}]}}\n",
        json.join(", ")
    );
    if let Ok(path) = std::env::var("EP_BENCH_OUT") {
        std::fs::write(&path, &doc)?;
        println!("JSON written to {path}");
    } else {
        print!("{doc}");
    }
    Ok(())
}
