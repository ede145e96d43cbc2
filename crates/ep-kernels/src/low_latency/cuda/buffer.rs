//! The low-latency buffer of one rank: device memory that peers write into, its peer table,
//! the active-ranks mask and the timeout.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtr};

use super::layout::LowLatencyLayout;
use crate::cuda::assert_params_layout;
use crate::error::{Error, Result};
use crate::memory::{DeviceMemory, HostMappedI32};

/// Default time any device wait of the low-latency kernels may take before the peer it waits
/// for is marked inactive.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// One rank's low-latency buffer (layout: [`LowLatencyLayout`]).
///
/// On one node the memory is a [`DeviceMemory`] (`cuMemAlloc`, not a stream-ordered pool), so
/// that peers can reach it through peer access or CUDA IPC. Lifecycle: [`LowLatencyBuffer::new`]
/// on every rank, share [`LowLatencyBuffer::base_ptr`] (as a peer pointer or an IPC handle),
/// then [`LowLatencyBuffer::connect`] with every rank's base address as this GPU sees it.
///
/// Across nodes (feature `nvshmem`) the memory lies on NVSHMEM's symmetric heap and
/// [`LowLatencyBuffer::new_nvshmem`] connects it at once: ranks of this node through their
/// NVLink pointers, the others through NVSHMEM puts (the `*_nvshmem` kernels).
#[derive(Debug)]
pub struct LowLatencyBuffer {
    ctx: Arc<CudaContext>,
    /// The buffer's memory. Declared before the peer table and the mirror: its drop
    /// synchronises the device (so no kernel uses any of them any more), then frees it.
    mem: Memory,
    layout: LowLatencyLayout,
    rank: usize,
    peers: CudaSlice<u64>,
    connected: bool,
    timeout: Duration,
    /// Host-mapped copy of the active-ranks mask, written by every launch with a receive phase
    /// as it ends (see [`LowLatencyBuffer::active_ranks_mirror`]); dropped after `mem`
    /// synchronised the context, so no kernel writes it any more.
    mirror: HostMappedI32,
}

/// The owner of a buffer's memory.
#[derive(Debug)]
enum Memory {
    /// `cuMemAlloc`: peers of the node reach it through peer access or CUDA IPC.
    Device(DeviceMemory),
    /// NVSHMEM's symmetric heap: peers of the node through `nvshmem_ptr`, other nodes through
    /// NVSHMEM puts.
    #[cfg(feature = "nvshmem")]
    Symmetric(Symmetric),
}

impl Memory {
    fn ptr(&self) -> u64 {
        match self {
            Self::Device(mem) => mem.ptr(),
            #[cfg(feature = "nvshmem")]
            Self::Symmetric(sym) => sym.mem.as_device_ptr().addr(),
        }
    }
}

/// A buffer on NVSHMEM's symmetric heap and the NVSHMEM instance its kernels' modules are
/// bound to.
#[cfg(feature = "nvshmem")]
#[derive(Debug)]
struct Symmetric {
    /// Dropped first among the fields: waits for the device, then frees (collective).
    mem: nvshmem_sys::SymmetricBuffer<u8>,
    nv: Arc<nvshmem_sys::Nvshmem>,
    /// Some rank is on another node (reached through NVSHMEM puts).
    remote: bool,
}

// SAFETY: the allocation (owned through `mem`) is only touched through the CUDA driver, which
// is thread-safe; nothing in it is tied to the creating thread.
unsafe impl Send for LowLatencyBuffer {}
// SAFETY: as above; `&self` methods only enqueue driver calls.
unsafe impl Sync for LowLatencyBuffer {}

impl LowLatencyBuffer {
    /// Allocates and zeroes the buffer of `rank` on `stream`'s device (every rank active, no
    /// peers yet). Synchronises `stream`.
    pub fn new(stream: &Arc<CudaStream>, layout: LowLatencyLayout, rank: usize) -> Result<Self> {
        if rank >= layout.num_ranks {
            return Err(Error::invalid(
                "rank",
                rank,
                format!("must be < num_ranks = {}", layout.num_ranks),
            ));
        }
        let ctx = stream.context().clone();
        ctx.bind_to_thread()?;
        let mut table = vec![0u64; layout.num_ranks];
        let mut peers = stream.alloc_zeros::<u64>(layout.num_ranks)?;
        let mirror = HostMappedI32::new(&ctx, layout.num_ranks, 1)?;
        // Freed by `DeviceMemory`'s drop; the zeroing is ordered on `stream` and completes
        // before `set_active_ranks` below synchronises it.
        let mut mem = DeviceMemory::alloc(&ctx, layout.total_bytes)?;
        mem.zero_async(stream)?;
        table[rank] = mem.ptr();
        stream.memcpy_htod(&table, &mut peers)?;
        let buffer = Self {
            ctx,
            mem: Memory::Device(mem),
            layout,
            rank,
            peers,
            connected: false,
            timeout: DEFAULT_TIMEOUT,
            mirror,
        };
        buffer.set_active_ranks(stream, &vec![true; layout.num_ranks])?;
        Ok(buffer)
    }

