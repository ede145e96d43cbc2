//! The benchmark's fixed shape and each rank's device state: inputs with their routing and
//! layout, receive buffers, and the per-config notify handles.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use ep_kernels::intranode::{
    notify_dispatch_cuda, Config, HostMappedI32, NotifyArgs, Payload, RecvPayload, RecvTopK, TopK,
};
use ep_kernels::layout::{get_dispatch_layout, ExpertPlacement};
use ep_kernels::FP8_GROUP;
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::Rng;

use crate::common::{l2_flush_buffer, BoxError, Node};

pub const TOKENS: usize = 4096;
pub const HIDDEN: usize = 7168;
pub const TOPK: usize = 8;
pub const EXPERTS: usize = 256;

/// One rank's device state for the benchmark.
pub struct RankState {
    pub x: CudaSlice<bf16>,
    pub x_fp8: CudaSlice<F8E4M3>,
    pub scales: CudaSlice<f32>,
    pub topk_idx: CudaSlice<i64>,
    pub topk_w: CudaSlice<f32>,
    pub in_rank: CudaSlice<u8>,
    pub per_rank: CudaSlice<i32>,
    pub per_expert: CudaSlice<i32>,
    pub num_recv: usize,
    pub recv_x: CudaSlice<bf16>,
    pub recv_fp8: CudaSlice<F8E4M3>,
    pub recv_scales: CudaSlice<f32>,
    pub recv_src: CudaSlice<i32>,
    pub recv_topk_idx: CudaSlice<i64>,
    pub recv_topk_w: CudaSlice<f32>,
    pub combined: CudaSlice<bf16>,
    /// Scratch overwritten before every timed iteration to flush the L2 cache.
    pub flush: CudaSlice<u8>,
    /// Tokens this rank sends to each rank (NCCL baseline).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub send_counts: Vec<usize>,
    /// Tokens each rank sends to this one (NCCL baseline).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub recv_counts: Vec<usize>,
}

/// The per-config handle (depends on the channel count).
pub struct Handle {
    pub rank_prefix: CudaSlice<i32>,
    pub channel_prefix: CudaSlice<i32>,
    pub channel_offset: CudaSlice<i32>,
    pub send_head: CudaSlice<i32>,
    /// Copy-engine path: notify's `send_index` and the rows from each source.
    pub send_index: CudaSlice<i32>,
    pub per_source: Vec<usize>,
}

pub fn setup(node: &Node, rng: &mut StdRng) -> Result<Vec<RankState>, BoxError> {
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
pub fn notify_all(
    node: &Node,
    states: &[RankState],
    config: &Config,
) -> Result<Vec<Handle>, BoxError> {
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
                moe_recv_counter: Some(&counters[rank].0),
                moe_recv_expert_counter: Some(&counters[rank].1),
                send_index: Some(h.send_index.as_view_mut()),
            },
        )?;
        let n = counters[rank].0.poll_nonneg(
            0,
            std::time::Duration::from_secs(30),
            rank,
            ep_kernels::intranode::NOTIFY_KERNEL,
        )? as usize;
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
pub struct DispatchViews<'a> {
    pub x: Payload<'a>,
    pub topk: TopK<'a>,
    /// `[T, R]` routing bytes (the ring path's `is_token_in_rank`; the copy-engine path uses
    /// notify's `send_index` instead).
    pub in_rank: CudaView<'a, u8>,
    pub recv_x: RecvPayload<'a>,
    pub recv_src_idx: CudaViewMut<'a, i32>,
    pub recv_topk: RecvTopK<'a>,
}

/// Builds the payload (bf16, or fp8 with its scales), routing and receive views of `st` for a
/// dispatch of all its tokens into its `num_recv` receive rows.
pub fn dispatch_views(st: &mut RankState, fp8: bool) -> DispatchViews<'_> {
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
