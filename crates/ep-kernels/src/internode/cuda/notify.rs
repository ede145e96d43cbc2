//! Launchers of `notify.cu`: the op barrier (with the count exchange of a fresh dispatch),
//! the host's poll of the receive counts, and the signal kernel. The routing checks and the
//! read of the counts are the ones the intranode notify shares ([`crate::notify`]).

use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::buffer::{InBuffer, InternodeBuffer, SignalTarget};
use crate::cuda::{assert_params_layout, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::notify::{poll_recv_counts, RecvCounts, Routing};

/// Mirror of `NotifyParams` in notify.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct NotifyParams {
    b: InBuffer,
    seq: u64,
    num_tokens_per_rank: CUdeviceptr,
    num_tokens_per_node: CUdeviceptr,
    num_tokens_per_expert: CUdeviceptr,
    is_token_in_rank: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    block_count: CUdeviceptr,
    node_send_index: CUdeviceptr,
    send_head: CUdeviceptr,
    recv_counter: CUdeviceptr,
    expert_counter: CUdeviceptr,
    num_tokens: i32,
    num_experts: i32,
    expert_alignment: i32,
    with_counts: i32,
}
assert_params_layout!(
    NotifyParams,
    232;
    b = 0, seq = 128, num_tokens_per_rank = 136, num_tokens_per_node = 144,
    num_tokens_per_expert = 152, is_token_in_rank = 160, rank_prefix_matrix = 168,
    block_count = 176, node_send_index = 184, send_head = 192, recv_counter = 200,
    expert_counter = 208, num_tokens = 216, num_experts = 220, expert_alignment = 224,
    with_counts = 228,
);
// SAFETY: repr(C) plain data mirroring `NotifyParams` (size asserted on both sides).
unsafe impl KernelParams for NotifyParams {}

/// Mirror of `SignalParams` in notify.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SignalParams {
    b: InBuffer,
    seq: u64,
    word_offset: u64,
    first: i32,
    stride: i32,
    count: i32,
    pad: i32,
}
assert_params_layout!(
    SignalParams,
    160;
    b = 0, seq = 128, word_offset = 136, first = 144, stride = 148, count = 152, pad = 156,
);
// SAFETY: repr(C) plain data mirroring `SignalParams`.
unsafe impl KernelParams for SignalParams {}

/// The count exchange of a fresh dispatch: this rank's layout (`T` tokens, `R` ranks, `N`
/// nodes, `E` experts, `P` GPUs per node) and the outputs the notify kernel writes.
#[derive(Debug)]
pub struct NotifyCounts<'a> {
    /// `[R]` tokens this rank sends to each rank.
    pub num_tokens_per_rank: CudaView<'a, i32>,
    /// `[N]` tokens this rank sends to each node.
    pub num_tokens_per_node: CudaView<'a, i32>,
    /// `[E]` (token, expert) pairs per expert.
    pub num_tokens_per_expert: CudaView<'a, i32>,
    /// `[T, R]` 0/1 bytes.
    pub is_token_in_rank: CudaView<'a, u8>,
    /// `T`.
    pub num_tokens: usize,
    /// `E` (a multiple of `R`, at most `MAX_LOCAL_EXPERTS` per rank).
    pub num_experts: usize,
    /// Per-expert receive counts are rounded up to a multiple of this (>= 1).
    pub expert_alignment: usize,
    /// Out: `[R, R]` inclusive prefix over sources (row = source, column = destination).
    pub rank_prefix_matrix: CudaViewMut<'a, i32>,
    /// Out: `[P, N]` messages of home `(n, j)` for this rank's node (block `(j, n)`).
    pub block_count: CudaViewMut<'a, i32>,
    /// Out: `[T, N]` ([`crate::internode::node_send_index`]).
    pub node_send_index: CudaViewMut<'a, i32>,
    /// Out: `[T, R]` the row each token takes in each destination's `recv_x` (`-1`: not sent).
    pub send_head: CudaViewMut<'a, i32>,
}

