//! The CUDA path of the dense fp8 layers: the experts' fp8 grouped GEMM (one group, or one per
//! batch of [`super::Fp8BatchedLinear`]), and their SwiGLU + row cast, on candle's stream (no
//! host read, capturable in a CUDA graph).

use std::sync::{Mutex, PoisonError};

use candle_core::cuda_backend::CudaDevice;
use candle_core::Tensor;
use ep_kernels::gemm::fp8::{self as gemm_fp8, DeviceFp8};
use ep_kernels::gemm::{GemmGrid, GemmTiles, GroupedGemmShape, GroupedGemmWorkspace};
use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
use float8::F8E4M3;
use half::bf16;

use crate::error::Result;

/// A layer's GEMM workspace, created at its first call; the lock keeps one call at a time
/// (the setup tables of a GEMM are written on the device before it runs).
#[derive(Debug, Default)]
pub(super) struct Workspace(Mutex<Option<GroupedGemmWorkspace>>);

/// `[rows, n]` bf16 = rows `q` (`[rows, k]` e4m3, scales `s`) times the weights `w_q`
/// (`[groups, n, k]` e4m3, scales `w_s`): `shape.groups` groups of `rows / groups` rows each.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    dev: &CudaDevice,
    workspace: &Workspace,
    w_q: &Tensor,
    w_s: &Tensor,
    q: &Tensor,
    s: &Tensor,
    shape: &GroupedGemmShape,
    tiles: GemmTiles,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let (rows, n, groups) = (shape.rows, shape.n, shape.groups);
    let mut counts = alloc_uninit::<i32>(&stream, groups)?;
    // The row counts as a memset node: a captured step replays it with its own rows.
    ep_kernels::cuda::fill_i32_cuda(&stream, &mut counts, (rows / groups) as i32)?;
    let mut ws = workspace.0.lock().unwrap_or_else(PoisonError::into_inner);
    if ws.is_none() {
        *ws = Some(GroupedGemmWorkspace::new(&stream, groups)?);
    }
    let ws = ws.as_mut().expect("created above");
    ws.set_grid(GemmGrid::Persistent)?;
    let mut d = alloc_uninit::<bf16>(&stream, rows * n)?;
    {
        let (q, s) = (q.contiguous()?, s.contiguous()?);
        let q_d = DeviceTensor::new("x", &q)?;
        let s_d = DeviceTensor::new("x scales", &s)?;
        let w_d = DeviceTensor::new("weight", w_q)?;
        let ws_d = DeviceTensor::new("weight_scale_inv", w_s)?;
        let (q_v, s_v, w_v, wsc_v) = (
            q_d.view::<F8E4M3>()?,
            s_d.view::<f32>()?,
            w_d.view::<F8E4M3>()?,
            ws_d.view::<f32>()?,
        );
        gemm_fp8::grouped_gemm_fp8_cuda(
            &stream,
            &DeviceFp8 {
                q: &q_v,
                scales: &s_v,
            },
            &DeviceFp8 {
                q: &w_v,
                scales: &wsc_v,
            },
            &counts,
            shape,
            None,
            tiles,
            &mut d.slice_mut(0..rows * n),
            ws,
        )?;
    }
    Ok(wrap(d, (rows, n), dev))
}

/// SwiGLU of `gu` (`[rows, 2I]` bf16) and its 1 x 128 cast in one pass.
pub(super) fn swiglu_quantize(dev: &CudaDevice, gu: &Tensor, i: usize) -> Result<(Tensor, Tensor)> {
    let stream = dev.cuda_stream();
    let rows = gu.dims2()?.0;
    let sg = i / gemm_fp8::FP8_BLOCK;
    let mut q = alloc_uninit::<F8E4M3>(&stream, rows * i)?;
    let mut s = alloc_uninit::<f32>(&stream, rows * sg)?;
    {
        let gu = gu.contiguous()?;
        let gu_d = DeviceTensor::new("gate_up", &gu)?;
        gemm_fp8::swiglu_quantize_fp8_cuda(
            &stream,
            &gu_d.view::<bf16>()?,
            rows,
            i,
            i,
            None,
            &mut q.slice_mut(0..rows * i),
            &mut s.slice_mut(0..rows * sg),
        )?;
    }
    Ok((wrap(q, (rows, i), dev), wrap(s, (rows, sg), dev)))
}
