//! Typed launchers of the fp8 cast kernels (`fp8.cu`); host twins: [`crate::fp8::host`].

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use float8::F8E4M3;
use half::bf16;

use crate::cuda::{assert_params_layout, check_align, grid_for, KernelParams, Kernels};
use crate::error::{Error, Result};
use crate::fp8::host::ScaleFormat;
use crate::FP8_GROUP;

/// The cubin of `fp8.cu`.
const FILE: &str = "fp8/fp8";
/// Threads per block (`kThreads` in `fp8.cu`); one warp per 128-channel group.
const THREADS: u32 = 256;
/// Groups handled by one block per grid-stride step.
const GROUPS_PER_BLOCK: u64 = (THREADS / 32) as u64;
/// Resident blocks per SM the grid is capped at (grid-stride loops cover the rest).
const BLOCKS_PER_SM: u32 = 8;

/// Mirror of `struct QuantizeParams` in `fp8.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct QuantizeParams {
    x: CUdeviceptr,
    q: CUdeviceptr,
    scales: CUdeviceptr,
    num_groups: i64,
    scale_format: u32,
    reserved: u32,
}
assert_params_layout!(
    QuantizeParams,
    40;
    x = 0, q = 8, scales = 16, num_groups = 24, scale_format = 32, reserved = 36,
);

// SAFETY: `repr(C)` plain data mirroring `QuantizeParams` in fp8.cu (size asserted both sides).
unsafe impl KernelParams for QuantizeParams {}

/// Mirror of `struct DequantizeParams` in `fp8.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DequantizeParams {
    q: CUdeviceptr,
    scales: CUdeviceptr,
    out: CUdeviceptr,
    num_groups: i64,
}
assert_params_layout!(
    DequantizeParams,
    32;
    q = 0, scales = 8, out = 16, num_groups = 24,
);

// SAFETY: `repr(C)` plain data mirroring `DequantizeParams` in fp8.cu (size asserted both sides).
unsafe impl KernelParams for DequantizeParams {}

/// Checks `hidden` and returns the number of 128-channel groups of `[num_tokens, hidden]`.
fn num_groups(num_tokens: usize, hidden: usize) -> Result<usize> {
    if hidden == 0 || hidden % FP8_GROUP != 0 {
        return Err(Error::invalid(
            "hidden",
            hidden,
            format!("fp8 needs a positive multiple of {FP8_GROUP}"),
        ));
    }
    num_tokens
        .checked_mul(hidden)
        .map(|n| n / FP8_GROUP)
        .ok_or_else(|| Error::invalid("num_tokens", num_tokens, "num_tokens * hidden overflows"))
}

fn launch_config(groups: usize, kernels: &Kernels) -> LaunchConfig {
    let blocks = grid_for(
        groups as u64,
        GROUPS_PER_BLOCK,
        kernels.props(),
        BLOCKS_PER_SM,
    );
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Quantises `x: [num_tokens, hidden]` bf16 into `q: [num_tokens, hidden]` fp8 e4m3 and
/// `scales: [num_tokens, hidden / 128]` f32 on `stream`, bit-identical to the host twin
/// [`crate::fp8::quantize`]. `x` must be 8-byte and `q` 4-byte aligned (true of whole cudarc
/// allocations and of views starting at a multiple of 128 elements).
pub fn quantize_cuda(
    stream: &CudaStream,
    x: &impl DevicePtr<bf16>,
    num_tokens: usize,
    hidden: usize,
    format: ScaleFormat,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let groups = num_groups(num_tokens, hidden)?;
    Error::check_len("x", num_tokens * hidden, x.len())?;
    Error::check_len("q", num_tokens * hidden, q.len())?;
    Error::check_len("scales", groups, scales.len())?;
    if groups == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "quantize_fp8_1x128")?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (q_ptr, _gq) = q.device_ptr_mut(stream);
    let (s_ptr, _gs) = scales.device_ptr_mut(stream);
    check_align("x", x_ptr, 8)?;
    check_align("q", q_ptr, 4)?;
    check_align("scales", s_ptr, 4)?;
    let params = QuantizeParams {
        x: x_ptr,
        q: q_ptr,
        scales: s_ptr,
        num_groups: groups as i64,
        scale_format: format as u32,
        reserved: 0,
    };
    // SAFETY: `params` matches `QuantizeParams`; x and q hold `groups * 128` elements and
    // scales `groups` (checked above), with the alignment the vector accesses need; the guards
    // keep cudarc's stream ordering until the launch is queued.
    unsafe { kernel.launch(stream, launch_config(groups, &kernels), params) }
}

/// Dequantises `q: [num_tokens, hidden]` fp8 e4m3 with `scales: [num_tokens, hidden / 128]`
/// into `out: [num_tokens, hidden]` bf16 on `stream`, bit-identical to the host twin
/// [`crate::fp8::dequantize`]. `q` must be 4-byte and `out` 8-byte aligned.
pub fn dequantize_cuda(
    stream: &CudaStream,
    q: &impl DevicePtr<F8E4M3>,
    scales: &impl DevicePtr<f32>,
    num_tokens: usize,
    hidden: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let groups = num_groups(num_tokens, hidden)?;
    Error::check_len("q", num_tokens * hidden, q.len())?;
    Error::check_len("scales", groups, scales.len())?;
    Error::check_len("out", num_tokens * hidden, out.len())?;
    if groups == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "dequantize_fp8_1x128")?;
    let (q_ptr, _gq) = q.device_ptr(stream);
    let (s_ptr, _gs) = scales.device_ptr(stream);
    let (o_ptr, _go) = out.device_ptr_mut(stream);
    check_align("q", q_ptr, 4)?;
    check_align("scales", s_ptr, 4)?;
    check_align("out", o_ptr, 8)?;
    let params = DequantizeParams {
        q: q_ptr,
        scales: s_ptr,
        out: o_ptr,
        num_groups: groups as i64,
    };
    // SAFETY: `params` matches `DequantizeParams`; q and out hold `groups * 128` elements and
    // scales `groups` (checked above), aligned for the vector accesses; the guards keep
    // cudarc's stream ordering until the launch is queued.
    unsafe { kernel.launch(stream, launch_config(groups, &kernels), params) }
}
