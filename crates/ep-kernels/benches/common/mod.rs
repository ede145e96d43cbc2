//! One process driving every rank of a node: a context, stream, NVLink buffer and error record
//! per GPU, peer access between all of them, and one host thread per rank.
//!
//! Shared by `benches/intranode/main.rs` and `tests/gpu_intranode.rs` (both include it by path).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use ep_kernels::intranode::{PeerBuffers, HEADER_ZERO_BYTES};
use ep_kernels::memory::{enable_peer_access, DeviceMemory, HostMappedI32};

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
    pub buffers: Vec<DeviceMemory>,
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
            for (j, cj) in ctxs.iter().enumerate() {
                if i != j {
                    enable_peer_access(ci, cj)?;
                }
            }
        }
        let streams: Vec<Arc<CudaStream>> = ctxs
            .iter()
            .map(|c| c.new_stream())
            .collect::<Result<_, _>>()?;
        let buffers: Vec<DeviceMemory> = ctxs
            .iter()
            .map(|c| {
                let mut b = DeviceMemory::alloc(c, bytes)?;
                b.zero_sync(bytes)?;
                Ok::<_, ep_kernels::Error>(b)
            })
            .collect::<Result<_, _>>()?;
        let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr()).collect();
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
        for b in &mut self.buffers {
            b.zero_sync(HEADER_ZERO_BYTES)?;
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
