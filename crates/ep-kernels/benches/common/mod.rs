//! One process driving every rank of a node: a context, stream, NVLink buffer and error record
//! per GPU, peer access between all of them, and one host thread per rank.
//!
//! Shared by `benches/intranode/main.rs` and `tests/gpu_intranode.rs` (both include it by path).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::result;
use cudarc::driver::sys::{self, cudaError_enum};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use ep_kernels::intranode::{HostMappedI32, PeerBuffers, HEADER_ZERO_BYTES};

/// Boxed error of the test and bench binaries.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every rank of a node, one GPU each (ordinals `0..num_ranks`).
pub struct Node {
    /// Per rank: its context.
    pub ctxs: Vec<Arc<CudaContext>>,
    /// Per rank: the stream its kernels run on.
    pub streams: Vec<Arc<CudaStream>>,
    /// Per rank: its NVLink buffer (`cuMemAlloc`: stream-ordered pool allocations are not
    /// reachable through peer access).
    pub buffers: Vec<RawBuffer>,
    /// Per rank: its error record (4 words, host-mapped).
    pub errors: Vec<HostMappedI32>,
    /// Per rank: the kernels' view of the node.
    pub peers: Vec<PeerBuffers>,
    /// Bytes of each buffer.
    pub bytes: usize,
}

/// Bytes written before every timed iteration to evict the L2 cache (50 MiB on H100/H200).
pub const L2_FLUSH_BYTES: usize = 256 << 20;

/// A scratch buffer that [`flush_l2`] overwrites to evict the L2 cache of its device.
pub fn l2_flush_buffer(stream: &Arc<CudaStream>) -> Result<CudaSlice<u8>, BoxError> {
    Ok(stream.alloc_zeros(L2_FLUSH_BYTES)?)
}

/// Queues a write of all of `scratch` on `stream`, so that the next work on the stream starts
/// with an L2 cache holding none of its inputs (queue it before the start event: it is not
/// part of the timed region).
pub fn flush_l2(stream: &Arc<CudaStream>, scratch: &mut CudaSlice<u8>) -> Result<(), BoxError> {
    stream.memset_zeros(scratch)?;
    Ok(())
}

/// Number of visible CUDA devices (0 if the driver cannot be loaded).
pub fn device_count() -> usize {
    std::panic::catch_unwind(|| CudaContext::device_count().unwrap_or(0) as usize).unwrap_or(0)
}

impl Node {
    /// Opens GPUs `0..num_ranks`, enables peer access between every pair, and allocates a
    /// zeroed NVLink buffer of `bytes` on each.
    pub fn new(num_ranks: usize, bytes: usize) -> Result<Self, BoxError> {
        let ctxs: Vec<Arc<CudaContext>> = (0..num_ranks)
            .map(CudaContext::new)
            .collect::<Result<_, _>>()?;
        for (i, ci) in ctxs.iter().enumerate() {
            ci.bind_to_thread()?;
            for (j, cj) in ctxs.iter().enumerate() {
                if i == j {
                    continue;
                }
                let mut can = 0;
                // SAFETY: plain query with valid device ordinals and out-pointer.
                unsafe { sys::cuDeviceCanAccessPeer(&mut can, i as i32, j as i32) }.result()?;
                if can == 0 {
                    return Err(format!("GPU {i} cannot access GPU {j} as a peer").into());
                }
                // SAFETY: `ci` is current; `cj` is a live context of another device.
                let res = unsafe { sys::cuCtxEnablePeerAccess(cj.cu_ctx(), 0) };
                if res != cudaError_enum::CUDA_SUCCESS
                    && res != cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    res.result()?;
                }
            }
        }
        let streams: Vec<Arc<CudaStream>> = ctxs
            .iter()
            .map(|c| c.new_stream())
            .collect::<Result<_, _>>()?;
        let buffers: Vec<RawBuffer> = ctxs
            .iter()
            .map(|c| RawBuffer::new(c, bytes))
            .collect::<Result<_, _>>()?;
        let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr).collect();
        let errors: Vec<HostMappedI32> = ctxs
            .iter()
            .map(|c| HostMappedI32::new(c, 4, 0))
            .collect::<Result<_, _>>()?;
        for s in &streams {
            s.synchronize()?;
        }
        let peers = (0..num_ranks)
            .map(|r| {
                // SAFETY: the buffers and error records are owned by this `Node` and outlive
                // every kernel it launches (all streams are synchronised before it is dropped);
                // peer access is enabled between every pair; headers are zeroed above; every
                // rank lists the same buffers in rank order.
                unsafe { PeerBuffers::new(r, &ptrs, bytes, errors[r].device_ptr()) }
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            ctxs,
            streams,
            buffers,
            errors,
            peers,
            bytes,
        })
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.ctxs.len()
    }

    /// Sets the device-side timeout of every rank.
    pub fn set_timeout(&mut self, timeout: Duration) {
        for p in &mut self.peers {
            *p = p.with_timeout(timeout);
        }
    }

    /// Runs `f(rank)` on one thread per rank (each bound to its context), concurrently, and
    /// returns the results in rank order.
    pub fn per_rank<T: Send>(
        &self,
        f: impl Fn(usize) -> Result<T, BoxError> + Sync,
    ) -> Result<Vec<T>, BoxError> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..self.num_ranks())
                .map(|r| {
                    let f = &f;
                    let ctx = &self.ctxs[r];
                    scope.spawn(move || -> Result<T, BoxError> {
                        ctx.bind_to_thread()?;
                        f(r)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| BoxError::from("a rank thread panicked"))?
                })
                .collect()
        })
    }

    /// Synchronises every stream, then checks and clears every error record.
    pub fn sync_and_check(&self) -> Result<(), BoxError> {
        for s in &self.streams {
            s.synchronize()?;
        }
        let mut first = Ok(());
        for e in &self.errors {
            let rec = e.to_vec();
            e.fill(0);
            if first.is_ok() {
                first = PeerBuffers::check_error(&rec);
            }
        }
        Ok(first?)
    }

    /// After a timeout: waits for every stream, then zeroes every buffer's header (barrier
    /// signals and counters) and error record so the node can be used again.
    pub fn reset(&mut self) -> Result<(), BoxError> {
        for s in &self.streams {
            s.synchronize()?;
        }
        for b in &self.buffers {
            b.zero(HEADER_ZERO_BYTES)?;
        }
        for e in &self.errors {
            e.fill(0);
        }
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }
}

/// A device allocation made with `cuMemAlloc` (peer-accessible once peer access is enabled).
pub struct RawBuffer {
    /// Device address.
    pub ptr: u64,
    /// Size in bytes.
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl RawBuffer {
    /// Allocates `bytes` on `ctx`'s device, zeroed.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, BoxError> {
        ctx.bind_to_thread()?;
        // SAFETY: plain allocation; zeroed below before anyone reads it.
        let ptr = unsafe { result::malloc_sync(bytes) }?;
        let buf = Self {
            ptr,
            bytes,
            ctx: ctx.clone(),
        };
        buf.zero(bytes)?;
        Ok(buf)
    }

    /// Zeroes the first `bytes` (synchronously; no kernel may be using the buffer).
    pub fn zero(&self, bytes: usize) -> Result<(), BoxError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `ptr` is a live allocation of `self.bytes >= bytes` bytes.
        unsafe { result::memset_d8_sync(self.ptr, 0, bytes.min(self.bytes)) }?;
        Ok(())
    }
}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_sync` and freed once; the owning `Node` synchronised its
        // streams first.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}
