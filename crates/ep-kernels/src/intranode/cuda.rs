//! Typed launchers of the intranode (NVLink) normal-mode kernels (`intranode.cu`); host twins:
//! [`super::host`].
//!
//! One op on every rank of a node, each rank on its own stream (the kernels of different ranks
//! wait on each other, so they must run concurrently):
//!
//! 1. [`notify_dispatch_cuda`] (fresh routing) or [`cached_notify_cuda`] (reusing a handle);
//!    after `notify_dispatch_cuda` the host polls the mapped counters
//!    ([`HostMappedI32::poll_nonneg`]) and allocates the receive buffers;
//! 2. [`dispatch_cuda`];
//! 3. [`cached_notify_cuda`], then [`combine_cuda`].
//!
//! After each op (or at least before trusting its outputs) the host checks the error record with
//! [`PeerBuffers::check_error`]: a device wait that timed out is reported as
//! [`Error::PeerTimeout`]. The NVLink buffer layout is described at the top of `intranode.cu`.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{
    CudaContext, CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig, SyncOnDrop,
};

use crate::cuda::{check_align, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::FP8_GROUP;

/// The cubin of `intranode.cu`.
pub(crate) const FILE: &str = "intranode/intranode";
/// Most ranks of one node (`kMaxRanks`).
pub const MAX_NVL_RANKS: usize = 8;
/// Most channels, `num_sms / 2` (`kMaxChannels`).
pub const MAX_CHANNELS: usize = 128;
/// Most local experts per rank the notify step accepts (`kMaxLocalExperts`).
pub const MAX_LOCAL_EXPERTS: usize = 1024;
/// Offset of the first ring in an NVLink buffer (`kRingBase`): the header before it holds the
/// barrier signals, channel counters and notify counts.
pub const RING_BASE: usize = 65536;
/// Bytes at the start of every NVLink buffer that must be zero before first use
/// (barrier signals and counters).
pub const HEADER_ZERO_BYTES: usize = RING_BASE;
/// Threads of the notify kernels (`kNotifyThreads`).
const NOTIFY_THREADS: u32 = 256;
/// Threads of the dispatch kernel blocks (`kDispatchThreads`).
const DISPATCH_THREADS: u32 = 768;
/// Dynamic shared memory of the dispatch kernel blocks (`kDispatchSmemBytes`: the per-warp
/// bulk-copy staging buffers; unused when the kernel is built with `EP_DISPATCH_TMA=0`).
const DISPATCH_SMEM_BYTES: u32 = 224_256;
/// Threads of the combine kernel blocks (`kCombineThreads`).
const COMBINE_THREADS: u32 = 768;
/// Tokens the combine home side consumes per round (`kCombineWarps`).
pub const COMBINE_ROUND_TOKENS: usize = 24;
/// Default device-side wait timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Kernel names by the ids the device writes into error records.
const KERNEL_NAMES: [&str; 8] = [
    "intranode_unknown",
    "intranode_notify_dispatch",
    "intranode_cached_notify",
    "intranode_dispatch",
    "intranode_combine",
    "intranode_ce_wait",
    "intranode_ce_combine",
    "intranode_ce_dispatch",
];

/// Launch configuration of dispatch and combine.
///
/// `num_sms` SMs run `num_sms / 2` channels (one sending and one receiving block each); every
/// (channel, peer) pair has a ring of `num_max_recv_tokens` token slots in the receiver's NVLink
/// buffer, filled in chunks of up to `num_max_send_tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// SMs used (even, `2..=2 * MAX_CHANNELS`).
    pub num_sms: usize,
    /// Tokens a sender copies before publishing its tail (chunk size).
    pub num_max_send_tokens: usize,
    /// Ring capacity in tokens per (channel, peer).
    pub num_max_recv_tokens: usize,
}

impl Config {
    /// Checks the invariants: `num_sms` even in `[2, 2 * MAX_CHANNELS]`,
    /// `1 <= num_max_send_tokens <= num_max_recv_tokens`.
    pub fn new(
        num_sms: usize,
        num_max_send_tokens: usize,
        num_max_recv_tokens: usize,
    ) -> Result<Self> {
        if num_sms < 2 || num_sms % 2 != 0 || num_sms > 2 * MAX_CHANNELS {
            return Err(Error::invalid(
                "num_sms",
                num_sms,
                format!("must be even and in [2, {}]", 2 * MAX_CHANNELS),
            ));
        }
        if num_max_send_tokens == 0 {
            return Err(Error::invalid(
                "num_max_send_tokens",
                0,
                "must be at least 1",
            ));
        }
        if num_max_recv_tokens < num_max_send_tokens || num_max_recv_tokens > (1 << 20) {
            return Err(Error::invalid(
                "num_max_recv_tokens",
                num_max_recv_tokens,
                format!("must be in [num_max_send_tokens = {num_max_send_tokens}, 2^20]"),
            ));
        }
        Ok(Self {
            num_sms,
            num_max_send_tokens,
            num_max_recv_tokens,
        })
    }

    /// Tuned dispatch defaults for `num_ranks` ranks: 24 SMs, 256-token rings, chunks of 24
    /// tokens for 2 ranks, 32 for 3-4, 16 beyond (measured on 2/4 x H200, 4096 x 7168 tokens,
    /// top-8 of 256).
    pub fn dispatch_default(num_ranks: usize) -> Self {
        let chunk = match num_ranks {
            0..=2 => 24,
            3..=4 => 32,
            _ => 16,
        };
        Self {
            num_sms: 24,
            num_max_send_tokens: chunk,
            num_max_recv_tokens: 256,
        }
    }

    /// Tuned combine defaults for `num_ranks` ranks: 24 SMs, 256-token rings, chunks of 12
    /// tokens up to 4 ranks, 6 beyond (measured as for [`Config::dispatch_default`]).
    pub fn combine_default(num_ranks: usize) -> Self {
        let chunk = if num_ranks <= 4 { 12 } else { 6 };
        Self {
            num_sms: 24,
            num_max_send_tokens: chunk,
            num_max_recv_tokens: 256,
        }
    }

    /// Number of channels, `num_sms / 2`.
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    fn validate(&self) -> Result<()> {
        Self::new(
            self.num_sms,
            self.num_max_send_tokens,
            self.num_max_recv_tokens,
        )
        .map(|_| ())
    }
}

