//! Launcher of `scores_softmax.cu`. Host twin: [`crate::attention::scores_softmax`].

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::attention::ScoresShape;
use crate::cuda::{grid_for, KernelParams, Kernels};
use crate::error::Result;

/// The cubin of `scores_softmax.cu`.
const FILE: &str = "attention/scores_softmax";
const THREADS: u32 = 256;
const BLOCKS_PER_SM: u32 = 8;

/// Mirror of `struct ScoresSoftmaxParams` in `scores_softmax.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ScoresSoftmaxParams {
    latent: CUdeviceptr,
    rope: CUdeviceptr,
    mask: CUdeviceptr,
    probs: CUdeviceptr,
    seqs: i64,
    heads: i64,
    queries: i64,
    len: i64,
    scale: f32,
    vec: i32,
}
const _: () = assert!(std::mem::size_of::<ScoresSoftmaxParams>() == 72);

// SAFETY: `repr(C)` plain data mirroring `ScoresSoftmaxParams` in scores_softmax.cu (size
// asserted both sides).
unsafe impl KernelParams for ScoresSoftmaxParams {}

/// `probs = softmax((latent + rope) * scale + mask)` over the last dimension on `stream`
/// (`latent`, `rope` and `probs` `[seqs, queries * heads, len]`, `mask` `[seqs, queries, len]`
/// shared by a query's heads, all bf16), in f32 with one rounding; 8 values a load when `len`
/// is a multiple of 8 and the tensors are 16-byte aligned. Checked before launch: the sizes
/// and a finite `scale`.
pub fn scores_softmax_bf16_cuda(
    stream: &Arc<CudaStream>,
    latent: &impl DevicePtr<bf16>,
    rope: &impl DevicePtr<bf16>,
    mask: &impl DevicePtr<bf16>,
    scale: f32,
    shape: ScoresShape,
    probs: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    shape.check([latent.len(), rope.len()], mask.len(), probs.len(), scale)?;
    let rows = shape.rows();
    if rows == 0 {
        return Ok(());
    }
    let kernels = Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(FILE, "mla_scores_softmax_bf16")?;
    stream.context().bind_to_thread()?;
    let (l_ptr, _gl) = latent.device_ptr(stream);
    let (r_ptr, _gr) = rope.device_ptr(stream);
    let (m_ptr, _gm) = mask.device_ptr(stream);
    let (p_ptr, _gp) = probs.device_ptr_mut(stream);
    let warps = u64::from(THREADS / 32);
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(rows as u64, warps, kernels.props(), BLOCKS_PER_SM),
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let params = ScoresSoftmaxParams {
        latent: l_ptr,
        rope: r_ptr,
        mask: m_ptr,
        probs: p_ptr,
        seqs: shape.seqs as i64,
        heads: shape.heads as i64,
        queries: shape.queries as i64,
        len: shape.len as i64,
        scale,
        vec: i32::from(
            shape.len % 8 == 0 && [l_ptr, r_ptr, m_ptr, p_ptr].iter().all(|p| p % 16 == 0),
        ),
    };
    // SAFETY: `params` matches `ScoresSoftmaxParams`; `latent`, `rope` and `probs` hold
    // `seqs * heads * queries * len` and `mask` `seqs * queries * len` bf16 (checked by
    // `shape.check`), and their guards live until the launch is queued; the kernel reads and
    // writes exactly those elements (2-byte accesses, any alignment of a bf16 slice).
    unsafe { kernel.launch(stream, cfg, params) }
}
