//! The CUDA backend of [`Buffer`](crate::Buffer): NVLink buffers mapped across the ranks of a
//! node, a communication stream, host-mapped counters, and the ops on CUDA tensors.
//!
//! Built by [`Buffer::new`](crate::Buffer::new) / [`Buffer::from_store`](crate::Buffer::from_store)
//! when the device is CUDA, as the buffer's [`Backend::Cuda`](crate::backend::Backend); it sees
//! the buffer only through [`Group`]. The low-latency ops return raw parts that the op modules
//! assemble; the layout and normal-mode ops (`normal.rs`) take the public argument types and
//! build the public outputs themselves. Every rank allocates its NVLink buffer (normal mode)
//! and, with [`BufferConfig::low_latency`](crate::BufferConfig::low_latency), its low-latency
//! buffer with `cuMemAlloc` (`ep_kernels::memory`); the ranks swap IPC handles (or raw
//! pointers, for ranks that are threads of one process) through the group's all-gather.
//! Communication kernels run on the buffer's own stream: it first waits for the caller's
//! `previous_event` (or for candle's stream), and at the end either candle's stream waits for
//! it (synchronous mode) or the caller gets an [`EventOverlap`] to wait on (`async_finish`).
//! Across nodes (feature `nvshmem`, `Topology::num_nodes() > 1`) the low-latency buffer lies
//! on NVSHMEM's symmetric heap (ranks of this node over NVLink, the others through NVSHMEM
//! puts), and with [`BufferConfig::internode`](crate::BufferConfig::internode) the normal mode
//! runs the internode kernels over a second buffer on that heap (`internode.rs`); without it
//! the normal ops fail with `Error::Unsupported`.

pub(crate) mod cast;
mod common;
pub mod graph;
pub(crate) mod handle_data;
#[cfg(feature = "nvshmem")]
mod internode;
mod ll_ops;
mod ll_recv;
mod low_latency;
mod memory;
mod normal;
mod normal_launch;
pub mod tensor;

pub(crate) use common::kernel_err;
pub(crate) use ll_ops::{LlCombineDims, LlHostPlan};
pub(crate) use ll_recv::CudaLlDispatchData;
pub(crate) use low_latency::LowLatencyCuda;

use crate::config::BufferConfig;
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::group::Group;
use crate::topology::Topology;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use common::gather_records;
use cudarc::driver::{CudaContext, CudaStream};
use ep_kernels::intranode as ki;
use ep_kernels::memory::DeviceMemory;
use memory::{PeerMap, PeerRecord};
use normal_launch::CeConfigs;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The CUDA state of one rank's [`Buffer`](crate::Buffer): streams, the node's mapped NVLink buffers, the
/// host-mapped notify counters and error record, and the low-latency buffer.
#[derive(Debug)]
pub(crate) struct CudaBuffer {
    dev: CudaDevice,
    /// candle's stream (the caller's compute stream).
    compute: Arc<CudaStream>,
    /// The communication stream (same context).
    comm: Arc<CudaStream>,
    rank: usize,
    num_ranks: usize,
    timeout: Duration,
    /// Normal mode over the node's NVLink buffers (`None` across nodes).
    normal: Option<NormalCuda>,
    /// Normal mode across nodes (`BufferConfig::internode` set, feature `nvshmem`).
    #[cfg(feature = "nvshmem")]
    internode: Option<internode::InternodeCuda>,
    /// Nodes of the group.
    num_nodes: usize,
    /// The low-latency mode (its buffer, mask tracking and ops).
    ll: LowLatencyCuda,
    /// Serialises ops of this buffer, of both modes (they share the streams, the NVLink
    /// buffer and counters).
    op: Arc<Mutex<()>>,
}

/// The normal mode's state on one node: launch configurations, the mapped NVLink buffers, the
/// copy streams and the host-mapped counters.
#[derive(Debug)]
pub(crate) struct NormalCuda {
    /// Ring launch configurations of dispatch (and notify) and of combine: the same SMs and
    /// rings, each op's own chunk.
    kdispatch: ki::Config,
    kcombine: ki::Config,
    /// The kernels' view of the node's NVLink buffers.
    peer_buffers: ki::PeerBuffers,
    /// Copy-engine path: its launch configurations (`None`: SM rings only) and one copy
    /// stream per peer.
    ce: Option<CeConfigs>,
    copies: ki::CopyStreams,
    /// Peers' NVLink buffers mapped into this context (dropped before `nvl`).
    _nvl_peers: PeerMap,
    /// This rank's NVLink buffer.
    nvl: DeviceMemory,
    /// Word 0: tokens this rank receives, word `1 + s`: from source `s` (written by notify).
    recv_counter: ki::HostMappedI32,
    /// `[MAX_LOCAL_EXPERTS]` aligned tokens per local expert (written by notify).
    expert_counter: ki::HostMappedI32,
    /// 4 words: the normal-mode kernels' error record.
    error_record: ki::HostMappedI32,
}