    /// Allocates this rank's buffer on NVSHMEM's symmetric heap (collective: every PE calls it
    /// with the same layout, in the same order as its other symmetric allocations) and connects
    /// it: ranks `r` with `same_node(r)` through their NVLink/P2P address (`nvshmem_ptr`), the
    /// others through NVSHMEM puts, staged in the layout's staging region
    /// ([`LowLatencyLayout::with_remote_stage`], added here). The rank is NVSHMEM's PE number,
    /// `nv` must have `layout.num_ranks` PEs and live on `stream`'s device. Binds the NVSHMEM
    /// kernels' modules to `nv`. Synchronises `stream`.
    #[cfg(feature = "nvshmem")]
    pub fn new_nvshmem(
        stream: &Arc<CudaStream>,
        layout: LowLatencyLayout,
        nv: &Arc<nvshmem_sys::Nvshmem>,
        same_node: impl Fn(usize) -> bool,
    ) -> Result<Self> {
        let layout = layout.with_remote_stage()?;
        let (rank, n) = (nv.my_pe(), layout.num_ranks);
        if nv.n_pes() != n {
            return Err(Error::invalid(
                "nv",
                format!("{} PEs", nv.n_pes()),
                format!("the layout is for num_ranks = {n}"),
            ));
        }
        let ctx = stream.context().clone();
        if nv.device() != ctx.ordinal() {
            return Err(Error::invalid(
                "stream",
                format!("a stream of device {}", ctx.ordinal()),
                format!("NVSHMEM lives on device {}", nv.device()),
            ));
        }
        ctx.bind_to_thread()?;
        let mem = nv.alloc_zeroed::<u8>(layout.total_bytes)?;
        let base = mem.as_device_ptr().addr();
        if base % 256 != 0 {
            return Err(Error::invalid(
                "NVSHMEM heap",
                format!("{base:#x}"),
                "the buffer must be 256-byte aligned",
            ));
        }
        let mut table = vec![0u64; n];
        for (r, entry) in table.iter_mut().enumerate() {
            if r == rank || same_node(r) {
                *entry = mem.peer_ptr(r)?.map(|p| p.addr()).ok_or_else(|| {
                    Error::invalid(
                        "same_node",
                        format!("true for rank {r}"),
                        "NVSHMEM gives no NVLink/P2P address of that rank's buffer",
                    )
                })?;
            }
        }
        let mut peers = stream.alloc_zeros::<u64>(n)?;
        stream.memcpy_htod(&table, &mut peers)?;
        let mirror = HostMappedI32::new(&ctx, n, 1)?;
        let buffer = Self {
            ctx,
            mem: Memory::Symmetric(Symmetric {
                mem,
                nv: nv.clone(),
                remote: table.contains(&0),
            }),
            layout,
            rank,
            peers,
            connected: true,
            timeout: DEFAULT_TIMEOUT,
            mirror,
        };
        buffer.set_active_ranks(stream, &vec![true; n])?;
        let kernels = crate::cuda::Kernels::for_stream(stream)?;
        for (file, name) in [
            (super::dispatch::DISPATCH_NVSHMEM_FILE, "ll_dispatch"),
            (super::combine::COMBINE_NVSHMEM_FILE, "ll_combine"),
        ] {
            let kernel = kernels.kernel(file, name)?;
            buffer.bind(&kernel)?;
        }
        Ok(buffer)
    }

    /// Binds the module of `kernel`, one of the `*_nvshmem` kernels, to this buffer's NVSHMEM
    /// instance once (nothing for a buffer without NVSHMEM). Modules without NVSHMEM's device
    /// state (the NVLink kernels) must not be bound: NVSHMEM refuses them.
    pub(super) fn bind(&self, kernel: &crate::cuda::Kernel) -> Result<()> {
        #[cfg(feature = "nvshmem")]
        if let Memory::Symmetric(sym) = &self.mem {
            crate::cuda::nvshmem_module_init(&sym.nv, kernel)?;
        }
        #[cfg(not(feature = "nvshmem"))]
        let _ = kernel;
        Ok(())
    }

    /// The device address of this rank's buffer (what peers map).
    pub fn base_ptr(&self) -> u64 {
        self.mem.ptr()
    }

    /// The buffer's memory (for its IPC handle); `None` for a buffer on NVSHMEM's heap.
    pub fn memory(&self) -> Option<&DeviceMemory> {
        match &self.mem {
            Memory::Device(mem) => Some(mem),
            #[cfg(feature = "nvshmem")]
            Memory::Symmetric(_) => None,
        }
    }

