//! Typed launcher of the gate kernel (`gate.cu`; host twin [`crate::routing::gate_logits`]).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::Result;
use crate::routing::gate::gate_tile;
use crate::routing::{GateInput, GateShape};

/// The cubin of `gate.cu`.
const GATE_FILE: &str = "routing/gate";
/// Threads per block of the gate kernel (`kThreads`).
const GATE_THREADS: u32 = 256;
/// Resident blocks per SM the gate grid is capped at (it strides over the remaining tiles).
const GATE_BLOCKS_PER_SM: u32 = 4;

/// Mirror of `struct GateLogitsParams` in `gate.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GateLogitsParams {
    x: CUdeviceptr,
    weight: CUdeviceptr,
    logits: CUdeviceptr,
    num_tokens: i64,
    num_experts: i32,
    hidden: i32,
}
const _: () = assert!(std::mem::size_of::<GateLogitsParams>() == 40);
const _: () = assert!(std::mem::offset_of!(GateLogitsParams, num_tokens) == 24);
const _: () = assert!(std::mem::offset_of!(GateLogitsParams, hidden) == 36);

// SAFETY: `repr(C)` plain data mirroring `GateLogitsParams` in gate.cu (size asserted both
// sides, field offsets here).
unsafe impl KernelParams for GateLogitsParams {}

/// Computes the gate's logits `[T, E]` f32 = `x` (`[T, H]`, bf16 / f16 / f32) times
/// `weight^T` (`weight` `[E, H]` f32) on `stream`, accumulating in f32. Within the tolerance
/// stated in the GPU tests of the host twin [`crate::routing::gate_logits`] (which sums in
/// f64); the same on every run. Any `T` and `H` work; the fast path needs `H % 4 == 0` and `x`,
/// `weight` aligned to 4 elements, otherwise scalar loads are used. Nothing is read back to the
/// host.
pub fn gate_logits_cuda<T: GateInput + DeviceRepr>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<f32>,
    shape: GateShape,
    logits: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let t = shape.check(true, x.len(), weight.len(), logits.len())?;
    if t == 0 {
        return Ok(());
    }
    let (e, h) = (shape.num_experts, shape.hidden);
    let kernels = Kernels::for_stream(stream)?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (w_ptr, _gw) = weight.device_ptr(stream);
    let (l_ptr, _gl) = logits.device_ptr_mut(stream);
    let elem = std::mem::size_of::<T>() as u64;
    let vector = h % 4 == 0 && x_ptr % (4 * elem) == 0 && w_ptr % 16 == 0;
    let sms = kernels.props().sm_count as usize;
    let (tc, eb) = match gate_tile(t, e, sms) {
        (1, _) if !vector => (1, 1),
        _ if !vector => (8, 1),
        tile => tile,
    };
    let name = format!(
        "gate_logits_{}_v{}_t{tc}e{eb}",
        T::NAME,
        if vector { 4 } else { 1 }
    );
    let kernel = kernels.kernel(GATE_FILE, &name)?;
    let tiles = (t.div_ceil(tc) * e.div_ceil(eb)) as u64;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(tiles, 1, kernels.props(), GATE_BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (GATE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = GateLogitsParams {
        x: x_ptr,
        weight: w_ptr,
        logits: l_ptr,
        num_tokens: t as i64,
        // Fit: `e <= MAX_EXPERTS` and `h <= i32::MAX` (checked by `shape.check`).
        num_experts: e as i32,
        hidden: h as i32,
    };
    // SAFETY: `params` matches `GateLogitsParams` and `name` picks the instance for `T`'s
    // element type; `x` holds `t * h` elements of `T`, `weight` `e * h` f32 and `logits`
    // `t * e` f32 (checked above), and the kernel reads and writes only inside those; the
    // 4-wide instances are chosen only when `h % 4 == 0` and both inputs are aligned to their
    // vector loads. The guards keep stream order until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