impl CudaBuffer {
    /// Builds the CUDA state of a buffer on `device` for rank `topo` of `group` (a
    /// collective: every rank of the group calls it once, in the same order as its other
    /// buffers). On one node both modes run over NVLink; across nodes (feature `nvshmem`) the
    /// low-latency mode runs over NVSHMEM, and the normal mode too when configured.
    pub(crate) fn new(
        device: &Device,
        topo: Topology,
        cfg: &BufferConfig,
        group: &dyn Group,
    ) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            return Err(Error::invalid(
                "device",
                format!("{device:?}"),
                "the CUDA backend needs a CUDA device",
            ));
        };
        let across_nodes = topo.num_nodes() > 1;
        if across_nodes && !cfg!(feature = "nvshmem") {
            return Err(Error::Unsupported(format!(
                "{} nodes of {} GPUs: CUDA buffers across nodes need ep-runtime's `nvshmem` \
                 feature (low-latency mode over NVSHMEM); this build supports one node (NVLink)",
                topo.num_nodes(),
                topo.gpus_per_node
            )));
        }
        if !across_nodes && topo.num_ranks > ki::MAX_NVL_RANKS {
            return Err(Error::invalid(
                "num_ranks",
                topo.num_ranks,
                format!(
                    "CUDA buffers support at most {} ranks on one node",
                    ki::MAX_NVL_RANKS
                ),
            ));
        }
        let compute = dev.cuda_stream();
        let ctx: Arc<CudaContext> = compute.context().clone();
        ctx.bind_to_thread()?;
        // Ops allocate their outputs stream-ordered on every call: keep freed memory pooled.
        ep_kernels::cuda::retain_pool_memory(&ctx).map_err(|e| kernel_err(e, cfg.timeout))?;
        let comm =
            ep_kernels::cuda::new_comm_stream(&ctx).map_err(|e| kernel_err(e, cfg.timeout))?;
        let normal = if across_nodes {
            None
        } else {
            Some(NormalCuda::new(&ctx, &comm, topo, cfg, group)?)
        };
        let op = Arc::new(Mutex::new(()));
        #[cfg(feature = "nvshmem")]
        let nvshmem = if across_nodes {
            Some(crate::transport::nvshmem_for_group(
                group,
                topo,
                ctx.ordinal(),
            )?)
        } else {
            None
        };
        // Symmetric allocations are collective: every rank makes them in the same order.
        #[cfg(feature = "nvshmem")]
        let internode = match (&nvshmem, cfg.internode) {
            (Some(nv), Some(sizing)) => Some(internode::InternodeCuda::new(
                &comm,
                topo,
                sizing,
                nv,
                cfg.timeout,
            )?),
            _ => None,
        };
        let ll = LowLatencyCuda::new(dev, &comm, topo, cfg.timeout, op.clone());
        #[cfg(feature = "nvshmem")]
        let ll = ll.with_nvshmem(nvshmem);
        let this = Self {
            dev: dev.clone(),
            compute,
            comm,
            rank: topo.rank,
            num_ranks: topo.num_ranks,
            timeout: cfg.timeout,
            normal,
            #[cfg(feature = "nvshmem")]
            internode,
            num_nodes: topo.num_nodes(),
            ll,
            op,
        };
        if let Some(ll) = cfg.low_latency {
            this.ll.build(
                group,
                ll.max_tokens_per_rank,
                ll.hidden.div_ceil(ep_kernels::FP8_GROUP) * ep_kernels::FP8_GROUP,
                ll.num_experts,
            )?;
        }
        tracing::debug!(
            rank = topo.rank,
            nodes = topo.num_nodes(),
            nvl_bytes = this.normal.as_ref().map_or(0, |n| n.nvl.bytes()),
            "CUDA buffer ready"
        );
        Ok(this)
    }

    /// Whether the normal mode is available (one node, or across nodes with the internode
    /// path configured).
    pub(crate) fn has_normal_mode(&self) -> bool {
        #[cfg(feature = "nvshmem")]
        if self.internode.is_some() {
            return true;
        }
        self.normal.is_some()
    }

    /// The one-node normal mode's state, or the error that says why a buffer across nodes
    /// has none.
    fn normal_mode(&self) -> Result<&NormalCuda> {
        self.normal.as_ref().ok_or_else(|| {
            Error::Unsupported(format!(
                "normal mode (dispatch / combine) of a CUDA buffer across {} nodes: the \
                 internode normal path needs `BufferConfig::with_internode` (and ep-runtime's \
                 `nvshmem` feature); this buffer runs the low-latency ops (over NVSHMEM)",
                self.num_nodes
            ))
        })
    }

    /// The internode normal mode, for a handle it made.
    #[cfg(feature = "nvshmem")]
    fn internode(&self) -> Result<&internode::InternodeCuda> {
        self.internode.as_ref().ok_or_else(|| {
            Error::HandleMismatch(
                "the handle was made by the internode path of another buffer".into(),
            )
        })
    }

    /// The communication stream.
    pub(crate) fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm
    }

    /// The low-latency mode.
    pub(crate) fn low_latency(&self) -> &LowLatencyCuda {
        &self.ll
    }

    /// Makes the communication stream wait for `previous` (or for candle's stream).
    fn begin(&self, previous: Option<&EventOverlap>) -> Result<()> {
        common::begin(&self.compute, &self.comm, previous)
    }

    /// Records the end of the op on the communication stream; in synchronous mode candle's
    /// stream waits for it too.
    fn finish(&self, async_finish: bool) -> Result<EventOverlap> {
        let ev = common::finish_event(&self.compute, &self.comm, async_finish)?;
        Ok(EventOverlap::from_cuda(ev))
    }

    /// Fails with the rank a normal-mode device wait timed out on, if any (and clears the
    /// record).
    fn check_nvl_error(&self) -> Result<()> {
        let Some(nm) = &self.normal else {
            return Ok(());
        };
        let rec = nm.error_record.to_vec();
        if rec[0] == 0 {
            return Ok(());
        }
        nm.error_record.fill(0);
        match ki::PeerBuffers::check_error(&rec) {
            Ok(()) => Ok(()),
            Err(e) => Err(kernel_err(e, self.timeout)),
        }
    }
}

