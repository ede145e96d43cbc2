//! The CUDA backend of [`Buffer`](crate::Buffer): NVLink buffers mapped across the ranks of a
//! node, a communication stream, host-mapped counters, and the ops on CUDA tensors.
//!
//! Built by [`Buffer::new`](crate::Buffer::new) / [`Buffer::from_store`](crate::Buffer::from_store)
//! when the device is CUDA. Every rank allocates its NVLink buffer (normal mode) and, with
//! [`BufferConfig::low_latency`](crate::BufferConfig::low_latency), its low-latency buffer
//! with `cuMemAlloc`; the ranks swap IPC handles (or raw pointers, for ranks that are threads
//! of one process) through [`Buffer::host_all_gather`](crate::Buffer::host_all_gather).
//! Communication kernels run on the buffer's own stream: it first waits for the caller's
//! `previous_event` (or for candle's stream), and at the end either candle's stream waits for
//! it (synchronous mode) or the caller gets an [`EventOverlap`] to wait on (`async_finish`).
//! Only one node (all ranks reachable over NVLink) is supported; more nodes need the internode
//! (RDMA / NVSHMEM) transport, which is not available yet.

pub(crate) mod cast;
pub mod graph;
mod ll_recv;
mod low_latency;
mod memory;
mod normal;
pub mod tensor;

pub(crate) use ll_recv::CudaLlDispatchData;
pub(crate) use low_latency::LlHostPlan;
pub(crate) use normal::{CudaHandleData, FreshDispatch};

use crate::buffer::Buffer;
use crate::config::BufferConfig;
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use cudarc::driver::{CudaContext, CudaStream};
use ep_kernels::intranode as ki;
use low_latency::LlState;
use memory::{DeviceMemory, PeerMap, PeerRecord};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The CUDA state of one rank's [`Buffer`]: streams, the node's mapped NVLink buffers, the
/// host-mapped notify counters and error record, and the low-latency buffer.
#[derive(Debug)]
pub(crate) struct CudaBuffer {
    dev: CudaDevice,
    /// The id of the [`Buffer`] this belongs to (stamped into handles).
    buffer_id: u64,
    /// candle's stream (the caller's compute stream).
    compute: Arc<CudaStream>,
    /// The communication stream (same context).
    comm: Arc<CudaStream>,
    rank: usize,
    num_ranks: usize,
    timeout: Duration,
    kconfig: ki::Config,
    /// The kernels' view of the node's NVLink buffers.
    peer_buffers: ki::PeerBuffers,
    /// Copy-engine path: its dispatch and combine launch configurations (`None`: SM rings
    /// only) and one copy stream per peer.
    ce: Option<(ki::CeConfig, ki::CeConfig)>,
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
    /// The low-latency buffer, (re)built for the sizing the ops use.
    ll: Mutex<Option<LlState>>,
    /// Serialises ops of this buffer (they share the NVLink buffer and counters).
    op: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Turns a kernel-layer error into the runtime's, keeping a peer timeout's rank.
pub(crate) fn kernel_err(e: ep_kernels::Error, timeout: Duration) -> Error {
    match e {
        ep_kernels::Error::PeerTimeout { rank, kernel } => Error::Timeout {
            rank,
            what: format!("device wait in kernel `{kernel}`"),
            waited: timeout,
        },
        other => Error::Kernel(other),
    }
}

impl CudaBuffer {
    /// Builds the CUDA state of `buf` (a collective: every rank of the group calls it once,
    /// in the same order as its other buffers).
    pub(crate) fn new(buf: &Buffer) -> Result<Self> {
        let Device::Cuda(dev) = &buf.device else {
            return Err(Error::invalid(
                "device",
                format!("{:?}", buf.device),
                "the CUDA backend needs a CUDA device",
            ));
        };
        let topo = buf.topology;
        if topo.num_nodes() > 1 {
            return Err(Error::Unsupported(format!(
                "{} nodes of {} GPUs: CUDA buffers support one node (NVLink) only; the internode \
                 transport (RDMA / NVSHMEM) is not available yet",
                topo.num_nodes(),
                topo.gpus_per_node
            )));
        }
        if topo.num_ranks > ki::MAX_NVL_RANKS {
            return Err(Error::invalid(
                "num_ranks",
                topo.num_ranks,
                format!(
                    "CUDA buffers support at most {} ranks on one node",
                    ki::MAX_NVL_RANKS
                ),
            ));
        }
        let cfg: &BufferConfig = &buf.config;
        let c = &cfg.config;
        let kconfig = ki::Config::new(c.num_sms, c.num_max_send_tokens, c.num_max_recv_tokens)?;
        if c.num_max_recv_tokens < c.num_max_send_tokens + ki::COMBINE_ROUND_TOKENS {
            return Err(Error::invalid(
                "num_max_recv_tokens",
                c.num_max_recv_tokens,
                format!(
                    "CUDA combine needs at least num_max_send_tokens + {} = {}",
                    ki::COMBINE_ROUND_TOKENS,
                    c.num_max_send_tokens + ki::COMBINE_ROUND_TOKENS
                ),
            ));
        }
        let compute = dev.cuda_stream();
        let ctx: Arc<CudaContext> = compute.context().clone();
        ctx.bind_to_thread()?;
        // Ops allocate their outputs stream-ordered on every call: keep freed memory pooled.
        ep_kernels::cuda::retain_pool_memory(&ctx).map_err(|e| kernel_err(e, cfg.timeout))?;
        let comm = ctx.new_stream()?;
        let bytes = cfg.num_nvl_bytes.unwrap_or_else(|| {
            let rings = ki::buffer_size_hint(
                BufferConfig::DEFAULT_NVL_HIDDEN,
                BufferConfig::DEFAULT_NVL_TOPK,
                topo.num_ranks,
                &kconfig,
            );
            let ce = ki::ce_buffer_size_hint(
                BufferConfig::DEFAULT_NVL_TOKENS,
                BufferConfig::DEFAULT_NVL_HIDDEN,
                BufferConfig::DEFAULT_NVL_TOPK,
                topo.num_ranks,
            );
            if cfg.nvl_transfer.uses_copy_engine(topo.num_ranks) {
                rings.max(ce)
            } else {
                rings
            }
        });
        let bytes = bytes.max(ki::RING_BASE).div_ceil(128) * 128;
        let nvl = DeviceMemory::zeroed(&comm, bytes)?;
        let records = gather_records(buf, PeerRecord::of(&nvl, ctx.ordinal())?)?;
        let nvl_peers = PeerMap::open(&ctx, &records, topo.rank, |i| i)?;
        let recv_counter = ki::HostMappedI32::new(&ctx, 1 + ki::MAX_NVL_RANKS, -1)?;
        let expert_counter = ki::HostMappedI32::new(&ctx, ki::MAX_LOCAL_EXPERTS, -1)?;
        let error_record = ki::HostMappedI32::new(&ctx, 4, 0)?;
        // SAFETY: every pointer is a live `cuMemAlloc` buffer of `bytes` bytes (own, opened
        // through IPC, or a peer-accessible pointer of this process) zeroed before the
        // all-gather (so before any peer's first op); `nvl` and `nvl_peers` live as long as
        // `self`, and their `Drop`s synchronise the context before freeing / unmapping; ops
        // are serialised by `self.op`; the error record is host-mapped, 16-byte aligned.
        let peer_buffers = unsafe {
            ki::PeerBuffers::new(
                topo.rank,
                nvl_peers.ptrs(),
                bytes,
                error_record.device_ptr(),
            )
        }?
        .with_timeout(cfg.timeout);
        let this = Self {
            dev: dev.clone(),
            buffer_id: buf.id,
            compute,
            comm,
            rank: topo.rank,
            num_ranks: topo.num_ranks,
            timeout: cfg.timeout,
            kconfig,
            peer_buffers,
            ce: cfg.nvl_transfer.uses_copy_engine(topo.num_ranks).then(|| {
                (
                    ki::CeConfig::dispatch_for(topo.num_ranks, c.num_sms),
                    ki::CeConfig::combine_for(topo.num_ranks, c.num_sms),
                )
            }),
            copies: ki::CopyStreams::new(&ctx, topo.num_ranks)?,
            _nvl_peers: nvl_peers,
            nvl,
            recv_counter,
            expert_counter,
            error_record,
            ll: Mutex::new(None),
            op: Mutex::new(()),
        };
        if let Some(ll) = cfg.low_latency {
            let state = LlState::new(
                buf,
                &this,
                ll.max_tokens_per_rank,
                ll.hidden.div_ceil(ep_kernels::FP8_GROUP) * ep_kernels::FP8_GROUP,
                ll.num_experts,
            )?;
            *lock(&this.ll) = Some(state);
        }
        tracing::debug!(
            rank = topo.rank,
            nvl_bytes = this.nvl.bytes(),
            "CUDA buffer ready"
        );
        Ok(this)
    }

