//! Launchers of the buffer's reset and delay kernels (`control.cu`).

use std::time::Duration;

use cudarc::driver::{CudaStream, LaunchConfig};

use super::{LlBuffer, LowLatencyBuffer, THREADS};
use crate::cuda::{assert_params_layout, KernelParams, Kernels};
use crate::error::Result;

/// The cubin of the buffer's reset and delay kernels (`control.cu`).
const CONTROL_FILE: &str = "low_latency/control";

/// Mirror of `struct CleanParams` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CleanParams {
    buf: LlBuffer,
    reset_active: u32,
    reserved: u32,
}
assert_params_layout!(
    CleanParams,
    152;
    buf = 0, reset_active = 144, reserved = 148,
);
// SAFETY: `repr(C)` plain data mirroring `CleanParams` (size asserted on both sides).
unsafe impl KernelParams for CleanParams {}

/// Mirror of `struct SpinParams` in `protocol.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SpinParams {
    ns: u64,
}
assert_params_layout!(
    SpinParams,
    8;
    ns = 0,
);
// SAFETY: `repr(C)` plain data mirroring `SpinParams` (size asserted on both sides).
unsafe impl KernelParams for SpinParams {}

/// Resets the buffer's op sequencing, send counters, and the signals and flags of both sets
/// (after other kernels used the memory, or after a timeout); with `reset_active`, also marks
/// every rank active. Run it on every rank, with a barrier before (no op in flight anywhere)
/// and after (before the next op).
pub fn clean_buffer_cuda(
    stream: &CudaStream,
    buffer: &LowLatencyBuffer,
    reset_active: bool,
) -> Result<()> {
    let buf = buffer.desc(stream)?;
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(CONTROL_FILE, "ll_clean")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = CleanParams {
        buf,
        reset_active: u32::from(reset_active),
        reserved: 0,
    };
    // SAFETY: `params` matches `CleanParams`; the kernel writes only inside the buffer's own
    // allocation, at offsets of its layout.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// Keeps `stream` busy for `duration` with a one-thread kernel (benchmarks and tests use it
/// to stand for work done between a send and a receive phase).
pub fn delay_cuda(stream: &CudaStream, duration: Duration) -> Result<()> {
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(CONTROL_FILE, "ll_spin")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = SpinParams {
        ns: u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX),
    };
    // SAFETY: `params` matches `SpinParams`; the kernel touches no memory.
    unsafe { kernel.launch(stream, cfg, params) }
}