/// Launches the op barrier on `stream` (every rank must launch it for every op, in the same
/// order) and returns the op's sequence number. With `counts` (a fresh dispatch) it exchanges
/// the layouts: the host then polls [`InternodeBuffer::recv_counts`].
pub fn notify_cuda(
    stream: &CudaStream,
    buffer: &InternodeBuffer,
    counts: Option<NotifyCounts<'_>>,
) -> Result<u64> {
    let l = buffer.layout();
    let (r, n, p) = (l.num_ranks, l.num_nodes(), l.gpus_per_node);
    let mut params = NotifyParams {
        b: buffer.view(stream),
        seq: 0,
        num_tokens_per_rank: 0,
        num_tokens_per_node: 0,
        num_tokens_per_expert: 0,
        is_token_in_rank: 0,
        rank_prefix_matrix: 0,
        block_count: 0,
        node_send_index: 0,
        send_head: 0,
        recv_counter: buffer.recv_counter.device_ptr(),
        expert_counter: buffer.expert_counter.device_ptr(),
        num_tokens: 0,
        num_experts: 0,
        expert_alignment: 1,
        with_counts: 0,
    };
    let mut guards = Vec::new();
    if let Some(c) = &counts {
        let t = c.num_tokens;
        l.check_op(t, None, None)?;
        let routing = Routing {
            num_tokens_per_rank: &c.num_tokens_per_rank,
            num_tokens_per_expert: &c.num_tokens_per_expert,
            is_token_in_rank: &c.is_token_in_rank,
            num_tokens: t,
            num_experts: c.num_experts,
            expert_alignment: c.expert_alignment,
        };
        routing.check(r)?;
        Error::check_len("num_tokens_per_node", n, c.num_tokens_per_node.len())?;
        Error::check_len("rank_prefix_matrix", r * r, c.rank_prefix_matrix.len())?;
        Error::check_len("block_count", p * n, c.block_count.len())?;
        Error::check_len("node_send_index", t * n, c.node_send_index.len())?;
        Error::check_len("send_head", t * r, c.send_head.len())?;
        let (rt, gr) = routing.params(stream)?;
        let (b, g0) = c.num_tokens_per_node.device_ptr(stream);
        let (rpm, g1) = c.rank_prefix_matrix.device_ptr(stream);
        let (bc, g2) = c.block_count.device_ptr(stream);
        let (nsi, g3) = c.node_send_index.device_ptr(stream);
        let (sh, g4) = c.send_head.device_ptr(stream);
        guards.extend(gr);
        guards.extend([g0, g1, g2, g3, g4]);
        params.num_tokens_per_rank = rt.num_tokens_per_rank;
        params.num_tokens_per_node = b;
        params.num_tokens_per_expert = rt.num_tokens_per_expert;
        params.is_token_in_rank = rt.is_token_in_rank;
        params.rank_prefix_matrix = rpm;
        params.block_count = bc;
        params.node_send_index = nsi;
        params.send_head = sh;
        params.num_tokens = rt.num_tokens;
        params.num_experts = rt.num_experts;
        params.expert_alignment = rt.expert_alignment;
        params.with_counts = 1;
        buffer.recv_counter.fill(-1);
        buffer.expert_counter.fill(-1);
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(super::buffer::NOTIFY_FILE, "internode_notify")?;
    params.seq = buffer.next_seq();
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `NotifyParams`; the views hold exactly the elements the kernel
    // touches (checked above); the host-mapped counters hold 1 + R and MAX_LOCAL_EXPERTS
    // words and live as long as the buffer; the symmetric buffer and peer table are live.
    unsafe { kernel.launch(stream, cfg, params) }?;
    drop(guards);
    Ok(params.seq)
}

/// Launches the signal kernel: `seq` into the word of `target` on its ranks, after what the
/// stream ran before.
pub(super) fn signal_cuda(
    stream: &CudaStream,
    buffer: &InternodeBuffer,
    seq: u64,
    target: SignalTarget,
) -> Result<()> {
    let (word_offset, first, stride, count) = buffer.signal_target(target);
    let params = SignalParams {
        b: buffer.view(stream),
        seq,
        word_offset,
        first,
        stride,
        count,
        pad: 0,
    };
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(super::buffer::NOTIFY_FILE, "internode_signal")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `SignalParams`; the word offset lies in the header of every
    // rank's buffer (same layout), and the ranks are in `0..R`.
    unsafe { kernel.launch(stream, cfg, params) }
}

impl InternodeBuffer {
    /// Polls the counts the notify kernel of a fresh dispatch writes (`num_local_experts`
    /// per-expert words), failing with the rank a device wait timed out on, or after the
    /// timeout plus a grace period.
    pub fn recv_counts(&self, num_local_experts: usize, timeout: Duration) -> Result<RecvCounts> {
        let r = self.layout().num_ranks;
        poll_recv_counts(
            &self.recv_counter,
            &self.expert_counter,
            r,
            num_local_experts,
            timeout,
            || self.check_error(),
            |_| Error::PeerTimeout {
                rank: (0..r).find(|&p| p != self.rank()).unwrap_or(0),
                kernel: "internode_notify",
            },
        )
    }
}
