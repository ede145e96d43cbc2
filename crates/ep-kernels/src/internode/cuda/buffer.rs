//! The internode buffer of one rank: its layout on NVSHMEM's symmetric heap, the peer table
//! of its node, the host-mapped counters and error record, and the op sequence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::cuda::{assert_params_layout, Kernels};
use crate::error::{Error, Result};
use crate::internode::layout::InternodeLayout;
use crate::intranode::MAX_LOCAL_EXPERTS;
use crate::memory::HostMappedI32;

/// Default time a device wait may take before it names the rank it waited for.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Kernel names by the ids the device writes into error records (`kIn*` in
/// `internode.cuh`).
const KERNEL_NAMES: [&str; 5] = [
    "internode_unknown",
    "internode_notify",
    "internode_dispatch_recv",
    "internode_combine_forward",
    "internode_combine_recv",
];

/// The cubins, each bound to NVSHMEM when the buffer is built.
pub(super) const NOTIFY_FILE: &str = "internode/notify";
pub(super) const DISPATCH_FILE: &str = "internode/dispatch";
pub(super) const COMBINE_FILE: &str = "internode/combine";

/// Mirror of `InBuffer` in `internode.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct InBuffer {
    local: u64,
    peers: u64,
    error_info: u64,
    timeout_ns: u64,
    off_sync: u64,
    off_counts: u64,
    off_rdma_sig: u64,
    off_comb_sig: u64,
    off_recv: u64,
    off_stage: u64,
    off_comb_in: u64,
    slot_bytes: u64,
    comb_bytes: u64,
    pub(super) rank: i32,
    num_ranks: i32,
    gpus_per_node: i32,
    num_nodes: i32,
    max_tokens: i32,
    count_stride: i32,
}
assert_params_layout!(
    InBuffer,
    128;
    local = 0, peers = 8, error_info = 16, timeout_ns = 24, off_sync = 32, off_counts = 40,
    off_rdma_sig = 48, off_comb_sig = 56, off_recv = 64, off_stage = 72, off_comb_in = 80,
    slot_bytes = 88, comb_bytes = 96, rank = 104, num_ranks = 108, gpus_per_node = 112,
    num_nodes = 116, max_tokens = 120, count_stride = 124,
);

/// Which signal word a step releases, on which ranks.
#[derive(Debug, Clone, Copy)]
pub(super) enum SignalTarget {
    /// `rdma_sig[this node]` of every node's rank with this local index (dispatch blocks
    /// put, or combine rows returned).
    Nodes,
    /// `comb_sig[this local index]` of every rank of this node (combine rows written).
    NodePeers,
}

/// One rank's internode buffer (layout: [`InternodeLayout`]), on NVSHMEM's symmetric heap.
#[derive(Debug)]
pub struct InternodeBuffer {
    /// Dropped first: waits for the device, then frees (collective).
    mem: nvshmem_sys::SymmetricBuffer<u8>,
    _nv: Arc<nvshmem_sys::Nvshmem>,
    ctx: Arc<CudaContext>,
    layout: InternodeLayout,
    rank: usize,
    peers: CudaSlice<u64>,
    timeout: Duration,
    seq: AtomicU64,
    /// `[1 + R]`: word 1 + s, tokens from source s, then word 0, the total (notify).
    pub(super) recv_counter: HostMappedI32,
    /// `[MAX_LOCAL_EXPERTS]` aligned tokens per local expert (notify).
    pub(super) expert_counter: HostMappedI32,
    /// 4 words: the error record.
    error_record: HostMappedI32,
}

// SAFETY: the memory is only touched through the CUDA driver and NVSHMEM, both thread-safe;
// nothing in it is tied to the creating thread.
unsafe impl Send for InternodeBuffer {}
// SAFETY: as above; `&self` methods enqueue driver work or touch atomics / host-mapped words.
unsafe impl Sync for InternodeBuffer {}

