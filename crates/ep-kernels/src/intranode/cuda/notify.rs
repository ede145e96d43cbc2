//! Launchers of the notify kernels (`notify.cu`): the count exchange before a fresh dispatch,
//! and the barrier / counter reset before a cached dispatch and every combine.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig};

use super::checks::{check_prefix_matrices, ring_sizes};
use super::{to_i32, Config, HostMappedI32, PeerBuffers, MAX_NVL_RANKS};
use crate::cuda::{assert_params_layout, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::notify::Routing;

/// The cubin of `notify.cu`.
const FILE: &str = "intranode/notify";
/// Threads of the notify kernels (`kNotifyThreads`).
const NOTIFY_THREADS: u32 = 256;

/// Errors unless `got >= needed` (a host-mapped counter may hold more words than the op uses).
fn check_min_len(arg: &'static str, needed: usize, got: usize) -> Result<()> {
    if got < needed {
        return Err(Error::invalid(
            arg,
            format!("{got} words"),
            format!("needs at least {needed}"),
        ));
    }
    Ok(())
}

/// Mirror of `NotifyParams` in notify.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct NotifyParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    num_tokens_per_rank: CUdeviceptr,
    num_tokens_per_expert: CUdeviceptr,
    is_token_in_rank: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    channel_prefix_matrix: CUdeviceptr,
    moe_recv_counter: CUdeviceptr,
    moe_recv_expert_counter: CUdeviceptr,
    error_info: CUdeviceptr,
    send_index: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    num_experts: i32,
    num_channels: i32,
    expert_alignment: i32,
}
assert_params_layout!(
    NotifyParams,
    168;
    buffer_ptrs = 0, num_tokens_per_rank = 64, num_tokens_per_expert = 72, is_token_in_rank = 80,
    rank_prefix_matrix = 88, channel_prefix_matrix = 96, moe_recv_counter = 104,
    moe_recv_expert_counter = 112, error_info = 120, send_index = 128, timeout_ns = 136,
    rank = 144, num_ranks = 148, num_tokens = 152, num_experts = 156, num_channels = 160,
    expert_alignment = 164,
);
// SAFETY: repr(C) plain data mirroring `NotifyParams` in notify.cu (size asserted on both
// sides).
unsafe impl KernelParams for NotifyParams {}

/// Mirror of `CachedNotifyParams` in notify.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CachedNotifyParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
}
assert_params_layout!(
    CachedNotifyParams,
    88;
    buffer_ptrs = 0, error_info = 64, timeout_ns = 72, rank = 80, num_ranks = 84,
);
// SAFETY: repr(C) plain data mirroring `CachedNotifyParams` in notify.cu.
unsafe impl KernelParams for CachedNotifyParams {}

/// Inputs and outputs of [`notify_dispatch_cuda`] (device views; `T` tokens, `R` ranks,
/// `E` experts, `L = E / R`, `C` channels).
#[derive(Debug)]
pub struct NotifyArgs<'a> {
    /// `[R]` tokens this rank sends to each rank (from the layout kernel).
    pub num_tokens_per_rank: CudaView<'a, i32>,
    /// `[E]` (token, expert) pairs this rank sends to each expert.
    pub num_tokens_per_expert: CudaView<'a, i32>,
    /// `[T, R]` 0/1 bytes.
    pub is_token_in_rank: CudaView<'a, u8>,
    /// Number of tokens `T` of this rank.
    pub num_tokens: usize,
    /// Number of experts `E` (multiple of `R`, `E / R <= MAX_LOCAL_EXPERTS`).
    pub num_experts: usize,
    /// Per-expert receive counts are rounded up to a multiple of this (>= 1).
    pub expert_alignment: usize,
    /// Out: `[R, R]` inclusive prefix over sources (see [`crate::intranode::NotifyOutput`]).
    pub rank_prefix_matrix: CudaViewMut<'a, i32>,
    /// Out: `[R, C]` this rank's per-destination inclusive channel prefix
    /// (== [`crate::intranode::channel_prefix_matrix`]).
    pub channel_prefix_matrix: CudaViewMut<'a, i32>,
    /// Out (host-mapped, set to -1 by the caller before the launch, at least `1 + R` words):
    /// word 0 = tokens received, word `1 + s` = tokens received from source `s` (written
    /// before word 0). `None` when the host will not read them (a dispatch into worst-case
    /// outputs): a late write could otherwise land in a later notify's polled words.
    pub moe_recv_counter: Option<&'a HostMappedI32>,
    /// Out (host-mapped, set to -1 by the caller): `[L]` aligned tokens per local expert;
    /// `None` as `moe_recv_counter`.
    pub moe_recv_expert_counter: Option<&'a HostMappedI32>,
    /// Out (optional): `[T, R]` index of each token among this rank's tokens sent to each
    /// destination, in token order (`-1` = not sent); the copy-engine path needs it
    /// (`crate::intranode::send_slots` minus the source's block offset).
    pub send_index: Option<CudaViewMut<'a, i32>>,
}

