//! The NCCL baselines of the bf16 dispatch, counted like it: "rows only" (a grouped
//! send/recv of exactly the dispatched rows, already packed) and "full dispatch" (what a user
//! writes with NCCL, timed end to end).

#[cfg(feature = "nccl")]
use cudarc::driver::{CudaEvent, CudaSlice};
#[cfg(feature = "nccl")]
use half::bf16;

#[cfg(feature = "nccl")]
use crate::common::flush_l2;
use crate::common::{BoxError, Node};
#[cfg(feature = "nccl")]
use crate::report::summarize;
use crate::report::Baseline;
use crate::state::RankState;
#[cfg(feature = "nccl")]
use crate::state::{EXPERTS, HIDDEN, TOKENS, TOPK};
#[cfg(feature = "nccl")]
use crate::timing::{event, median};
#[cfg(feature = "nccl")]
use ep_kernels::layout::ExpertPlacement;

/// The NCCL baselines `(rows only, full dispatch)`; both `None` without the `nccl` feature.
#[cfg(not(feature = "nccl"))]
pub fn baselines(
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
pub fn baselines(
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
pub fn nccl<T>(r: Result<T, cudarc::nccl::result::NcclError>) -> Result<T, BoxError> {
    r.map_err(|e| format!("NCCL: {e:?}").into())
}

/// "Rows only": an NCCL grouped send/recv all-to-all moving exactly the dispatched rows,
/// already packed per destination (no layout, no count exchange, no packing), timed with CUDA
/// events per rank around the group.
#[cfg(feature = "nccl")]
pub fn nccl_rows_only(
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
pub struct FullDispatchRank {
    /// Output of the layout kernel.
    pub layout: ep_kernels::layout::DeviceDispatchLayout,
    /// `[R, R]` all-gathered `num_tokens_per_rank`: row `s` = what rank `s` sends to each rank.
    pub counts: CudaSlice<i32>,
    /// `[send rows]` token ids, grouped by destination rank (token order within a group).
    pub index: CudaSlice<i32>,
    /// `[send rows, H]` the gathered rows, grouped by destination.
    pub send_x: CudaSlice<bf16>,
    /// `[recv rows, H]` the received rows, grouped by source rank (token order within one).
    pub recv_x: CudaSlice<bf16>,
    /// Host copies made at the synchronisation point.
    pub counts_host: Vec<i32>,
    pub in_rank_host: Vec<u8>,
    pub index_host: Vec<i32>,
    /// Rows sent to each rank / received from each rank, learned from `counts_host`.
    pub send_counts: Vec<usize>,
    pub recv_counts: Vec<usize>,
}

/// From the all-gathered counts and this rank's `is_token_in_rank`, fills the send/receive
/// sizes and the send index list (tokens grouped by destination, in token order), checking
/// that the two agree.
#[cfg(feature = "nccl")]
pub fn build_send_index(rank: usize, r: usize, f: &mut FullDispatchRank) -> Result<(), BoxError> {
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
pub fn nccl_full_dispatch(
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
pub fn check_full_dispatch(
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