impl InternodeBuffer {
    /// Allocates this rank's buffer on NVSHMEM's symmetric heap (collective: every PE calls it
    /// with the same layout, in the same order as its other symmetric allocations), maps the
    /// buffers of the ranks `r` with `same_node(r)` (`nvshmem_ptr`) and binds the kernels'
    /// modules to `nv`. The rank is NVSHMEM's PE number. Synchronises `stream`.
    pub fn new(
        stream: &Arc<CudaStream>,
        layout: InternodeLayout,
        nv: &Arc<nvshmem_sys::Nvshmem>,
        same_node: impl Fn(usize) -> bool,
    ) -> Result<Self> {
        let (rank, r) = (nv.my_pe(), layout.num_ranks);
        if nv.n_pes() != r {
            return Err(Error::invalid(
                "nv",
                format!("{} PEs", nv.n_pes()),
                format!("the layout is for num_ranks = {r}"),
            ));
        }
        let ctx = stream.context().clone();
        ctx.bind_to_thread()?;
        let mem = nv.alloc_zeroed::<u8>(layout.total_bytes)?;
        let mut table = vec![0u64; r];
        for (peer, entry) in table.iter_mut().enumerate() {
            if peer == rank || same_node(peer) {
                if peer / layout.gpus_per_node != rank / layout.gpus_per_node {
                    return Err(Error::invalid(
                        "same_node",
                        format!("true for rank {peer}"),
                        format!(
                            "rank {peer} is on another node of {} GPUs",
                            layout.gpus_per_node
                        ),
                    ));
                }
                *entry = mem.peer_ptr(peer)?.map(|p| p.addr()).ok_or_else(|| {
                    Error::invalid(
                        "same_node",
                        format!("true for rank {peer}"),
                        "NVSHMEM gives no NVLink/P2P address of that rank's buffer",
                    )
                })?;
            }
        }
        let mut peers = stream.alloc_zeros::<u64>(r)?;
        stream.memcpy_htod(&table, &mut peers)?;
        stream.synchronize()?;
        let kernels = Kernels::for_stream(stream)?;
        for (file, name) in [
            (NOTIFY_FILE, "internode_notify"),
            (DISPATCH_FILE, "internode_dispatch_send"),
            (COMBINE_FILE, "internode_combine_send"),
        ] {
            crate::cuda::nvshmem_module_init(nv, &*kernels.kernel(file, name)?)?;
        }
        Ok(Self {
            recv_counter: HostMappedI32::new(&ctx, 1 + r, -1)?,
            expert_counter: HostMappedI32::new(&ctx, MAX_LOCAL_EXPERTS, -1)?,
            error_record: HostMappedI32::new(&ctx, 4, 0)?,
            mem,
            _nv: nv.clone(),
            ctx,
            layout,
            rank,
            peers,
            timeout: DEFAULT_TIMEOUT,
            seq: AtomicU64::new(0),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &InternodeLayout {
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

    /// Sets how long a device wait may take before it names the rank it waited for (0 =
    /// forever).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The sequence number of the next op (the same on every rank while all ranks run the
    /// same ops).
    pub(super) fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Fails with the rank a device wait timed out on, if the error record holds one (and
    /// clears it).
    pub fn check_error(&self) -> Result<()> {
        let rec = self.error_record.to_vec();
        if rec[0] == 0 {
            return Ok(());
        }
        self.error_record.fill(0);
        Err(Error::PeerTimeout {
            rank: usize::try_from(rec[1]).unwrap_or(usize::MAX),
            kernel: KERNEL_NAMES
                .get(usize::try_from(rec[2]).unwrap_or(0))
                .copied()
                .unwrap_or(KERNEL_NAMES[0]),
        })
    }

    /// The kernels' view of the buffer.
    pub(super) fn view(&self, stream: &CudaStream) -> InBuffer {
        let l = &self.layout;
        let (peers, _g) = self.peers.device_ptr(stream);
        InBuffer {
            local: self.mem.as_device_ptr().addr(),
            peers,
            error_info: self.error_record.device_ptr(),
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
            off_sync: l.off_sync as u64,
            off_counts: l.off_counts as u64,
            off_rdma_sig: l.off_rdma_sig as u64,
            off_comb_sig: l.off_comb_sig as u64,
            off_recv: l.off_recv as u64,
            off_stage: l.off_stage as u64,
            off_comb_in: l.off_comb_in as u64,
            slot_bytes: l.slot_bytes as u64,
            comb_bytes: l.comb_bytes as u64,
            rank: self.rank as i32,
            num_ranks: l.num_ranks as i32,
            gpus_per_node: l.gpus_per_node as i32,
            num_nodes: l.num_nodes() as i32,
            max_tokens: l.max_tokens as i32,
            count_stride: l.count_stride as i32,
        }
    }

    /// Byte offset (the same in every buffer) and ranks `(first, stride, count)` of a signal.
    pub(super) fn signal_target(&self, target: SignalTarget) -> (u64, i32, i32, i32) {
        let l = &self.layout;
        let (p, node, local) = (
            l.gpus_per_node,
            self.rank / l.gpus_per_node,
            self.rank % l.gpus_per_node,
        );
        match target {
            SignalTarget::Nodes => (
                (l.off_rdma_sig + 8 * node) as u64,
                local as i32,
                p as i32,
                l.num_nodes() as i32,
            ),
            SignalTarget::NodePeers => (
                (l.off_comb_sig + 8 * local) as u64,
                (node * p) as i32,
                1,
                p as i32,
            ),
        }
    }
}