fn align16(v: usize) -> usize {
    v.div_ceil(16) * 16
}

/// Bytes of one dispatch ring (mirrors `RingLayout::dispatch`).
fn dispatch_ring_bytes(q: usize, row_bytes: usize, topk: usize, scales: usize) -> usize {
    align16(q * row_bytes) + align16(q * 4) + 2 * align16(q * topk * 4) + align16(q * scales * 4)
}

/// Bytes of one combine ring (mirrors `RingLayout::combine`).
fn combine_ring_bytes(q: usize, row_bytes: usize, topk: usize) -> usize {
    align16(q * row_bytes) + align16(q * topk * 4)
}

/// NVLink buffer bytes each rank needs for bf16 or fp8 dispatch and bf16 combine of rows of
/// `hidden` channels with `num_topk` experts per token among `num_ranks` ranks under `config`
/// (use the larger of the dispatch and combine configs' `num_sms` and ring sizes).
pub fn buffer_size_hint(
    hidden: usize,
    num_topk: usize,
    num_ranks: usize,
    config: &Config,
) -> usize {
    let q = config.num_max_recv_tokens;
    let bf16 = dispatch_ring_bytes(q, hidden * 2, num_topk, 0);
    let fp8 = dispatch_ring_bytes(q, hidden, num_topk, hidden.div_ceil(FP8_GROUP));
    let comb = combine_ring_bytes(q, hidden * 2, num_topk);
    RING_BASE + config.num_channels() * num_ranks * bf16.max(fp8).max(comb)
}

/// The NVLink buffers of one node as seen from one rank, plus that rank's error record.
///
/// Every rank allocates one buffer of at least [`buffer_size_hint`] bytes on its GPU, zeroes
/// its first [`HEADER_ZERO_BYTES`] once, and maps every peer's buffer into its context (peer
/// access in one process, CUDA IPC across processes).
#[derive(Debug, Clone, Copy)]
pub struct PeerBuffers {
    rank: usize,
    num_ranks: usize,
    ptrs: [u64; MAX_NVL_RANKS],
    bytes: usize,
    error_info: u64,
    timeout: Duration,
}

impl PeerBuffers {
    /// Describes the node's buffers from rank `rank`'s point of view: `ptrs[r]` is rank `r`'s
    /// buffer as a device address valid in this rank's context, each `bytes` long;
    /// `error_info` is the device address of this rank's error record (4 `i32`, host-mapped or
    /// device memory; see [`HostMappedI32`]). Waits time out after [`DEFAULT_TIMEOUT`].
    ///
    /// # Safety
    ///
    /// Every pointer must stay valid (allocated, mapped, peer-accessible from this rank's
    /// context) for as long as kernels launched with this value may run; each buffer must be
    /// at least `bytes` long with its first [`HEADER_ZERO_BYTES`] zeroed before the first op;
    /// all ranks must describe the same buffers in the same order; `ptrs[rank]` must be
    /// this rank's own buffer; the buffers must be used by one op at a time. Stream-ordered
    /// (`cuMemAllocAsync` pool) allocations are not reachable through peer access unless the
    /// pool grants it: allocate with `cuMemAlloc` or export through CUDA IPC.
    pub unsafe fn new(rank: usize, ptrs: &[u64], bytes: usize, error_info: u64) -> Result<Self> {
        let num_ranks = ptrs.len();
        if num_ranks == 0 || num_ranks > MAX_NVL_RANKS {
            return Err(Error::invalid(
                "ptrs",
                format!("{num_ranks} buffers"),
                format!("a node has 1 to {MAX_NVL_RANKS} ranks"),
            ));
        }
        if rank >= num_ranks {
            return Err(Error::invalid(
                "rank",
                rank,
                format!("must be < num_ranks = {num_ranks}"),
            ));
        }
        if bytes < RING_BASE {
            return Err(Error::invalid(
                "bytes",
                bytes,
                format!("must be at least {RING_BASE}"),
            ));
        }
        for &p in ptrs {
            check_align("ptrs", p, 128)?;
        }
        check_align("error_info", error_info, 16)?;
        if error_info == 0 {
            return Err(Error::invalid("error_info", 0, "must be a device address"));
        }
        let mut all = [0u64; MAX_NVL_RANKS];
        all[..num_ranks].copy_from_slice(ptrs);
        Ok(Self {
            rank,
            num_ranks,
            ptrs: all,
            bytes,
            error_info,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Sets the device-side wait timeout (`Duration::ZERO` = wait forever).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks of the node.
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// Size of each buffer in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device-side wait timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Rank `r`'s buffer as this rank's context addresses it.
    pub(crate) fn ptr(&self, r: usize) -> u64 {
        self.ptrs[r]
    }

    /// The raw pointer table passed to kernels.
    pub(crate) fn ptrs(&self) -> [u64; MAX_NVL_RANKS] {
        self.ptrs
    }

    /// The device address of this rank's error record.
    pub(crate) fn error_info(&self) -> u64 {
        self.error_info
    }

    pub(crate) fn timeout_ns(&self) -> u64 {
        u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Turns an error record (read by the host after the op's stream has synchronised) into
    /// [`Error::PeerTimeout`]; `Ok` if it is clear. `record` is the 4 words at `error_info`:
    /// `{1 = timeout, awaited rank, kernel id, wait site}`.
    pub fn check_error(record: &[i32]) -> Result<()> {
        match record {
            [0, ..] => Ok(()),
            [_, rank, kernel, ..] => Err(Error::PeerTimeout {
                rank: usize::try_from(*rank).unwrap_or(usize::MAX),
                kernel: KERNEL_NAMES
                    .get(usize::try_from(*kernel).unwrap_or(0))
                    .copied()
                    .unwrap_or(KERNEL_NAMES[0]),
            }),
            _ => Err(Error::invalid(
                "record",
                format!("{record:?}"),
                "must hold 4 words",
            )),
        }
    }
}

/// `i32`s in page-locked host memory mapped into every context (`cuMemHostAlloc` with
/// `DEVICEMAP | PORTABLE`): the host reads what kernels write while they run.
#[derive(Debug)]
pub struct HostMappedI32 {
    host: *mut i32,
    device: CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is plain pinned memory owned by this value; access from several
// threads goes through volatile reads/writes of i32, which cannot tear.
unsafe impl Send for HostMappedI32 {}
// SAFETY: as above; `&self` methods only do volatile i32 reads/writes.
unsafe impl Sync for HostMappedI32 {}

impl HostMappedI32 {
    /// Allocates `len` (>= 1) words, all set to `fill`, while `ctx` is current.
    pub fn new(ctx: &Arc<CudaContext>, len: usize, fill: i32) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("len", 0, "must be at least 1"));
        }
        ctx.bind_to_thread()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: plain allocation of `len * 4` bytes; the memory is initialised below before
        // any read.
        let host = unsafe { cudarc::driver::result::malloc_host(len * 4, flags) }? as *mut i32;
        let mut device: CUdeviceptr = 0;
        // SAFETY: `host` was returned by cuMemHostAlloc with DEVICEMAP; `device` is a valid
        // out-pointer.
        let res = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) };
        let out = Self {
            host,
            device,
            len,
            ctx: ctx.clone(),
        };
        res.result()?;
        out.fill(fill);
        Ok(out)
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (at least one word).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The device address of word 0 (valid in every context).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device
    }

    /// Reads word `i` (volatile).
    pub fn get(&self, i: usize) -> i32 {
        assert!(
            i < self.len,
            "index {i} out of range for {} words",
            self.len
        );
        // SAFETY: in bounds of a live allocation; volatile because the device writes it.
        unsafe { self.host.add(i).read_volatile() }
    }

    /// Writes word `i` (volatile). Do not call while a kernel uses the words.
    pub fn set(&self, i: usize, v: i32) {
        assert!(
            i < self.len,
            "index {i} out of range for {} words",
            self.len
        );
        // SAFETY: in bounds of a live allocation.
        unsafe { self.host.add(i).write_volatile(v) }
    }

    /// Sets every word to `v`.
    pub fn fill(&self, v: i32) {
        (0..self.len).for_each(|i| self.set(i, v));
    }

    /// Every word.
    pub fn to_vec(&self) -> Vec<i32> {
        (0..self.len).map(|i| self.get(i)).collect()
    }

    /// Polls word `i` until it is `>= 0` (the notify kernel's counters start at `-1`), for at
    /// most `timeout`; returns the value, or [`Error::PeerTimeout`] naming `rank` and
    /// `notify_dispatch` if it never arrives.
    pub fn poll_nonneg(&self, i: usize, timeout: Duration, rank: usize) -> Result<i32> {
        let start = Instant::now();
        loop {
            let v = self.get(i);
            if v >= 0 {
                return Ok(v);
            }
            if start.elapsed() > timeout {
                return Err(Error::PeerTimeout {
                    rank,
                    kernel: KERNEL_NAMES[1],
                });
            }
            std::hint::spin_loop();
        }
    }
}

impl Drop for HostMappedI32 {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `host` came from cuMemHostAlloc and is freed once; no kernel may use it any
        // more (the owner drops it after its streams are done).
        let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut c_void) };
    }
}

