//! CUDA IPC of `cuMemAlloc` allocations between processes of one node: the handle of an own
//! allocation ([`get_handle`]), mapping a peer process's allocation ([`open`]) and unmapping
//! it ([`close`]). Who maps what, and when it is closed, is the caller's bookkeeping.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::CudaContext;

use crate::error::Result;

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const HANDLE_BYTES: usize = 64;

/// A `cuIpcGetMemHandle` handle as plain bytes (what ranks send each other).
pub type Handle = [u8; HANDLE_BYTES];

/// The IPC handle of the allocation at `ptr` (binds `ctx` to this thread). Prefer
/// [`super::DeviceMemory::ipc_handle`].
///
/// # Safety
///
/// `ptr` must be the base of a live `cuMemAlloc` allocation of `ctx`.
pub unsafe fn get_handle(ctx: &Arc<CudaContext>, ptr: CUdeviceptr) -> Result<Handle> {
    ctx.bind_to_thread()?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `ptr` is the base of a live `cuMemAlloc` allocation of the current context (the
    // caller's contract); `h` is a valid out-pointer.
    unsafe { sys::cuIpcGetMemHandle(&mut h, ptr) }.result()?;
    let mut handle = [0u8; HANDLE_BYTES];
    for (d, s) in handle.iter_mut().zip(h.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(handle)
}

/// Maps the allocation of another process of this node named by `handle` into the context
/// current on this thread (peer access enabled lazily) and returns its address there. The
/// mapping stays until [`close`]: the caller keeps the address and closes it once.
pub fn open(handle: &Handle) -> Result<CUdeviceptr> {
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(handle.iter()) {
        *d = *s as _;
    }
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: `h` is passed by value (the driver rejects a handle that names no exported
    // allocation of this node); `ptr` is a valid out-pointer; nothing is unmapped here.
    let res = unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    };
    res.result()?;
    Ok(ptr)
}

/// Unmaps an allocation mapped by [`open`].
///
/// # Safety
///
/// `ptr` must have come from [`open`] in the context current on this thread and not be closed
/// yet, and no work (kernels, copies) may still use the mapping.
pub unsafe fn close(ptr: CUdeviceptr) -> Result<()> {
    // SAFETY: `ptr` is an open IPC mapping of the current context that nothing uses any more
    // (the caller's contract).
    unsafe { sys::cuIpcCloseMemHandle(ptr) }.result()?;
    Ok(())
}
