//! Launcher of `swiglu_rows.cu`: SwiGLU over dense rows of a blocked gate_up product. Host
//! twin: [`crate::gemm::host::swiglu_rows`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::cuda::{check_align, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::gemm::GATE_UP_BLOCK;

/// The cubin of `swiglu_rows.cu`.
const FILE: &str = "gemm/swiglu_rows";
const THREADS: u32 = 256;
const BLOCKS_PER_SM: u32 = 4;

/// Mirror of `struct SwigluRowsParams` in `swiglu_rows.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SwigluRowsParams {
    h: CUdeviceptr,
    act: CUdeviceptr,
    rows: i64,
    inter: i64,
}
const _: () = assert!(std::mem::size_of::<SwigluRowsParams>() == 32);

// SAFETY: `repr(C)` plain data mirroring `SwigluRowsParams` in swiglu_rows.cu (size asserted
// both sides).
unsafe impl KernelParams for SwigluRowsParams {}

/// SwiGLU on `stream` over `rows` dense rows of `h` (`[rows, 2 * inter]`, the product of rows
/// with a gate_up weight in the blocked layout, [`GATE_UP_BLOCK`]) into `act`
/// (`[rows, inter]`): `act[r, j] = bf16(silu(gate) * up)` with the gate and up columns of `j`
/// (`crate::gemm::gate_up_rows`). Checked before launch: `inter` a positive multiple of 8, the
/// lengths, 16-byte aligned operands.
pub fn swiglu_rows_bf16_cuda(
    stream: &Arc<CudaStream>,
    h: &impl DevicePtr<bf16>,
    rows: usize,
    inter: usize,
    act: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    if inter == 0 || inter % GATE_UP_BLOCK != 0 || inter > i32::MAX as usize {
        return Err(Error::invalid(
            "inter",
            inter,
            format!("must be a positive multiple of {GATE_UP_BLOCK} below 2^31"),
        ));
    }
    Error::check_len("h", rows * 2 * inter, h.len())?;
    Error::check_len("act", rows * inter, act.len())?;
    if rows == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "swiglu_rows_bf16")?;
    stream.context().bind_to_thread()?;
    let (h_ptr, _gh) = h.device_ptr(stream);
    let (act_ptr, _ga) = act.device_ptr_mut(stream);
    check_align("h", h_ptr, 16)?;
    check_align("act", act_ptr, 16)?;
    let items = (rows * (inter / GATE_UP_BLOCK)) as u64;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(items, THREADS as u64, kernels.props(), BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = SwigluRowsParams {
        h: h_ptr,
        act: act_ptr,
        rows: rows as i64,
        inter: inter as i64,
    };
    // SAFETY: `params` matches `SwigluRowsParams`; `h` holds `rows * 2 * inter` and `act`
    // `rows * inter` bf16 (checked above), both 16-byte aligned with rows of a multiple of 16
    // bytes, and their guards live until the launch is queued; the kernel touches exactly those
    // elements.
    unsafe { kernel.launch(stream, cfg, params) }
}
