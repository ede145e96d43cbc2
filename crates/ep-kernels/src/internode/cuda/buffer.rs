//! The internode buffer of one rank: its layout on NVSHMEM's symmetric heap, the peer table
//! of its node, the host-mapped counters and error record, and the op sequence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::cuda::{assert_params_layout, Kernels};
use crate::error::{Error, Result};
use crate::intranode::MAX_LOCAL_EXPERTS;
use crate::memory::HostMappedI32;
use crate::FP8_GROUP;

/// Most GPUs per node (a token's node mask is one byte).
pub const MAX_GPUS_PER_NODE: usize = 8;
/// Most nodes (the receive kernel reads at most 8 x 32 blocks).
pub const MAX_NODES: usize = 32;
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

fn align(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// Where the parts of one dispatch message lie in a slot (mirror of `InMessage`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageLayout {
    pub(super) row_bytes: i32,
    pub(super) num_scales: i32,
    pub(super) off_scales: i32,
    pub(super) off_idx: i32,
    pub(super) off_weights: i32,
    pub(super) off_src: i32,
    pub(super) msg_bytes: i32,
    pub(super) num_topk: i32,
}
assert_params_layout!(
    MessageLayout,
    32;
    row_bytes = 0, num_scales = 4, off_scales = 8, off_idx = 12, off_weights = 16, off_src = 20,
    msg_bytes = 24, num_topk = 28,
);

impl MessageLayout {
    /// A message of `hidden` channels (fp8 with its scales, or bf16) and `num_topk` ids and
    /// weights: `[row | scales | ids | weights | source index]`, each part 16-byte aligned.
    pub fn new(hidden: usize, fp8: bool, num_topk: usize) -> Result<Self> {
        let granule = if fp8 { FP8_GROUP } else { 8 };
        if hidden == 0 || hidden % granule != 0 {
            return Err(Error::invalid(
                "hidden",
                hidden,
                format!("must be a positive multiple of {granule}"),
            ));
        }
        let (row, scales) = if fp8 {
            (hidden, hidden / FP8_GROUP)
        } else {
            (2 * hidden, 0)
        };
        let off_scales = align(row, 16);
        let off_idx = off_scales + align(4 * scales, 16);
        let off_weights = off_idx + align(4 * num_topk, 16);
        let off_src = off_weights + align(4 * num_topk, 16);
        let i = |arg, v: usize| {
            i32::try_from(v).map_err(|_| Error::invalid(arg, v, "must fit in an i32"))
        };
        Ok(Self {
            row_bytes: i("hidden", row)?,
            num_scales: i("hidden", scales)?,
            off_scales: i("hidden", off_scales)?,
            off_idx: i("hidden", off_idx)?,
            off_weights: i("num_topk", off_weights)?,
            off_src: i("num_topk", off_src)?,
            msg_bytes: i("hidden", off_src + 16)?,
            num_topk: i("num_topk", num_topk)?,
        })
    }

    /// Bytes of one message.
    pub fn bytes(&self) -> usize {
        self.msg_bytes as usize
    }
}

/// Bytes of a combine row of `hidden` bf16 channels and `num_topk` weights, and the offset of
/// the weights in it.
pub(super) fn combine_row(hidden: usize, num_topk: usize) -> (usize, usize) {
    let off_w = align(2 * hidden, 16);
    (off_w + align(4 * num_topk, 16), off_w)
}

/// Byte offsets of one rank's internode buffer (the same on every rank; see
/// `internode.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternodeLayout {
    /// Ranks `R`.
    pub num_ranks: usize,
    /// GPUs per node `P`.
    pub gpus_per_node: usize,
    /// Most tokens a rank dispatches in one op (`M`).
    pub max_tokens: usize,
    /// Largest hidden size of an op.
    pub max_hidden: usize,
    /// Largest top-k of an op.
    pub max_topk: usize,
    slot_bytes: usize,
    comb_bytes: usize,
    count_stride: usize,
    off_sync: usize,
    off_counts: usize,
    off_rdma_sig: usize,
    off_comb_sig: usize,
    off_recv: usize,
    off_stage: usize,
    off_comb_in: usize,
    /// Bytes of the whole buffer.
    pub total_bytes: usize,
}