pub(crate) fn to_i32(arg: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::invalid(arg, value, "must fit in an i32"))
}

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

// ---------------------------------------------------------------------------------------------
// notify
// ---------------------------------------------------------------------------------------------

/// Mirror of `NotifyParams` in intranode.cu.
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
const _: () = assert!(std::mem::size_of::<NotifyParams>() == 168);
// SAFETY: repr(C) plain data mirroring `NotifyParams` in intranode.cu (size asserted on both
// sides).
unsafe impl KernelParams for NotifyParams {}

/// Mirror of `CachedNotifyParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CachedNotifyParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
}
const _: () = assert!(std::mem::size_of::<CachedNotifyParams>() == 88);
// SAFETY: repr(C) plain data mirroring `CachedNotifyParams` in intranode.cu.
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
    /// Out: `[R, R]` inclusive prefix over sources (see [`super::host::NotifyOutput`]).
    pub rank_prefix_matrix: CudaViewMut<'a, i32>,
    /// Out: `[R, C]` this rank's per-destination inclusive channel prefix
    /// (== [`super::host::channel_prefix_matrix`]).
    pub channel_prefix_matrix: CudaViewMut<'a, i32>,
    /// Out (host-mapped, set to -1 by the caller before the launch, at least `1 + R` words):
    /// word 0 = tokens received, word `1 + s` = tokens received from source `s` (written
    /// before word 0).
    pub moe_recv_counter: &'a HostMappedI32,
    /// Out (host-mapped, set to -1 by the caller): `[L]` aligned tokens per local expert.
    pub moe_recv_expert_counter: &'a HostMappedI32,
    /// Out (optional): `[T, R]` index of each token among this rank's tokens sent to each
    /// destination, in token order (`-1` = not sent); the copy-engine path needs it
    /// (`super::host::send_slots` minus the source's block offset).
    pub send_index: Option<CudaViewMut<'a, i32>>,
}