/// Launches the notify step on `stream` for this rank (every rank of the node must launch it
/// with the same `num_experts`, `expert_alignment` and channel count).
///
/// Writes `rank_prefix_matrix` and `channel_prefix_matrix` (device), and the receive totals to
/// the mapped counters, which the host polls with [`crate::notify::poll_recv_counts`] (or word
/// by word with [`HostMappedI32::poll_nonneg`]). The routing checks and fields are the ones
/// the internode notify shares ([`crate::notify`]).
pub fn notify_dispatch_cuda(
    stream: &CudaStream,
    buffers: &PeerBuffers,
    config: &Config,
    args: NotifyArgs<'_>,
) -> Result<()> {
    let (r, c) = ring_sizes(config, buffers)?;
    let t = args.num_tokens;
    let routing = Routing {
        num_tokens_per_rank: &args.num_tokens_per_rank,
        num_tokens_per_expert: &args.num_tokens_per_expert,
        is_token_in_rank: &args.is_token_in_rank,
        num_tokens: t,
        num_experts: args.num_experts,
        expert_alignment: args.expert_alignment,
    };
    let l = routing.check(r)?;
    check_prefix_matrices(
        r,
        c,
        args.rank_prefix_matrix.len(),
        args.channel_prefix_matrix.len(),
    )?;
    if let Some(m) = args.moe_recv_counter {
        check_min_len("moe_recv_counter", 1 + r, m.len())?;
    }
    if let Some(si) = &args.send_index {
        Error::check_len("send_index", t * r, si.len())?;
    }
    if let Some(m) = args.moe_recv_expert_counter {
        check_min_len("moe_recv_expert_counter", l, m.len())?;
    }

    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "intranode_notify_dispatch")?;
    let (rt, _gr) = routing.params(stream)?;
    let (rpm, _g0) = args.rank_prefix_matrix.device_ptr(stream);
    let (cpm, _g1) = args.channel_prefix_matrix.device_ptr(stream);
    let (send_index, _g2) = match &args.send_index {
        Some(si) => {
            let (p, g) = si.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    let params = NotifyParams {
        buffer_ptrs: buffers.ptrs(),
        num_tokens_per_rank: rt.num_tokens_per_rank,
        num_tokens_per_expert: rt.num_tokens_per_expert,
        is_token_in_rank: rt.is_token_in_rank,
        rank_prefix_matrix: rpm,
        channel_prefix_matrix: cpm,
        moe_recv_counter: args.moe_recv_counter.map_or(0, HostMappedI32::device_ptr),
        moe_recv_expert_counter: args
            .moe_recv_expert_counter
            .map_or(0, HostMappedI32::device_ptr),
        error_info: buffers.error_info(),
        send_index,
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank())?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: rt.num_tokens,
        num_experts: rt.num_experts,
        num_channels: to_i32("num_channels", c)?,
        expert_alignment: rt.expert_alignment,
    };
    let cfg = LaunchConfig {
        grid_dim: (1 + r as u32, 1, 1),
        block_dim: (NOTIFY_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `NotifyParams`; the views are checked to hold exactly the
    // elements the kernel touches (R, E, T*R, R*R, R*C); the mapped counters hold >= 1 and
    // >= L words and outlive the launch (the caller polls them); `send_index` (if any) holds
    // T*R words; the NVLink buffers are valid
    // per `PeerBuffers::new`'s contract and the kernel touches only their headers.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Launches the cached notify (barrier, reset of this rank's channel counters, barrier) on
/// `stream`: before a dispatch that reuses a handle, and before every combine.
pub fn cached_notify_cuda(stream: &CudaStream, buffers: &PeerBuffers) -> Result<()> {
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "intranode_cached_notify")?;
    let params = CachedNotifyParams {
        buffer_ptrs: buffers.ptrs(),
        error_info: buffers.error_info(),
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank())?,
        num_ranks: to_i32("num_ranks", buffers.num_ranks())?,
    };
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (NOTIFY_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `CachedNotifyParams`; the kernel touches only the headers of the
    // NVLink buffers (valid per `PeerBuffers::new`) and the error record.
    unsafe { kernel.launch(stream, cfg, params) }
}
