//! Launcher of `rope.cu`. Host twin: [`crate::attention::rope_rows`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::attention::RopeShape;
use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::Result;

/// The cubin of `rope.cu`.
const FILE: &str = "attention/rope";
const THREADS: u32 = 256;
const BLOCKS_PER_SM: u32 = 8;

/// Mirror of `struct RopeParams` in `rope.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RopeParams {
    x: CUdeviceptr,
    cos: CUdeviceptr,
    sin: CUdeviceptr,
    out: CUdeviceptr,
    tokens: i64,
    heads: i64,
    x_width: i64,
    first: i64,
    dim: i64,
    interleave: i32,
    pad_: i32,
}
const _: () = assert!(std::mem::size_of::<RopeParams>() == 80);

// SAFETY: `repr(C)` plain data mirroring `RopeParams` in rope.cu (size asserted both sides).
unsafe impl KernelParams for RopeParams {}

/// The rope columns of `x` (`[tokens, heads, x_width]` bf16, `shape.dim` columns from
/// `shape.first` of each head's block) rotated by their token's rows of `cos` and `sin`
/// (`[tokens, dim / 2]` bf16) into `out` (`[tokens, heads, dim]`) on `stream`, in bf16
/// operations as candle's rope kernels (within one rounding of a product of the host twin).
/// Checked before launch: the shape and the lengths.
pub fn rope_bf16_cuda(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<bf16>,
    cos: &impl DevicePtr<bf16>,
    sin: &impl DevicePtr<bf16>,
    shape: RopeShape,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    shape.check(x.len(), cos.len(), sin.len(), out.len())?;
    let pairs = (shape.tokens * shape.heads * shape.dim / 2) as u64;
    if pairs == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "mla_rope_bf16")?;
    stream.context().bind_to_thread()?;
    let (x_ptr, _gx) = x.device_ptr(stream);
    let (c_ptr, _gc) = cos.device_ptr(stream);
    let (s_ptr, _gs) = sin.device_ptr(stream);
    let (o_ptr, _go) = out.device_ptr_mut(stream);
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(pairs, u64::from(THREADS), kernels.props(), BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = RopeParams {
        x: x_ptr,
        cos: c_ptr,
        sin: s_ptr,
        out: o_ptr,
        tokens: shape.tokens as i64,
        heads: shape.heads as i64,
        x_width: shape.x_width as i64,
        first: shape.first as i64,
        dim: shape.dim as i64,
        interleave: i32::from(shape.interleave),
        pad_: 0,
    };
    // SAFETY: `params` matches `RopeParams`; `shape.check` proved `x` holds `tokens * heads *
    // x_width` values with `first + dim <= x_width`, `cos` and `sin` `tokens * dim / 2` and
    // `out` `tokens * heads * dim`, so thread k (pair i of row t * heads + h) reads and writes
    // only inside them; the guards keep stream order until the launch is queued.
    unsafe { kernel.launch(stream, cfg, params) }
}