    /// Whether the buffer lies on NVSHMEM's symmetric heap.
    pub fn uses_nvshmem(&self) -> bool {
        match &self.mem {
            Memory::Device(_) => false,
            #[cfg(feature = "nvshmem")]
            Memory::Symmetric(_) => true,
        }
    }

    /// Whether some rank is on another node, reached through NVSHMEM puts: the launches then
    /// use the `*_nvshmem` kernels (a buffer on NVSHMEM's heap whose ranks all share this node
    /// uses the NVLink kernels).
    pub fn reaches_other_nodes(&self) -> bool {
        match &self.mem {
            Memory::Device(_) => false,
            #[cfg(feature = "nvshmem")]
            Memory::Symmetric(sym) => sym.remote,
        }
    }

    /// The layout.
    pub fn layout(&self) -> &LowLatencyLayout {
        &self.layout
    }

    /// This buffer's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The context the buffer lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether [`LowLatencyBuffer::connect`] has been called.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Sets every rank's buffer address as this GPU addresses it (`peer_bases[r]`; a peer
    /// pointer or an opened IPC handle); `peer_bases[rank]` must be [`Self::base_ptr`].
    /// Synchronises `stream`.
    ///
    /// # Safety
    ///
    /// Every `peer_bases[r]` must be the base of rank `r`'s low-latency buffer of this layout,
    /// mapped into this context (a peer-accessible pointer or an opened IPC handle), and stay
    /// mapped for as long as kernels use this buffer: the kernels write to those addresses.
    pub unsafe fn connect(&mut self, stream: &Arc<CudaStream>, peer_bases: &[u64]) -> Result<()> {
        Error::check_len("peer_bases", self.layout.num_ranks, peer_bases.len())?;
        if peer_bases[self.rank] != self.mem.ptr() {
            return Err(Error::invalid(
                "peer_bases",
                format!("[{}] = {:#x}", self.rank, peer_bases[self.rank]),
                format!(
                    "this rank's own entry must be its base_ptr {:#x}",
                    self.mem.ptr()
                ),
            ));
        }
        if let Some(r) = peer_bases.iter().position(|&b| b == 0 || b % 256 != 0) {
            return Err(Error::invalid(
                "peer_bases",
                format!("[{r}] = {:#x}", peer_bases[r]),
                "every rank's base must be a 256-byte aligned NVLink-reachable address",
            ));
        }
        stream.memcpy_htod(peer_bases, &mut self.peers)?;
        stream.synchronize()?;
        self.connected = true;
        Ok(())
    }

    /// How long any device wait may take before the awaited peer is marked inactive.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the timeout of later launches (0 = wait forever).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Reads the active-ranks mask (`true` = active). Synchronises `stream`.
    pub fn active_ranks(&self, stream: &Arc<CudaStream>) -> Result<Vec<bool>> {
        let mut raw = vec![0i32; self.layout.num_ranks];
        self.ctx.bind_to_thread()?;
        // SAFETY: the mask holds `num_ranks` i32 inside this allocation; the copy is ordered
        // on `stream` and `raw` outlives it (synchronised before return).
        unsafe {
            result::memcpy_dtoh_async(
                &mut raw,
                self.mem.ptr() + self.layout.off_active as u64,
                stream.cu_stream(),
            )
        }?;
        stream.synchronize()?;
        Ok(raw.into_iter().map(|v| v != 0).collect())
    }

    /// The active-ranks mask as the last launch with a receive phase (a `Recv` or `Both`
    /// launch of [`super::dispatch_cuda`] / [`super::combine_cuda`]) left it: every such
    /// launch writes it into host-mapped memory as it ends (all `true` before the first).
    /// Read it only once an event recorded after that launch has completed (earlier reads may
    /// see an older launch's mask). No stream work, no synchronisation.
    pub fn active_ranks_mirror(&self) -> Vec<bool> {
        self.mirror.to_vec().iter().map(|&v| v != 0).collect()
    }