/// Launches the notify step on `stream` for this rank (every rank of the node must launch it
/// with the same `num_experts`, `expert_alignment` and channel count).
///
/// Writes `rank_prefix_matrix` and `channel_prefix_matrix` (device), and the receive totals to
/// the mapped counters, which the host polls with [`HostMappedI32::poll_nonneg`].
pub fn notify_dispatch_cuda(
    stream: &CudaStream,
    buffers: &PeerBuffers,
    config: &Config,
    args: NotifyArgs<'_>,
) -> Result<()> {
    config.validate()?;
    let r = buffers.num_ranks;
    let c = config.num_channels();
    let t = args.num_tokens;
    if args.num_experts == 0 || args.num_experts % r != 0 {
        return Err(Error::invalid(
            "num_experts",
            args.num_experts,
            format!("must be a positive multiple of num_ranks = {r}"),
        ));
    }
    let l = args.num_experts / r;
    if l > MAX_LOCAL_EXPERTS {
        return Err(Error::invalid(
            "num_experts",
            args.num_experts,
            format!("num_experts / num_ranks must be <= {MAX_LOCAL_EXPERTS}"),
        ));
    }
    if args.expert_alignment == 0 {
        return Err(Error::invalid("expert_alignment", 0, "must be at least 1"));
    }
    Error::check_len("num_tokens_per_rank", r, args.num_tokens_per_rank.len())?;
    Error::check_len(
        "num_tokens_per_expert",
        args.num_experts,
        args.num_tokens_per_expert.len(),
    )?;
    Error::check_len("is_token_in_rank", t * r, args.is_token_in_rank.len())?;
    Error::check_len("rank_prefix_matrix", r * r, args.rank_prefix_matrix.len())?;
    Error::check_len(
        "channel_prefix_matrix",
        r * c,
        args.channel_prefix_matrix.len(),
    )?;
    check_min_len("moe_recv_counter", 1 + r, args.moe_recv_counter.len())?;
    if let Some(si) = &args.send_index {
        Error::check_len("send_index", t * r, si.len())?;
    }
    check_min_len(
        "moe_recv_expert_counter",
        l,
        args.moe_recv_expert_counter.len(),
    )?;

    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "intranode_notify_dispatch")?;
    let (ntpr, _g0) = args.num_tokens_per_rank.device_ptr(stream);
    let (ntpe, _g1) = args.num_tokens_per_expert.device_ptr(stream);
    let (itir, _g2) = args.is_token_in_rank.device_ptr(stream);
    let (rpm, _g3) = args.rank_prefix_matrix.device_ptr(stream);
    let (cpm, _g4) = args.channel_prefix_matrix.device_ptr(stream);
    let (send_index, _g5) = match &args.send_index {
        Some(si) => {
            let (p, g) = si.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    let params = NotifyParams {
        buffer_ptrs: buffers.ptrs,
        num_tokens_per_rank: ntpr,
        num_tokens_per_expert: ntpe,
        is_token_in_rank: itir,
        rank_prefix_matrix: rpm,
        channel_prefix_matrix: cpm,
        moe_recv_counter: args.moe_recv_counter.device_ptr(),
        moe_recv_expert_counter: args.moe_recv_expert_counter.device_ptr(),
        error_info: buffers.error_info,
        send_index,
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank)?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        num_experts: to_i32("num_experts", args.num_experts)?,
        num_channels: to_i32("num_channels", c)?,
        expert_alignment: to_i32("expert_alignment", args.expert_alignment)?,
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
        buffer_ptrs: buffers.ptrs,
        error_info: buffers.error_info,
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank)?,
        num_ranks: to_i32("num_ranks", buffers.num_ranks)?,
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

// ---------------------------------------------------------------------------------------------
// dispatch
// ---------------------------------------------------------------------------------------------

/// Mirror of `DispatchParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DispatchParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    x_scales: CUdeviceptr,
    topk_idx: CUdeviceptr,
    topk_weights: CUdeviceptr,
    is_token_in_rank: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    channel_prefix_matrix: CUdeviceptr,
    recv_x: CUdeviceptr,
    recv_x_scales: CUdeviceptr,
    recv_src_idx: CUdeviceptr,
    recv_topk_idx: CUdeviceptr,
    recv_topk_weights: CUdeviceptr,
    recv_channel_offset: CUdeviceptr,
    send_head: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    hidden_int4: i32,
    num_scales: i32,
    num_topk: i32,
    experts_per_rank: i32,
    num_channels: i32,
    num_max_send_tokens: i32,
    num_max_recv_tokens: i32,
}
const _: () = assert!(std::mem::size_of::<DispatchParams>() == 232);
// SAFETY: repr(C) plain data mirroring `DispatchParams` in intranode.cu.
unsafe impl KernelParams for DispatchParams {}

/// The token rows of a dispatch: bf16, or fp8 e4m3 bytes with per-128-channel f32 scales.
#[derive(Debug)]
pub enum Payload<'a> {
    /// `[T, H]` bf16 rows (`H % 8 == 0`).
    Bf16(CudaView<'a, half::bf16>),
    /// `[T, H]` e4m3 rows (`H % 128 == 0`) and their `[T, H / 128]` scales.
    Fp8 {
        /// The quantised rows.
        x: CudaView<'a, float8::F8E4M3>,
        /// The scales.
        scales: CudaView<'a, f32>,
    },
}

/// Receive buffers matching a [`Payload`].
#[derive(Debug)]
pub enum RecvPayload<'a> {
    /// `[N, H]` bf16.
    Bf16(CudaViewMut<'a, half::bf16>),
    /// `[N, H]` e4m3 and `[N, H / 128]` scales.
    Fp8 {
        /// The rows.
        x: CudaViewMut<'a, float8::F8E4M3>,
        /// The scales.
        scales: CudaViewMut<'a, f32>,
    },
}

/// Routing of the tokens being dispatched: global expert ids (`-1` = none) and weights.
#[derive(Debug)]
pub struct TopK<'a> {
    /// `[T, K]` i64.
    pub idx: CudaView<'a, i64>,
    /// `[T, K]` f32.
    pub weights: CudaView<'a, f32>,
}

/// Receive buffers of the routing: local expert ids (`-1` = not on this rank) and weights (0
/// where the id is `-1`), as [`super::host::localize_topk`].
#[derive(Debug)]
pub struct RecvTopK<'a> {
    /// `[N, K]` i64.
    pub idx: CudaViewMut<'a, i64>,
    /// `[N, K]` f32.
    pub weights: CudaViewMut<'a, f32>,
}

/// Inputs and outputs of [`dispatch_cuda`] (`T` tokens, `H` hidden, `K` top-k, `R` ranks,
/// `C` channels, `N` tokens received).
#[derive(Debug)]
pub struct DispatchArgs<'a> {
    /// The rows to send.
    pub x: Payload<'a>,
    /// Routing to send along (optional: cached dispatch of activations only).
    pub topk: Option<TopK<'a>>,
    /// Number of experts `E` (to localise expert ids; ignored without `topk`).
    pub num_experts: usize,
    /// `[T, R]` 0/1 bytes.
    pub is_token_in_rank: CudaView<'a, u8>,
    /// `[R, R]` from notify (or the handle).
    pub rank_prefix_matrix: CudaView<'a, i32>,
    /// `[R, C]` this rank's, from notify (or the handle).
    pub channel_prefix_matrix: CudaView<'a, i32>,
    /// Out: the received rows (`N` = `rank_prefix_matrix[R - 1][rank]` of them).
    pub recv_x: RecvPayload<'a>,
    /// Out: `[N]` index of each received token on its source rank.
    pub recv_src_idx: CudaViewMut<'a, i32>,
    /// Out: localised routing (required iff `topk` is given).
    pub recv_topk: Option<RecvTopK<'a>>,
    /// Out: `[R, C]` index in the receive buffers where source `s`'s channel-`c` tokens start.
    pub recv_channel_offset: CudaViewMut<'a, i32>,
    /// Out: `[T, R]` for each token and destination, its index among this channel's tokens
    /// sent to that destination, or `-1` (what combine needs).
    pub send_head: CudaViewMut<'a, i32>,
    /// Number of tokens `N` this rank receives (from notify or the handle).
    pub num_recv_tokens: usize,
    /// Hidden size `H` (same on every rank: it fixes the ring layout).
    pub hidden: usize,
    /// Top-k `K` (0 without `topk`; same on every rank).
    pub num_topk: usize,
}

