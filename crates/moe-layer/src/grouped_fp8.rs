//! Fp8 experts' forward passes on CUDA: block-scaled fp8 grouped GEMMs
//! (`ep_kernels::gemm::fp8`) over e4m3 rows with 1 x 128 scales, on candle's stream, with no
//! host read of routing or counts.
//!
//! - routed rows (normal mode): the e4m3 rows (an fp8 dispatch's, or the bf16 rows quantized
//!   once on the device) to expert-major order with their scales
//!   (`ep_kernels::expert_order::{permute_cuda, scatter_cuda}`) -> contiguous gate_up GEMM ->
//!   SwiGLU and its 1 x 128 quantization in one pass -> down GEMM -> weighted un-permute;
//! - blocks with device counts (low-latency mode): the same over the masked layout (the SwiGLU
//!   pass skips the rows past the counts).
//!
//! The gate_up weights are each expert's gate_proj rows, then its up_proj rows.

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use ep_kernels::expert_order;
use ep_kernels::gemm::fp8::{self as gemm_fp8, DeviceFp8};
use ep_kernels::gemm::{GemmGrid, GemmTiles, GroupLayout, GroupedGemmShape};
use ep_runtime::cast::per_token_cast_to_fp8;
use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
use float8::F8E4M3;
use half::bf16;

use crate::error::{Error, Result};
use crate::experts::{ExpertInput, Experts};

fn cuda(dev: &Device) -> Result<&CudaDevice> {
    match dev {
        Device::Cuda(d) => Ok(d),
        other => Err(Error::invalid(
            "x",
            format!("a tensor on {other:?}"),
            "the fp8 grouped GEMMs need CUDA tensors",
        )),
    }
}

/// The e4m3 rows and their scales of `input` (`[.., H]`): as delivered, or quantized 1 x 128 on
/// the device (once).
fn fp8_rows(input: &ExpertInput) -> Result<(Tensor, Tensor)> {
    match &input.scales {
        Some(s) => {
            if input.x.dtype() != DType::F8E4M3 || s.dtype() != DType::F32 {
                return Err(Error::invalid(
                    "x",
                    format!("{:?} rows with {:?} scales", input.x.dtype(), s.dtype()),
                    "fp8 rows are F8E4M3 with F32 scales",
                ));
            }
            Ok((input.x.contiguous()?, s.contiguous()?))
        }
        None => {
            let h = *input.x.dims().last().unwrap_or(&0);
            let x = input.x.to_dtype(DType::BF16)?.reshape(((), h))?;
            let (q, s) = per_token_cast_to_fp8(&x, false)?;
            let mut dims = input.x.dims().to_vec();
            let q = q.reshape(dims.clone())?;
            if let Some(last) = dims.last_mut() {
                *last = h / ep_kernels::FP8_GROUP;
            }
            Ok((q, s.reshape(dims)?))
        }
    }
}

/// gate_up GEMM -> SwiGLU and its quantization -> down GEMM over the rows of `a` (`[rows, H]`
/// e4m3, scales `[rows, H / 128]`) that `layout` and `counts` (`[groups]` i32, device) make
/// valid; returns `y` `[rows, H]` bf16 (other rows unwritten).
#[allow(clippy::too_many_arguments)]
fn mlp_rows(
    experts: &Experts,
    dev: &CudaDevice,
    a: &Tensor,
    a_scales: &Tensor,
    counts: &Tensor,
    layout: GroupLayout,
    rows: usize,
    tiles: GemmTiles,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let scales = experts.fp8_scales().ok_or_else(|| {
        Error::invalid("experts", "bf16 experts", "the fp8 path needs fp8 experts")
    })?;
    let (l, h, i) = (
        experts.num_local(),
        experts.hidden_size(),
        experts.intermediate_size(),
    );
    let state = experts.grouped_state();
    let mut ws = crate::grouped::workspace(state, &stream, l)?;
    let ws = ws.as_mut().expect("created by workspace()");
    ws.set_grid(match layout {
        GroupLayout::Contiguous { .. } => state.routed_grid(),
        GroupLayout::Masked { .. } => GemmGrid::Persistent,
    })?;
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
    let mut hu = alloc_uninit::<bf16>(&stream, rows * 2 * i)?;
    {
        let a_d = DeviceTensor::new("a", a)?;
        let as_d = DeviceTensor::new("a scales", a_scales)?;
        let c_d = DeviceTensor::new("counts", counts)?;
        let w1 = DeviceTensor::new("gate_up", experts.gate_up())?;
        let s1 = DeviceTensor::new("gate_up scales", &scales.gate_up)?;
        let (a_v, as_v, w1_v, s1_v) = (
            a_d.view::<F8E4M3>()?,
            as_d.view::<f32>()?,
            w1.view::<F8E4M3>()?,
            s1.view::<f32>()?,
        );
        gemm_fp8::grouped_gemm_fp8_cuda(
            &stream,
            &DeviceFp8 {
                q: &a_v,
                scales: &as_v,
            },
            &DeviceFp8 {
                q: &w1_v,
                scales: &s1_v,
            },
            &c_d.view::<i32>()?,
            &up,
            None,
            tiles,
            &mut hu.slice_mut(0..rows * 2 * i),
            ws,
        )?;
    }
    // The down GEMM's rows: act = silu(gate) * up quantized 1 x 128, in one pass (rows past
    // the counts of a masked layout are skipped; in a contiguous one they are never read).
    let groups = i / ep_kernels::FP8_GROUP;
    let mut act_q = alloc_uninit::<F8E4M3>(&stream, rows * i)?;
    let mut act_s = alloc_uninit::<f32>(&stream, rows * groups)?;
    {
        let c_d = DeviceTensor::new("counts", counts)?;
        let c_v = c_d.view::<i32>()?;
        let mask = match layout {
            GroupLayout::Masked { m_max } => Some((
                &c_v as &dyn candle_core::cuda_backend::cudarc::driver::DevicePtr<i32>,
                m_max,
            )),
            GroupLayout::Contiguous { .. } => None,
        };
        gemm_fp8::swiglu_quantize_fp8_cuda(
            &stream,
            &hu.slice(0..rows * 2 * i),
            rows,
            i,
            mask,
            &mut act_q.slice_mut(0..rows * i),
            &mut act_s.slice_mut(0..rows * groups),
        )?;
    }
    drop(hu);
    let mut y = alloc_uninit::<bf16>(&stream, rows * h)?;
    {
        let c_d = DeviceTensor::new("counts", counts)?;
        let w2 = DeviceTensor::new("down", experts.down())?;
        let s2 = DeviceTensor::new("down scales", &scales.down)?;
        let (q_v, s_v, w2_v, s2_v) = (
            act_q.slice(0..rows * i),
            act_s.slice(0..rows * groups),
            w2.view::<F8E4M3>()?,
            s2.view::<f32>()?,
        );
        gemm_fp8::grouped_gemm_fp8_cuda(
            &stream,
            &DeviceFp8 {
                q: &q_v,
                scales: &s_v,
            },
            &DeviceFp8 {
                q: &w2_v,
                scales: &s2_v,
            },
            &c_d.view::<i32>()?,
            &down,
            None,
            tiles,
            &mut y.slice_mut(0..rows * h),
            ws,
        )?;
    }
    Ok(wrap(y, (rows, h), dev))
}

