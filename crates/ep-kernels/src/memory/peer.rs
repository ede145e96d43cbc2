//! Peer access between the contexts of one process (one process driving several GPUs: kernels
//! of one device then load and store the others' memory through their raw pointers).

use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// Lets kernels of `ctx` access memory of `peer` (one process driving several GPUs: the
/// peer pointers of [`LowLatencyBuffer::connect`](crate::low_latency::LowLatencyBuffer::connect)
/// and of the intranode buffers). Enabling twice is not an error.
pub fn enable_peer_access(ctx: &CudaContext, peer: &CudaContext) -> Result<()> {
    use cudarc::driver::sys::{cuCtxEnablePeerAccess, cuDeviceCanAccessPeer, CUresult};
    if ctx.cu_ctx() == peer.cu_ctx() {
        return Ok(());
    }
    ctx.bind_to_thread()?;
    let mut can = 0i32;
    // SAFETY: both devices are valid handles of live contexts; `can` outlives the call.
    unsafe { cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), peer.cu_device()) }.result()?;
    if can == 0 {
        return Err(Error::invalid(
            "peer",
            format!("device {}", peer.ordinal()),
            format!("is not peer-accessible from device {}", ctx.ordinal()),
        ));
    }
    // SAFETY: `ctx` is current on this thread and `peer` is a live context.
    match unsafe { cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => Err(e.result().unwrap_err().into()),
    }
}