/// Checks the NVLink buffers can hold `C * R` rings of `ring_bytes`.
fn check_buffer(buffers: &PeerBuffers, channels: usize, ring_bytes: usize) -> Result<()> {
    let needed = RING_BASE + channels * buffers.num_ranks * ring_bytes;
    if needed > buffers.bytes {
        return Err(Error::invalid(
            "buffers",
            format!("{} bytes per rank", buffers.bytes),
            format!("this op needs {needed} (see buffer_size_hint)"),
        ));
    }
    Ok(())
}

/// The device address of `v` on `stream` (0 without a view) and the view's stream guard.
fn opt_device_ptr<'a, T, V: DevicePtr<T>>(
    v: Option<&'a V>,
    stream: &'a CudaStream,
) -> (CUdeviceptr, Option<SyncOnDrop<'a>>) {
    match v {
        Some(v) => {
            let (p, g) = v.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// Row layout of a dispatch payload, from [`dispatch_row_shape`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowShape {
    /// Hidden size `H`.
    pub(crate) hidden: usize,
    /// Bytes of one row: `H` (fp8) or `2 * H` (bf16).
    pub(crate) row_bytes: usize,
    /// f32 scales per row `S`: `H / FP8_GROUP` (fp8) or 0 (bf16).
    pub(crate) scales: usize,
}

/// Checks `hidden` suits the payload kind of `x` (a positive multiple of 8 for bf16, of
/// [`FP8_GROUP`] for fp8) and returns the row layout.
pub(crate) fn dispatch_row_shape(x: &Payload<'_>, hidden: usize) -> Result<RowShape> {
    let is_fp8 = matches!(x, Payload::Fp8 { .. });
    let granule = if is_fp8 { FP8_GROUP } else { 8 };
    if hidden == 0 || hidden % granule != 0 {
        return Err(Error::invalid(
            "hidden",
            hidden,
            format!("must be a positive multiple of {granule} for this payload"),
        ));
    }
    let (row_bytes, scales) = if is_fp8 {
        (hidden, hidden / FP8_GROUP)
    } else {
        (hidden * 2, 0)
    };
    Ok(RowShape {
        hidden,
        row_bytes,
        scales,
    })
}

/// Counts a dispatch payload is checked against by [`dispatch_payload_ptrs`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct PayloadCounts {
    /// Tokens `T` this rank sends.
    pub(crate) num_tokens: usize,
    /// Tokens `N` this rank receives.
    pub(crate) num_recv_tokens: usize,
    /// Top-k `K` (0 without routing).
    pub(crate) num_topk: usize,
    /// Experts `E` (checked only with routing).
    pub(crate) num_experts: usize,
    /// Ranks `R` of the node.
    pub(crate) num_ranks: usize,
}

/// Raw device pointers of a dispatch's rows and routing (0 where absent), from
/// [`dispatch_payload_ptrs`]. Holds the views' stream guards: keep it alive until every launch
/// and copy that uses the pointers is queued.
#[derive(Debug)]
pub(crate) struct DispatchPayloadPtrs<'a> {
    /// `[T, H]` rows to send.
    pub(crate) x: CUdeviceptr,
    /// `[T, S]` scales to send (fp8 only).
    pub(crate) x_scales: CUdeviceptr,
    /// `[T, K]` expert ids (with routing only).
    pub(crate) topk_idx: CUdeviceptr,
    /// `[T, K]` weights (with routing only).
    pub(crate) topk_weights: CUdeviceptr,
    /// `[N, H]` received rows.
    pub(crate) recv_x: CUdeviceptr,
    /// `[N, S]` received scales (fp8 only).
    pub(crate) recv_x_scales: CUdeviceptr,
    /// `[N, K]` localised expert ids (with routing only).
    pub(crate) recv_topk_idx: CUdeviceptr,
    /// `[N, K]` received weights (with routing only).
    pub(crate) recv_topk_weights: CUdeviceptr,
    /// `E / R` with routing, 0 without (the kernels' `experts_per_rank`).
    pub(crate) experts_per_rank: usize,
    _guards: [Option<SyncOnDrop<'a>>; 8],
}

impl DispatchPayloadPtrs<'_> {
    /// Checks `x` and `recv_x` are 16-byte aligned (the kernels move rows in 16-byte units).
    pub(crate) fn check_row_align(&self) -> Result<()> {
        for (name, p) in [("x", self.x), ("recv_x", self.recv_x)] {
            check_align(name, p, 16)?;
        }
        Ok(())
    }
}

