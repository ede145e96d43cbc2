//! The copy streams of one rank, the event fork / join between them and the compute stream,
//! and the copy-engine copy itself.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::MAX_COPY_LANES;
use crate::error::{Error, Result};

/// The copy streams of one rank: [`MAX_COPY_LANES`] per peer, so that a late peer delays only
/// its own copies.
#[derive(Debug)]
pub struct CopyStreams {
    streams: Vec<Arc<CudaStream>>,
}

impl CopyStreams {
    /// Creates `MAX_COPY_LANES` streams per rank on `ctx` (those of this rank's own index stay
    /// unused), at the greatest priority: their wait kernels then start ahead of compute.
    pub fn new(ctx: &Arc<CudaContext>, num_ranks: usize) -> Result<Self> {
        let streams = (0..num_ranks * MAX_COPY_LANES)
            .map(|_| crate::cuda::new_comm_stream(ctx))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { streams })
    }

    /// Copy stream `lane` of `peer`.
    pub(crate) fn get(&self, peer: usize, lane: usize) -> Result<&Arc<CudaStream>> {
        self.streams
            .get(peer * MAX_COPY_LANES + lane % MAX_COPY_LANES)
            .ok_or_else(|| {
                Error::invalid(
                    "copy_streams",
                    format!("{} streams", self.streams.len()),
                    format!("needs {MAX_COPY_LANES} per rank (peer {peer})"),
                )
            })
    }
}

/// Makes each copy stream wait for `stream`'s work so far; returns nothing.
pub(crate) fn fork(
    stream: &CudaStream,
    copies: &CopyStreams,
    peers: impl Iterator<Item = usize>,
    lanes: usize,
) -> Result<()> {
    let ev = stream.record_event(None)?;
    for p in peers {
        for lane in 0..lanes {
            copies.get(p, lane)?.wait(&ev)?;
        }
    }
    Ok(())
}

/// Makes `stream` wait for the copy streams of `peers`.
pub(crate) fn join(
    stream: &CudaStream,
    copies: &CopyStreams,
    peers: impl Iterator<Item = usize>,
    lanes: usize,
) -> Result<()> {
    for p in peers {
        for lane in 0..lanes {
            let ev = copies.get(p, lane)?.record_event(None)?;
            stream.wait(&ev)?;
        }
    }
    Ok(())
}

/// Async device-to-device copy of `bytes` on `stream`.
///
/// # Safety
///
/// Both ranges must be valid device memory in `stream`'s context (own or peer-mapped) for
/// the copy's duration, not written concurrently by anything unordered with it.
pub(crate) unsafe fn copy(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller guarantees both ranges (this function's contract).
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }?;
    Ok(())
}