/// Normal-mode path of the fp8 experts: `input` `[N, H]` (e4m3 with scales, or float rows),
/// `topk_idx` `[N, K]` local ids or -1, `topk_weights` `[N, K]`; returns `[N, H]` bf16. `rows`:
/// the routing's (token, local expert) pairs when the caller knows them.
pub(crate) fn forward_routed(
    experts: &Experts,
    input: &ExpertInput,
    topk_idx: &Tensor,
    topk_weights: &Tensor,
    rows: Option<usize>,
) -> Result<Tensor> {
    let dev = cuda(input.x.device())?;
    let stream = dev.cuda_stream();
    let (n, h) = input.x.dims2()?;
    let k = topk_idx.dims2()?.1;
    let l = experts.num_local();
    let (xq, xs) = fp8_rows(input)?;
    let idx = topk_idx.to_dtype(DType::I64)?.contiguous()?;
    let w = topk_weights.to_dtype(DType::F32)?.contiguous()?;
    let bound = expert_order::rows_bound(n, k, l, 1);
    let rows = rows.map_or(bound, |r| r.clamp(1, bound));
    let groups = h / ep_kernels::FP8_GROUP;
    let mut a = alloc_uninit::<F8E4M3>(&stream, rows * h)?;
    let mut a_s = alloc_uninit::<f32>(&stream, rows * groups)?;
    let mut counts = alloc_uninit::<i32>(&stream, l)?;
    let mut fill = alloc_uninit::<i32>(&stream, l)?;
    let mut positions = alloc_uninit::<i32>(&stream, n * k)?;
    {
        let x_d = DeviceTensor::new("x", &xq)?;
        let s_d = DeviceTensor::new("x scales", &xs)?;
        let i_d = DeviceTensor::new("topk_idx_local", &idx)?;
        expert_order::permute_cuda(
            &stream,
            &x_d.view::<F8E4M3>()?,
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
        expert_order::scatter_cuda(
            &stream,
            &s_d.view::<f32>()?,
            &positions.slice(0..n * k),
            k,
            groups,
            &mut a_s.slice_mut(0..rows * groups),
        )?;
    }
    let a = wrap(a, (rows, h), dev);
    let a_s = wrap(a_s, (rows, groups), dev);
    let counts = wrap(counts, l, dev);
    let y = mlp_rows(
        experts,
        dev,
        &a,
        &a_s,
        &counts,
        GroupLayout::Contiguous { alignment: 1 },
        rows,
        GemmTiles::Auto,
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

/// Low-latency path of the fp8 experts: `input` `[L, M, H]` (e4m3 with `[L, M, H / 128]`
/// scales, or float rows), `counts` `[L]` i32 (device); returns `[L, M, H]` bf16 with the rows
/// past the counts unwritten.
pub(crate) fn forward_masked(
    experts: &Experts,
    input: &ExpertInput,
    counts: &Tensor,
    tiles: GemmTiles,
) -> Result<Tensor> {
    let dev = cuda(input.x.device())?;
    let (l, m, h) = input.x.dims3()?;
    let (xq, xs) = fp8_rows(input)?;
    let tiles = match tiles {
        // The fp8 GEMMs have no tile-less kernel: the 64 x 128 tiles.
        GemmTiles::Gemv => GemmTiles::Narrow,
        t => t,
    };
    let y = mlp_rows(
        experts,
        dev,
        &xq.reshape((l * m, h))?,
        &xs.reshape((l * m, h / ep_kernels::FP8_GROUP))?,
        &counts.contiguous()?,
        GroupLayout::Masked { m_max: m },
        l * m,
        tiles,
    )?;
    Ok(y.reshape((l, m, h))?)
}