/// Checks the rows and routing of a dispatch and returns their device pointers on `stream`
/// (`shape` is [`dispatch_row_shape`] of `x`).
///
/// `x` must hold `T * H` elements (and `T * S` scales for fp8); `recv_x` must be of the same
/// payload kind and hold `N * H` (and `N * S`); `topk` and `recv_topk` must both be given or
/// both be absent: with them `K` must be in `[1, 1024]`, `topk` hold `T * K` ids and weights,
/// `recv_topk` `N * K`, and `E` be a positive multiple of `R`; without them `K` must be 0.
/// Pointers are taken only once every check has passed.
pub(crate) fn dispatch_payload_ptrs<'a>(
    stream: &'a CudaStream,
    shape: RowShape,
    counts: PayloadCounts,
    x: &'a Payload<'_>,
    recv_x: &'a RecvPayload<'_>,
    topk: Option<&'a TopK<'_>>,
    recv_topk: Option<&'a RecvTopK<'_>>,
) -> Result<DispatchPayloadPtrs<'a>> {
    let RowShape {
        hidden: h, scales, ..
    } = shape;
    let PayloadCounts {
        num_tokens: t,
        num_recv_tokens: n,
        num_topk: k,
        num_experts,
        num_ranks: r,
    } = counts;
    let is_fp8 = match x {
        Payload::Bf16(x) => {
            Error::check_len("x", t * h, x.len())?;
            false
        }
        Payload::Fp8 { x, scales: xs } => {
            Error::check_len("x", t * h, x.len())?;
            Error::check_len("x_scales", t * scales, xs.len())?;
            true
        }
    };
    match recv_x {
        RecvPayload::Bf16(rx) if !is_fp8 => {
            Error::check_len("recv_x", n * h, rx.len())?;
        }
        RecvPayload::Fp8 { x: rx, scales: rs } if is_fp8 => {
            Error::check_len("recv_x", n * h, rx.len())?;
            Error::check_len("recv_x_scales", n * scales, rs.len())?;
        }
        _ => {
            return Err(Error::invalid(
                "recv_x",
                "a different payload kind",
                "must be bf16 iff x is bf16 (fp8 iff x is fp8)",
            ))
        }
    }
    match (topk, recv_topk) {
        (Some(tk), Some(rt)) => {
            if k == 0 || k > 1024 {
                return Err(Error::invalid(
                    "num_topk",
                    k,
                    "must be in [1, 1024] with topk",
                ));
            }
            Error::check_len("topk_idx", t * k, tk.idx.len())?;
            Error::check_len("topk_weights", t * k, tk.weights.len())?;
            Error::check_len("recv_topk_idx", n * k, rt.idx.len())?;
            Error::check_len("recv_topk_weights", n * k, rt.weights.len())?;
            if num_experts == 0 || num_experts % r != 0 {
                return Err(Error::invalid(
                    "num_experts",
                    num_experts,
                    format!("must be a positive multiple of num_ranks = {r}"),
                ));
            }
        }
        (None, None) => {
            if k != 0 {
                return Err(Error::invalid("num_topk", k, "must be 0 without topk"));
            }
        }
        _ => {
            return Err(Error::invalid(
                "recv_topk",
                "given without topk (or the reverse)",
                "topk and recv_topk must both be given or both be None",
            ))
        }
    }
    let ((x_ptr, gx), (xs_ptr, gxs)) = match x {
        Payload::Bf16(x) => (opt_device_ptr(Some(x), stream), (0, None)),
        Payload::Fp8 { x, scales } => (
            opt_device_ptr(Some(x), stream),
            opt_device_ptr(Some(scales), stream),
        ),
    };
    let ((rx_ptr, grx), (rxs_ptr, grxs)) = match recv_x {
        RecvPayload::Bf16(rx) => (opt_device_ptr(Some(rx), stream), (0, None)),
        RecvPayload::Fp8 { x: rx, scales } => (
            opt_device_ptr(Some(rx), stream),
            opt_device_ptr(Some(scales), stream),
        ),
    };
    let (ti_ptr, gti) = opt_device_ptr(topk.map(|tk| &tk.idx), stream);
    let (tw_ptr, gtw) = opt_device_ptr(topk.map(|tk| &tk.weights), stream);
    let (rti_ptr, grti) = opt_device_ptr(recv_topk.map(|rt| &rt.idx), stream);
    let (rtw_ptr, grtw) = opt_device_ptr(recv_topk.map(|rt| &rt.weights), stream);
    Ok(DispatchPayloadPtrs {
        x: x_ptr,
        x_scales: xs_ptr,
        topk_idx: ti_ptr,
        topk_weights: tw_ptr,
        recv_x: rx_ptr,
        recv_x_scales: rxs_ptr,
        recv_topk_idx: rti_ptr,
        recv_topk_weights: rtw_ptr,
        experts_per_rank: if k > 0 { num_experts / r } else { 0 },
        _guards: [gx, gxs, grx, grxs, gti, gtw, grti, grtw],
    })
}