    /// The communication stream.
    pub(crate) fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm
    }

    /// Makes the communication stream wait for `previous` (or for candle's stream).
    fn begin(&self, previous: Option<&EventOverlap>) -> Result<()> {
        self.dev.cuda_stream().context().bind_to_thread()?;
        match previous {
            Some(e) => e.stream_wait(&self.comm),
            None => Ok(self.comm.join(&self.compute)?),
        }
    }

    /// Records the end of the op on the communication stream; in synchronous mode candle's
    /// stream waits for it too.
    fn finish(&self, async_finish: bool) -> Result<EventOverlap> {
        Ok(EventOverlap::from_cuda(self.finish_event(async_finish)?))
    }

    /// [`Self::finish`], returning the recorded event itself (low-latency ops also poll it).
    fn finish_event(&self, async_finish: bool) -> Result<Arc<cudarc::driver::CudaEvent>> {
        let ev = Arc::new(self.comm.record_event(None)?);
        if !async_finish {
            self.compute.wait(&ev)?;
        }
        Ok(ev)
    }

    /// Fails with the rank a normal-mode device wait timed out on, if any (and clears the
    /// record).
    fn check_nvl_error(&self) -> Result<()> {
        let rec = self.error_record.to_vec();
        if rec[0] == 0 {
            return Ok(());
        }
        self.error_record.fill(0);
        match ki::PeerBuffers::check_error(&rec) {
            Ok(()) => Ok(()),
            Err(e) => Err(kernel_err(e, self.timeout)),
        }
    }
}

/// All-gathers `own` and returns the records of the node's ranks (index = local rank).
fn gather_records(buf: &Buffer, own: PeerRecord) -> Result<Vec<PeerRecord>> {
    let all = buf.host_all_gather(&own.to_bytes())?;
    all.iter()
        .enumerate()
        .map(|(r, b)| PeerRecord::from_bytes(b, r))
        .collect()
}
