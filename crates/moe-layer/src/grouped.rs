//! The experts' forward passes on CUDA as grouped GEMMs (`ep_kernels::gemm`), entirely on
//! candle's stream, with no host read of routing or counts:
//!
//! - routed rows (normal mode): expert-major permute (`ep_kernels::expert_order`) ->
//!   contiguous gate_up GEMM -> SwiGLU -> down GEMM -> weighted un-permute;
//! - blocks with device counts (low-latency mode): masked gate_up GEMM -> SwiGLU -> down GEMM.
//!
//! Intermediates are allocated uninitialised (every row the next step reads is written by the
//! previous one). The GEMM workspace is created on first use and reused; a lock keeps one
//! forward at a time per [`Experts`] (the setup tables of a GEMM must not be overwritten by
//! another forward before it has run: all launches are on candle's one stream).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use ep_kernels::expert_order;
use ep_kernels::gemm::{self, GemmTiles, GroupLayout, GroupedGemmShape, GroupedGemmWorkspace};
use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
use half::bf16;

use crate::error::{Error, Result};
use crate::experts::Experts;

/// Per-[`Experts`] state of the device path.
#[derive(Debug, Default)]
pub(crate) struct GroupedState {
    workspace: Mutex<Option<GroupedGemmWorkspace>>,
}

/// Whether `experts` run as device grouped GEMMs.
pub(crate) fn eligible(experts: &Experts) -> bool {
    experts.device().is_cuda()
        && experts.dtype() == DType::BF16
        && experts.hidden_size() % 8 == 0
        && experts.intermediate_size() % 8 == 0
        && experts.num_local() <= gemm::MAX_GROUPS
}

fn cuda(dev: &Device) -> Result<&CudaDevice> {
    match dev {
        Device::Cuda(d) => Ok(d),
        other => Err(Error::invalid(
            "x",
            format!("a tensor on {other:?}"),
            "the grouped GEMMs need CUDA tensors",
        )),
    }
}

/// The workspace, created on first use for the experts' number of groups.
fn workspace<'a>(
    state: &'a GroupedState,
    stream: &Arc<CudaStream>,
    groups: usize,
) -> Result<MutexGuard<'a, Option<GroupedGemmWorkspace>>> {
    let mut g = state
        .workspace
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if g.as_ref().is_none_or(|w| w.max_groups() < groups) {
        *g = Some(GroupedGemmWorkspace::new(stream, groups)?);
    }
    Ok(g)
}

/// gate_up GEMM -> SwiGLU -> down GEMM over the rows of `a` (`[rows, H]` bf16) that `layout`
/// and `counts` (`[L]` i32, device) make valid; returns `y` `[rows, H]` bf16 (other rows
/// unwritten).
fn mlp_rows(
    experts: &Experts,
    dev: &CudaDevice,
    a: &Tensor,
    counts: &Tensor,
    layout: GroupLayout,
    rows: usize,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let (l, h, i) = (
        experts.num_local(),
        experts.hidden_size(),
        experts.intermediate_size(),
    );
    let mut ws = workspace(experts.grouped_state(), &stream, l)?;
    let ws = ws.as_mut().expect("created by workspace()");
    let up = GroupedGemmShape {
        groups: l,
        rows,
        n: 2 * i,
        k: h,
        layout,
    };
    let down = GroupedGemmShape {
        groups: l,
        rows,
        n: h,
        k: i,
        layout,
    };
    let mut hbuf = alloc_uninit::<bf16>(&stream, rows * 2 * i)?;
    let mut act = alloc_uninit::<bf16>(&stream, rows * i)?;
    let mut y = alloc_uninit::<bf16>(&stream, rows * h)?;
    {
        let a_d = DeviceTensor::new("a", a)?;
        let c_d = DeviceTensor::new("counts", counts)?;
        let w1 = DeviceTensor::new("gate_up", experts.gate_up())?;
        let w2 = DeviceTensor::new("down", experts.down())?;
        let c_v = c_d.view::<i32>()?;
        let mut h_v = hbuf.slice_mut(0..rows * 2 * i);
        let mut act_v = act.slice_mut(0..rows * i);
        let mut y_v = y.slice_mut(0..rows * h);
        gemm::grouped_gemm_bf16_cuda(
            &stream,
            &a_d.view::<bf16>()?,
            &w1.view::<bf16>()?,
            &c_v,
            &up,
            GemmTiles::Auto,
            &mut h_v,
            ws,
        )?;
        gemm::swiglu_cuda(&stream, &h_v, &c_v, layout, rows, i, &mut act_v)?;
        gemm::grouped_gemm_bf16_cuda(
            &stream,
            &act_v,
            &w2.view::<bf16>()?,
            &c_v,
            &down,
            GemmTiles::Auto,
            &mut y_v,
            ws,
        )?;
    }
    Ok(wrap(y, (rows, h), dev))
}