/// Launches the dispatch of this rank's tokens on `stream` (after [`notify_dispatch_cuda`] or
/// [`cached_notify_cuda`] on every rank). Every rank must launch it with the same `config`.
pub fn dispatch_cuda(
    stream: &CudaStream,
    buffers: &PeerBuffers,
    config: &Config,
    args: DispatchArgs<'_>,
) -> Result<()> {
    config.validate()?;
    let r = buffers.num_ranks;
    let c = config.num_channels();
    let t = args.is_token_in_rank.len() / r.max(1);
    Error::check_len("is_token_in_rank", t * r, args.is_token_in_rank.len())?;
    let n = args.num_recv_tokens;
    let shape = dispatch_row_shape(&args.x, args.hidden)?;
    let (row_bytes, scales) = (shape.row_bytes, shape.scales);
    let k = args.num_topk;
    let payload = dispatch_payload_ptrs(
        stream,
        shape,
        PayloadCounts {
            num_tokens: t,
            num_recv_tokens: n,
            num_topk: k,
            num_experts: args.num_experts,
            num_ranks: r,
        },
        &args.x,
        &args.recv_x,
        args.topk.as_ref(),
        args.recv_topk.as_ref(),
    )?;
    Error::check_len("rank_prefix_matrix", r * r, args.rank_prefix_matrix.len())?;
    Error::check_len(
        "channel_prefix_matrix",
        r * c,
        args.channel_prefix_matrix.len(),
    )?;
    Error::check_len("recv_src_idx", n, args.recv_src_idx.len())?;
    Error::check_len("recv_channel_offset", r * c, args.recv_channel_offset.len())?;
    Error::check_len("send_head", t * r, args.send_head.len())?;
    let q = config.num_max_recv_tokens;
    if q.checked_mul(row_bytes / 16)
        .is_none_or(|v| v > i32::MAX as usize)
    {
        return Err(Error::invalid(
            "num_max_recv_tokens",
            q,
            "ring too large for 32-bit slot offsets",
        ));
    }
    check_buffer(buffers, c, dispatch_ring_bytes(q, row_bytes, k, scales))?;

    let kernels = Kernels::for_stream(stream)?;
    if 2 * c > kernels.props().sm_count as usize {
        return Err(Error::invalid(
            "num_sms",
            config.num_sms,
            format!(
                "must be <= the device's {} SMs (all blocks must be resident)",
                kernels.props().sm_count
            ),
        ));
    }
    let kernel = kernels.kernel(FILE, "intranode_dispatch")?;
    payload.check_row_align()?;
    let (itir, _g0) = args.is_token_in_rank.device_ptr(stream);
    let (rpm, _g1) = args.rank_prefix_matrix.device_ptr(stream);
    let (cpm, _g2) = args.channel_prefix_matrix.device_ptr(stream);
    let (rsi, _g3) = args.recv_src_idx.device_ptr(stream);
    let (rco, _g4) = args.recv_channel_offset.device_ptr(stream);
    let (sh, _g5) = args.send_head.device_ptr(stream);
    let params = DispatchParams {
        buffer_ptrs: buffers.ptrs,
        x: payload.x,
        x_scales: payload.x_scales,
        topk_idx: payload.topk_idx,
        topk_weights: payload.topk_weights,
        is_token_in_rank: itir,
        rank_prefix_matrix: rpm,
        channel_prefix_matrix: cpm,
        recv_x: payload.recv_x,
        recv_x_scales: payload.recv_x_scales,
        recv_src_idx: rsi,
        recv_topk_idx: payload.recv_topk_idx,
        recv_topk_weights: payload.recv_topk_weights,
        recv_channel_offset: rco,
        send_head: sh,
        error_info: buffers.error_info,
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank)?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        hidden_int4: to_i32("hidden", row_bytes / 16)?,
        num_scales: to_i32("num_scales", scales)?,
        num_topk: to_i32("num_topk", k)?,
        experts_per_rank: to_i32("num_experts", payload.experts_per_rank)?,
        num_channels: to_i32("num_channels", c)?,
        num_max_send_tokens: to_i32("num_max_send_tokens", config.num_max_send_tokens)?,
        num_max_recv_tokens: to_i32("num_max_recv_tokens", q)?,
    };
    let cfg = LaunchConfig {
        grid_dim: (2 * c as u32, 1, 1),
        block_dim: (DISPATCH_THREADS, 1, 1),
        shared_mem_bytes: DISPATCH_SMEM_BYTES,
    };
    // SAFETY: `params` matches `DispatchParams`. Every view was checked to hold exactly what
    // the kernel touches for T tokens, N received tokens, H hidden, K top-k, R ranks and C
    // channels (the kernel writes recv rows at offsets from the prefix matrices, which sum to
    // N when they come from notify on these counts); optional pointers are null exactly when
    // their counts (K, S) are 0; the rings fit in the NVLink buffers (`check_buffer`), which
    // are valid per `PeerBuffers::new`. The guards keep the views ordered on `stream`.
    unsafe { kernel.launch(stream, cfg, params) }
}

// ---------------------------------------------------------------------------------------------
// combine
// ---------------------------------------------------------------------------------------------

/// Mirror of `CombineParams` in intranode.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CombineParams {
    buffer_ptrs: [u64; MAX_NVL_RANKS],
    x: CUdeviceptr,
    topk_weights: CUdeviceptr,
    rank_prefix_matrix: CUdeviceptr,
    recv_channel_offset: CUdeviceptr,
    send_head: CUdeviceptr,
    combined_x: CUdeviceptr,
    combined_topk_weights: CUdeviceptr,
    error_info: CUdeviceptr,
    timeout_ns: u64,
    rank: i32,
    num_ranks: i32,
    num_tokens: i32,
    num_recv_tokens: i32,
    hidden_int4: i32,
    num_topk: i32,
    num_channels: i32,
    num_max_send_tokens: i32,
    num_max_recv_tokens: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<CombineParams>() == 176);
// SAFETY: repr(C) plain data mirroring `CombineParams` in intranode.cu.
unsafe impl KernelParams for CombineParams {}

/// Raw device pointers of a combine's optional top-k weights (0 where absent), from
/// [`combine_weights_ptrs`]. Holds the views' stream guards: keep it alive until every launch
/// and copy that uses the pointers is queued.
#[derive(Debug)]
pub(crate) struct CombineWeightsPtrs<'a> {
    /// `[N, K]` weights returned along the rows.
    pub(crate) topk_weights: CUdeviceptr,
    /// `[T, K]` sums of the returned weights.
    pub(crate) combined_topk_weights: CUdeviceptr,
    _guards: [Option<SyncOnDrop<'a>>; 2],
}

/// Checks the optional top-k weights of a combine of `num_recv_tokens` rows (`N`) into
/// `num_tokens` tokens (`T`) and returns their device pointers on `stream`.
///
/// `topk_weights` and `combined_topk_weights` must both be given or both be absent: with them
/// `num_topk` (`K`) must be in `[1, 1024]`, `topk_weights` hold `N * K` and
/// `combined_topk_weights` `T * K` elements; without them `K` must be 0. Pointers are taken
/// only once every check has passed.
pub(crate) fn combine_weights_ptrs<'a>(
    stream: &'a CudaStream,
    topk_weights: Option<&'a CudaView<'_, f32>>,
    combined_topk_weights: Option<&'a CudaViewMut<'_, f32>>,
    num_recv_tokens: usize,
    num_tokens: usize,
    num_topk: usize,
) -> Result<CombineWeightsPtrs<'a>> {
    let k = num_topk;
    match (topk_weights, combined_topk_weights) {
        (Some(w), Some(cw)) => {
            if k == 0 || k > 1024 {
                return Err(Error::invalid(
                    "num_topk",
                    k,
                    "must be in [1, 1024] with topk_weights",
                ));
            }
            Error::check_len("topk_weights", num_recv_tokens * k, w.len())?;
            Error::check_len("combined_topk_weights", num_tokens * k, cw.len())?;
        }
        (None, None) => {
            if k != 0 {
                return Err(Error::invalid(
                    "num_topk",
                    k,
                    "must be 0 without topk_weights",
                ));
            }
        }
        _ => {
            return Err(Error::invalid(
                "combined_topk_weights",
                "given without topk_weights (or the reverse)",
                "both or neither",
            ))
        }
    }
    let (w_ptr, gw) = opt_device_ptr(topk_weights, stream);
    let (cw_ptr, gcw) = opt_device_ptr(combined_topk_weights, stream);
    Ok(CombineWeightsPtrs {
        topk_weights: w_ptr,
        combined_topk_weights: cw_ptr,
        _guards: [gw, gcw],
    })
}