impl InternodeLayout {
    /// The layout for `num_ranks` ranks in nodes of `gpus_per_node`, ops of at most
    /// `max_tokens` tokens per rank of at most `max_hidden` channels and `max_topk` experts.
    /// Bytes: `(2 N + R) * max_tokens` rows of about `2 * max_hidden` bytes, plus the counts.
    pub fn new(
        num_ranks: usize,
        gpus_per_node: usize,
        max_tokens: usize,
        max_hidden: usize,
        max_topk: usize,
    ) -> Result<Self> {
        if gpus_per_node == 0 || gpus_per_node > MAX_GPUS_PER_NODE {
            return Err(Error::invalid(
                "gpus_per_node",
                gpus_per_node,
                format!("must be in 1..={MAX_GPUS_PER_NODE}"),
            ));
        }
        if num_ranks == 0 || num_ranks % gpus_per_node != 0 {
            return Err(Error::invalid(
                "num_ranks",
                num_ranks,
                format!("must be a positive multiple of gpus_per_node = {gpus_per_node}"),
            ));
        }
        let nodes = num_ranks / gpus_per_node;
        if nodes > MAX_NODES {
            return Err(Error::invalid(
                "num_nodes",
                nodes,
                format!("must be <= {MAX_NODES}"),
            ));
        }
        if max_tokens == 0 || max_tokens * num_ranks >= (1 << 31) {
            return Err(Error::invalid(
                "max_tokens",
                max_tokens,
                "must be positive, and max_tokens * num_ranks < 2^31",
            ));
        }
        let msg = MessageLayout::new(max_hidden, false, max_topk)?.bytes();
        let (comb, _) = combine_row(max_hidden, max_topk);
        let slot_bytes = align(msg.max(comb), 16);
        let count_stride = num_ranks + nodes + num_ranks * MAX_LOCAL_EXPERTS;
        let m = max_tokens;
        let mut at = 0;
        let mut region = |bytes: usize| {
            let off = at;
            at = align(at + bytes, 128);
            off
        };
        let off_sync = region(8 * num_ranks);
        let off_counts = region(4 * 2 * num_ranks * count_stride);
        let off_rdma_sig = region(8 * nodes);
        let off_comb_sig = region(8 * gpus_per_node);
        let off_recv = region(nodes * m * slot_bytes);
        let off_stage = region(nodes * m * slot_bytes);
        let off_comb_in = region(gpus_per_node * nodes * m * comb);
        Ok(Self {
            num_ranks,
            gpus_per_node,
            max_tokens,
            max_hidden,
            max_topk,
            slot_bytes,
            comb_bytes: comb,
            count_stride,
            off_sync,
            off_counts,
            off_rdma_sig,
            off_comb_sig,
            off_recv,
            off_stage,
            off_comb_in,
            total_bytes: at,
        })
    }

    /// Nodes `N`.
    pub fn num_nodes(&self) -> usize {
        self.num_ranks / self.gpus_per_node
    }

    /// Checks that an op of `num_tokens` tokens with `msg` messages and combine rows of
    /// `hidden` x `num_topk` fits.
    pub(super) fn check_op(
        &self,
        num_tokens: usize,
        msg: Option<&MessageLayout>,
        comb: Option<(usize, usize)>,
    ) -> Result<()> {
        if num_tokens > self.max_tokens {
            return Err(Error::invalid(
                "num_tokens",
                num_tokens,
                format!(
                    "the internode buffer holds at most max_tokens = {} per rank",
                    self.max_tokens
                ),
            ));
        }
        if let Some(m) = msg {
            if m.bytes() > self.slot_bytes {
                return Err(Error::invalid(
                    "x",
                    format!("messages of {} bytes (hidden x top-k)", m.bytes()),
                    format!(
                        "the internode buffer was sized for hidden <= {} and top-k <= {}",
                        self.max_hidden, self.max_topk
                    ),
                ));
            }
        }
        if let Some((hidden, k)) = comb {
            let (bytes, _) = combine_row(hidden, k);
            if bytes > self.comb_bytes {
                return Err(Error::invalid(
                    "x",
                    format!("combine rows of hidden {hidden} and top-k {k}"),
                    format!(
                        "the internode buffer was sized for hidden <= {} and top-k <= {}",
                        self.max_hidden, self.max_topk
                    ),
                ));
            }
        }
        Ok(())
    }
}

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

    /// Whether the error record holds a timeout (without clearing it).
    pub fn has_error(&self) -> bool {
        self.error_record.get(0) != 0
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