impl NormalCuda {
    /// Allocates this rank's NVLink buffer, maps the node's (a collective over `group`) and
    /// sets up the launch configurations, copy streams and counters.
    fn new(
        ctx: &Arc<CudaContext>,
        comm: &Arc<CudaStream>,
        topo: Topology,
        cfg: &BufferConfig,
        group: &dyn Group,
    ) -> Result<Self> {
        let c = &cfg.config;
        let (dispatch_chunk, combine_chunk) =
            c.send_tokens(topo.num_ranks, ki::COMBINE_ROUND_TOKENS);
        let kdispatch = ki::Config::new(c.num_sms, dispatch_chunk, c.num_max_recv_tokens)?;
        let kcombine = ki::Config::new(c.num_sms, combine_chunk, c.num_max_recv_tokens)?;
        if c.num_max_recv_tokens < combine_chunk + ki::COMBINE_ROUND_TOKENS {
            return Err(Error::invalid(
                "num_max_recv_tokens",
                c.num_max_recv_tokens,
                format!(
                    "CUDA combine needs at least its chunk ({combine_chunk} tokens) + {} = {}",
                    ki::COMBINE_ROUND_TOKENS,
                    combine_chunk + ki::COMBINE_ROUND_TOKENS
                ),
            ));
        }
        let bytes = cfg.nvl_buffer_bytes(topo.num_ranks);
        let nvl = DeviceMemory::zeroed(comm, bytes)?;
        let records = gather_records(group, PeerRecord::of(&nvl, ctx.ordinal())?)?;
        let nvl_peers = PeerMap::open(ctx, &records, topo.rank, |i| i)?;
        let recv_counter = ki::HostMappedI32::new(ctx, 1 + ki::MAX_NVL_RANKS, -1)?;
        let expert_counter = ki::HostMappedI32::new(ctx, ki::MAX_LOCAL_EXPERTS, -1)?;
        let error_record = ki::HostMappedI32::new(ctx, 4, 0)?;
        // SAFETY: every pointer is a live `cuMemAlloc` buffer of `bytes` bytes (own, opened
        // through IPC, or a peer-accessible pointer of this process) zeroed before the
        // all-gather (so before any peer's first op); `nvl` and `nvl_peers` live as long as
        // `self`, and their `Drop`s synchronise the context before freeing / unmapping; ops
        // are serialised by the buffer's op lock; the error record is host-mapped, 16-byte
        // aligned.
        let peer_buffers = unsafe {
            ki::PeerBuffers::new(
                topo.rank,
                nvl_peers.ptrs(),
                bytes,
                error_record.device_ptr(),
            )
        }?
        .with_timeout(cfg.timeout);
        Ok(Self {
            kdispatch,
            kcombine,
            peer_buffers,
            ce: cfg
                .nvl_transfer
                .uses_copy_engine(topo.num_ranks)
                .then(|| CeConfigs::new(topo.num_ranks, c.num_sms)),
            copies: ki::CopyStreams::new(ctx, topo.num_ranks)?,
            _nvl_peers: nvl_peers,
            nvl,
            recv_counter,
            expert_counter,
            error_record,
        })
    }
}