/// Inputs and outputs of [`combine_cuda`] (`N` rows this rank holds in dispatch receive
/// order, `T` tokens this rank owns, `H` hidden, `K` top-k).
#[derive(Debug)]
pub struct CombineArgs<'a> {
    /// `[N, H]` bf16 rows to return (e.g. the experts' weighted outputs), in receive order.
    pub x: CudaView<'a, half::bf16>,
    /// Optional `[N, K]` weights returned along and summed (with `combined_topk_weights`).
    pub topk_weights: Option<CudaView<'a, f32>>,
    /// `[R, R]` from the dispatch handle.
    pub rank_prefix_matrix: CudaView<'a, i32>,
    /// `[R, C]` from the dispatch (`recv_channel_offset`).
    pub recv_channel_offset: CudaView<'a, i32>,
    /// `[T, R]` from the dispatch (`send_head`).
    pub send_head: CudaView<'a, i32>,
    /// Out: `[T, H]` bf16, the f32 sum in rank order of the rows returned for each token.
    pub combined_x: CudaViewMut<'a, half::bf16>,
    /// Out: `[T, K]` sums of the returned weights (required iff `topk_weights` is given).
    pub combined_topk_weights: Option<CudaViewMut<'a, f32>>,
    /// Number of rows `N` this rank holds (the dispatch's `num_recv_tokens`).
    pub num_recv_tokens: usize,
    /// Hidden size `H` (a multiple of 8; same on every rank).
    pub hidden: usize,
    /// Top-k `K` of the weights (0 without them; same on every rank).
    pub num_topk: usize,
}

/// Launches the combine on `stream` (after [`cached_notify_cuda`] on every rank). `config`
/// must have the dispatch's channel count and `num_max_recv_tokens >= num_max_send_tokens +
/// COMBINE_ROUND_TOKENS`; every rank must use the same `config`.
pub fn combine_cuda(
    stream: &CudaStream,
    buffers: &PeerBuffers,
    config: &Config,
    args: CombineArgs<'_>,
) -> Result<()> {
    config.validate()?;
    let r = buffers.num_ranks;
    let c = config.num_channels();
    let q = config.num_max_recv_tokens;
    if q < config.num_max_send_tokens + COMBINE_ROUND_TOKENS {
        return Err(Error::invalid(
            "num_max_recv_tokens",
            q,
            format!(
                "combine needs at least num_max_send_tokens + {COMBINE_ROUND_TOKENS} = {}",
                config.num_max_send_tokens + COMBINE_ROUND_TOKENS
            ),
        ));
    }
    let t = args.send_head.len() / r;
    Error::check_len("send_head", t * r, args.send_head.len())?;
    let h = args.hidden;
    if h == 0 || h % 8 != 0 {
        return Err(Error::invalid(
            "hidden",
            h,
            "must be a positive multiple of 8",
        ));
    }
    let num_recv = args.num_recv_tokens;
    Error::check_len("x", num_recv * h, args.x.len())?;
    Error::check_len("combined_x", t * h, args.combined_x.len())?;
    Error::check_len("rank_prefix_matrix", r * r, args.rank_prefix_matrix.len())?;
    Error::check_len("recv_channel_offset", r * c, args.recv_channel_offset.len())?;
    let k = args.num_topk;
    let weights = combine_weights_ptrs(
        stream,
        args.topk_weights.as_ref(),
        args.combined_topk_weights.as_ref(),
        num_recv,
        t,
        k,
    )?;
    check_buffer(buffers, c, combine_ring_bytes(q, h * 2, k))?;
    let kernels = Kernels::for_stream(stream)?;
    if 2 * c > kernels.props().sm_count as usize {
        return Err(Error::invalid(
            "num_sms",
            config.num_sms,
            format!(
                "must be <= the device's {} SMs (all blocks must be resident)",
                kernels.props().sm_count
            ),
        ));
    }
    let name = format!("intranode_combine_{r}");
    let kernel = kernels.kernel(FILE, &name)?;
    let (x_ptr, _g0) = args.x.device_ptr(stream);
    let (rpm, _g1) = args.rank_prefix_matrix.device_ptr(stream);
    let (rco, _g2) = args.recv_channel_offset.device_ptr(stream);
    let (sh, _g3) = args.send_head.device_ptr(stream);
    let (cx, _g4) = args.combined_x.device_ptr(stream);
    check_align("x", x_ptr, 16)?;
    check_align("combined_x", cx, 16)?;
    let params = CombineParams {
        buffer_ptrs: buffers.ptrs,
        x: x_ptr,
        topk_weights: weights.topk_weights,
        rank_prefix_matrix: rpm,
        recv_channel_offset: rco,
        send_head: sh,
        combined_x: cx,
        combined_topk_weights: weights.combined_topk_weights,
        error_info: buffers.error_info,
        timeout_ns: buffers.timeout_ns(),
        rank: to_i32("rank", buffers.rank)?,
        num_ranks: to_i32("num_ranks", r)?,
        num_tokens: to_i32("num_tokens", t)?,
        num_recv_tokens: to_i32("num_recv_tokens", num_recv)?,
        hidden_int4: to_i32("hidden", h / 8)?,
        num_topk: to_i32("num_topk", k)?,
        num_channels: to_i32("num_channels", c)?,
        num_max_send_tokens: to_i32("num_max_send_tokens", config.num_max_send_tokens)?,
        num_max_recv_tokens: to_i32("num_max_recv_tokens", q)?,
        pad: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (2 * c as u32, 1, 1),
        block_dim: (COMBINE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` matches `CombineParams`; the views hold exactly what the kernel touches
    // (x: N*H read at rows given by recv_channel_offset / rank_prefix_matrix from the same
    // dispatch, which lie in [0, N); outputs T*H and T*K); the rings fit the NVLink buffers
    // (`check_buffer`), valid per `PeerBuffers::new`; guards keep the views ordered.
    unsafe { kernel.launch(stream, cfg, params) }
}
