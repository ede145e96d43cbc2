//! Timing one op on every rank: the launches of both transfer paths, CUDA events around each
//! iteration after an L2 flush, and the median per rank.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use ep_kernels::intranode::{
    cached_notify_cuda, ce_combine_cuda, ce_dispatch_cuda, combine_cuda, dispatch_cuda,
    CeCombineArgs, CeConfig, CeDispatchArgs, CombineArgs, Config, CopyStreams, DispatchArgs,
};

use crate::common::{flush_l2, BoxError, Node};
use crate::state::{dispatch_views, Handle, RankState, EXPERTS, HIDDEN, TOPK};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    DispatchBf16,
    DispatchFp8,
    Combine,
    CeDispatchBf16,
    CeDispatchFp8,
    CeCombine,
}

impl Op {
    pub fn name(self) -> &'static str {
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

pub fn median(v: &mut [f32]) -> f32 {
    v.sort_by(f32::total_cmp);
    if v.is_empty() {
        f32::NAN
    } else {
        v[v.len() / 2]
    }
}

pub fn launch_dispatch(
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
            worst_case: false,
        },
    )?;
    Ok(())
}

pub fn launch_combine(
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
            bias: None,
            combined_x: st.combined.as_view_mut(),
            combined_topk_weights: None,
            num_recv_tokens: n,
            hidden: HIDDEN,
            num_topk: 0,
        },
    )?;
    Ok(())
}

pub fn launch_ce_dispatch(
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

pub fn launch_ce_combine(
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
            bias: None,
            combined_x: st.combined.as_view_mut(),
            combined_topk_weights: None,
            hidden: HIDDEN,
            num_topk: 0,
        },
    )?;
    Ok(())
}

pub fn event(stream: &Arc<CudaStream>) -> Result<CudaEvent, BoxError> {
    Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Times `op` with `config` (a dispatch is run first for combine, to fill the handle).
/// Returns per-rank median milliseconds.
#[allow(clippy::too_many_arguments)]
pub fn time_op(
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
