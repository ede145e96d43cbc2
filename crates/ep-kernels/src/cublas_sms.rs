//! cuBLAS calls that leave SMs free for a kernel running beside them.
//!
//! A GEMM that overlaps a communication kernel shares the GPU with it. cuBLAS sizes its grids for
//! every SM, so the blocks that find their SM taken by the other kernel run as an extra wave.
//! `cublasSetSmCountTarget` makes cuBLAS pick grids for fewer SMs. This is what DeepGEMM's
//! `set_num_sms` does for its own kernels.

use std::sync::Arc;

use cudarc::cublas::{sys, CudaBlas};
use cudarc::driver::CudaContext;

use crate::cuda::Kernels;
use crate::error::Result;

/// Runs `f` with cuBLAS on `blas` targeting `sms` SMs (0: all, cuBLAS's default), and restores
/// the default afterwards, also when `f` fails or panics. The setting belongs to the handle:
/// every cuBLAS call made through `blas` while `f` runs uses it.
pub fn with_sm_count_target<R>(blas: &CudaBlas, sms: u32, f: impl FnOnce() -> R) -> Result<R> {
    let target = i32::try_from(sms).unwrap_or(i32::MAX);
    set_target(blas, target)?;
    let guard = Restore(blas);
    let out = f();
    drop(guard);
    set_target(blas, 0)?;
    Ok(out)
}

/// The SMs of `ctx`'s device that a kernel holding `busy` of them leaves (the target for a GEMM
/// beside it), from the context's cached [`DeviceProps`](crate::cuda::DeviceProps).
pub fn sms_left(ctx: &Arc<CudaContext>, busy: usize) -> Result<u32> {
    let all = Kernels::get(ctx)?.props().sm_count;
    Ok(all.saturating_sub(u32::try_from(busy).unwrap_or(u32::MAX)))
}

/// Sets the handle's SM count target.
fn set_target(blas: &CudaBlas, sms: i32) -> Result<()> {
    // SAFETY: `blas.handle()` is a live cuBLAS handle owned by `blas`; the call only stores an
    // integer in it.
    unsafe { sys::cublasSetSmCountTarget(*blas.handle(), sms) }.result()?;
    Ok(())
}

/// Puts the handle back to all SMs if `f` unwinds.
struct Restore<'a>(&'a CudaBlas);

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = set_target(self.0, 0);
        }
    }
}