/// Normal-mode path of [`Experts::forward_grouped`]: returns `[N, H]` bf16.
pub(crate) fn forward_routed(
    experts: &Experts,
    x: &Tensor,
    topk_idx: &Tensor,
    topk_weights: &Tensor,
) -> Result<Tensor> {
    let dev = cuda(x.device())?;
    let stream = dev.cuda_stream();
    let (n, h) = x.dims2()?;
    let k = topk_idx.dims2()?.1;
    let l = experts.num_local();
    let x = x.to_dtype(DType::BF16)?.contiguous()?;
    let idx = topk_idx.to_dtype(DType::I64)?.contiguous()?;
    let w = topk_weights.to_dtype(DType::F32)?.contiguous()?;
    let rows = expert_order::rows_bound(n, k, l, 1);
    let mut a = alloc_uninit::<bf16>(&stream, rows * h)?;
    let mut counts = alloc_uninit::<i32>(&stream, l)?;
    let mut fill = alloc_uninit::<i32>(&stream, l)?;
    let mut positions = alloc_uninit::<i32>(&stream, n * k)?;
    {
        let x_d = DeviceTensor::new("x", &x)?;
        let i_d = DeviceTensor::new("topk_idx_local", &idx)?;
        expert_order::permute_cuda(
            &stream,
            &x_d.view::<bf16>()?,
            &i_d.view::<i64>()?,
            k,
            l,
            1,
            h,
            &mut a.slice_mut(0..rows * h),
            &mut counts.slice_mut(0..l),
            &mut fill.slice_mut(0..l),
            &mut positions.slice_mut(0..n * k),
        )?;
    }
    let a = wrap(a, (rows, h), dev);
    let counts = wrap(counts, l, dev);
    let y = mlp_rows(
        experts,
        dev,
        &a,
        &counts,
        GroupLayout::Contiguous { alignment: 1 },
        rows,
    )?;
    let mut out = alloc_uninit::<bf16>(&stream, n * h)?;
    {
        let y_d = DeviceTensor::new("y", &y)?;
        let w_d = DeviceTensor::new("topk_weights", &w)?;
        expert_order::unpermute_cuda(
            &stream,
            &y_d.view::<bf16>()?,
            &positions.slice(0..n * k),
            &w_d.view::<f32>()?,
            k,
            h,
            &mut out.slice_mut(0..n * h),
        )?;
    }
    Ok(wrap(out, (n, h), dev))
}

/// Low-latency path of [`Experts::forward_masked`]: `x` `[L, M, H]`, `counts` `[L]` i32
/// (device); returns `[L, M, H]` bf16 with the rows past the counts unwritten.
pub(crate) fn forward_masked(experts: &Experts, x: &Tensor, counts: &Tensor) -> Result<Tensor> {
    let dev = cuda(x.device())?;
    let (l, m, h) = x.dims3()?;
    let x = x.to_dtype(DType::BF16)?.contiguous()?;
    let counts = counts.contiguous()?;
    let a = x.reshape((l * m, h))?;
    let y = mlp_rows(
        experts,
        dev,
        &a,
        &counts,
        GroupLayout::Masked { m_max: m },
        l * m,
    )?;
    Ok(y.reshape((l, m, h))?)
}