    /// Enqueues a copy of the active-ranks mask into `dst` (host-mapped, `num_ranks` words) on
    /// `stream` without waiting (capturable in a CUDA graph): `dst` holds the mask once the
    /// stream has passed this point (record an event after it and query that).
    pub fn copy_active_ranks(&self, stream: &Arc<CudaStream>, dst: &HostMappedI32) -> Result<()> {
        Error::check_len("dst", self.layout.num_ranks, dst.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the mask holds `num_ranks` i32 inside this allocation and `dst` is a live
        // host-mapped buffer of as many words on this context; the copy is ordered on
        // `stream`, and the caller keeps `dst` alive until the stream has passed it.
        unsafe {
            result::memcpy_dtod_async(
                dst.device_ptr(),
                self.mem.ptr() + self.layout.off_active as u64,
                self.layout.num_ranks * std::mem::size_of::<i32>(),
                stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    /// Overwrites the active-ranks mask (mask a rank on purpose, or mark all active again).
    /// Ordered on `stream`; synchronises it.
    pub fn set_active_ranks(&self, stream: &Arc<CudaStream>, active: &[bool]) -> Result<()> {
        Error::check_len("active", self.layout.num_ranks, active.len())?;
        let raw: Vec<i32> = active.iter().map(|&a| i32::from(a)).collect();
        self.ctx.bind_to_thread()?;
        // SAFETY: the mask holds `num_ranks` i32 inside this allocation; `raw` outlives the
        // copy (the stream is synchronised before return).
        unsafe {
            result::memcpy_htod_async(
                self.mem.ptr() + self.layout.off_active as u64,
                &raw,
                stream.cu_stream(),
            )
        }?;
        stream.synchronize()?;
        Ok(())
    }

    /// Marks every rank active again. Synchronises `stream`.
    pub fn reset_active_ranks(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.set_active_ranks(stream, &vec![true; self.layout.num_ranks])
    }

    /// Reads the mask and fails with [`Error::PeerTimeout`] naming the first inactive rank.
    /// Synchronises `stream`.
    pub fn check_active_ranks(&self, stream: &Arc<CudaStream>, kernel: &'static str) -> Result<()> {
        match self.active_ranks(stream)?.iter().position(|a| !a) {
            Some(rank) => Err(Error::PeerTimeout { rank, kernel }),
            None => Ok(()),
        }
    }

    /// The kernels' view of the buffer, with the peer table's address on `stream`.
    pub(super) fn desc(&self, stream: &CudaStream) -> Result<LlBuffer> {
        if !self.connected {
            return Err(Error::invalid(
                "buffer",
                "not connected",
                "call LowLatencyBuffer::connect with every rank's base address first",
            ));
        }
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::invalid(
                "stream",
                format!("a stream of device {}", stream.context().ordinal()),
                format!("the buffer lives on device {}", self.ctx.ordinal()),
            ));
        }
        let (peers, _guard) = self.peers.device_ptr(stream);
        let l = &self.layout;
        let to_i32 = |arg: &'static str, v: usize| {
            i32::try_from(v).map_err(|_| Error::invalid(arg, v, "must fit in i32"))
        };
        Ok(LlBuffer {
            local: self.mem.ptr(),
            peers,
            set_bytes: l.set_bytes as u64,
            sets_offset: l.sets_offset as u64,
            off_signals: l.off_signals as u64,
            off_flags: l.off_flags as u64,
            off_msgs: l.off_msgs as u64,
            off_idx: l.off_idx as u64,
            off_rows: l.off_rows as u64,
            off_active: l.off_active as u64,
            off_send_done: l.off_send_done as u64,
            off_stage: l.off_stage as u64,
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
            num_ranks: to_i32("num_ranks", l.num_ranks)?,
            rank: to_i32("rank", self.rank)?,
            num_experts: to_i32("num_experts", l.num_experts)?,
            max_tokens: to_i32("max_tokens_per_rank", l.max_tokens_per_rank)?,
            hidden: to_i32("hidden", l.hidden)?,
            max_topk: to_i32("max_topk", super::layout::LL_MAX_TOPK)?,
            msg_stride: to_i32("msg_stride", l.msg_stride)?,
            reserved: 0,
            active_mirror: self.mirror.device_ptr(),
        })
    }
}

/// Mirror of `struct LlBuffer` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct LlBuffer {
    pub local: CUdeviceptr,
    pub peers: CUdeviceptr,
    pub set_bytes: u64,
    pub sets_offset: u64,
    pub off_signals: u64,
    pub off_flags: u64,
    pub off_msgs: u64,
    pub off_idx: u64,
    pub off_rows: u64,
    pub off_active: u64,
    pub off_send_done: u64,
    pub off_stage: u64,
    pub timeout_ns: u64,
    pub num_ranks: i32,
    pub rank: i32,
    pub num_experts: i32,
    pub max_tokens: i32,
    pub hidden: i32,
    pub max_topk: i32,
    pub msg_stride: i32,
    pub reserved: i32,
    pub active_mirror: CUdeviceptr,
}
assert_params_layout!(
    LlBuffer,
    144;
    local = 0, peers = 8, set_bytes = 16, sets_offset = 24, off_signals = 32, off_flags = 40,
    off_msgs = 48, off_idx = 56, off_rows = 64, off_active = 72, off_send_done = 80,
    off_stage = 88, timeout_ns = 96, num_ranks = 104, rank = 108, num_experts = 112,
    max_tokens = 116, hidden = 120, max_topk = 124, msg_stride = 128, reserved = 132,
    active_mirror = 136,
);
