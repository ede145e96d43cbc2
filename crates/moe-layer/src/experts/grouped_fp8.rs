//! Fp8 experts' forward passes on CUDA: block-scaled fp8 grouped GEMMs
//! (`ep_kernels::gemm::fp8`) over e4m3 rows with 1 x 128 scales, on candle's stream, with no
//! host read of routing or counts.
//!
//! - routed rows (normal mode): the e4m3 rows (an fp8 dispatch's, or the bf16 rows quantized
//!   once on the device) to expert-major order with their scales
//!   (`ep_kernels::expert_order::{permute_cuda, scatter_cuda}`) -> contiguous gate_up GEMM
//!   with SwiGLU and its 1 x 128 quantization in the epilogue (below 512 rows per expert on
//!   average; `gemm_fp8::swiglu_in_epilogue`), else the GEMM and SwiGLU with its quantization
//!   in one pass -> down GEMM -> weighted un-permute;
//! - blocks with device counts (low-latency mode), and the shared experts' own GEMMs: gate_up
//!   GEMM over the masked layout -> SwiGLU and its quantization in one pass (skipping the rows
//!   past the counts) -> down GEMM; blocks of a few rows (the tile-less GEMV,
//!   `GemmTiles::Gemv`) run SwiGLU and the quantization inside the gate_up GEMV
//!   (`gemm_fp8::grouped_gemv_swiglu_fp8_cuda`), with no pass between the GEMVs.
//!
//! The gate_up weights are in [`crate::GateUpLayout::ScaleBlocks`]: 128 gate_proj rows and the
//! same 128 up_proj rows in turn.

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use ep_kernels::expert_order;
use ep_kernels::gemm::fp8::{self as gemm_fp8, DeviceFp8, ExtraGroupsFp8};
use ep_kernels::gemm::{GemmGrid, GemmTiles, GroupLayout, GroupedGemmShape};
use ep_runtime::cast::per_token_cast_to_fp8;
use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
use float8::F8E4M3;
use half::bf16;

use super::grouped_state::workspace;
use super::input::ExpertInput;
use super::shard::Experts;
use super::shared_fp8::SharedFp8;
use crate::error::{Error, Result};

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
            let x = input
                .float_rows()?
                .to_dtype(DType::BF16)?
                .reshape(((), h))?;
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

/// The valid rows of bf16 blocks `x` (`[L, M, H]`, `counts` `[L]` i32 on the device) quantized
/// 1 x 128: `([L * M, H]` e4m3, `[L * M, H / 128]` f32), the rows past the counts unwritten.
fn masked_rows(
    dev: &CudaDevice,
    x: &Tensor,
    counts: &Tensor,
    (l, m, h): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let stream = dev.cuda_stream();
    let rows = l * m;
    let groups = h / ep_kernels::FP8_GROUP;
    let x = x.contiguous()?;
    let mut q = alloc_uninit::<F8E4M3>(&stream, rows * h)?;
    let mut s = alloc_uninit::<f32>(&stream, rows * groups)?;
    {
        let x_d = DeviceTensor::new("x", &x)?;
        let c_d = DeviceTensor::new("counts", counts)?;
        let c_v = c_d.view::<i32>()?;
        gemm_fp8::quantize_rows_fp8_cuda(
            &stream,
            &x_d.view::<bf16>()?,
            rows,
            h,
            Some((&c_v, m)),
            &mut q.slice_mut(0..rows * h),
            &mut s.slice_mut(0..rows * groups),
        )?;
    }
    Ok((wrap(q, (rows, h), dev), wrap(s, (rows, groups), dev)))
}

/// The groups of one fp8 MLP call: the routed experts' (groups `0..L`), and after them the
/// shared experts' blocks, which read the tokens `(rows [T, H] e4m3, scales)`.
struct Groups<'a> {
    routed: Option<&'a Experts>,
    shared: Option<(&'a SharedFp8, &'a Tensor, &'a Tensor)>,
}

/// An empty e4m3 / f32 operand: the GEMMs' own `a` or `b` when every group is an extra one.
fn empty_operand(dev: &CudaDevice) -> Result<(Tensor, Tensor)> {
    let stream = dev.cuda_stream();
    let q = wrap(alloc_uninit::<F8E4M3>(&stream, 16)?, 16, dev).narrow(0, 0, 0)?;
    let s = wrap(alloc_uninit::<f32>(&stream, 4)?, 4, dev).narrow(0, 0, 0)?;
    Ok((q, s))
}

/// gate_up GEMM -> SwiGLU and its quantization -> down GEMM over the rows of `a` (`[rows, H]`
/// e4m3, scales `[rows, H / 128]`; the routed groups' blocks) that `layout` and `counts`
/// (`[groups]` i32, device: routed then shared) make valid; returns `y` `[rows, H]` bf16 (other
/// rows unwritten). `experts` owns the GEMM workspace.
#[allow(clippy::too_many_arguments)]
fn mlp_rows(
    experts: &Experts,
    dev: &CudaDevice,
    groups: Groups<'_>,
    a: &Tensor,
    a_scales: &Tensor,
    counts: &Tensor,
    layout: GroupLayout,
    rows: usize,
    tiles: GemmTiles,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let (h, i) = (experts.hidden_size(), experts.intermediate_size());
    let l = groups.routed.map_or(0, Experts::num_local);
    let x = groups.shared.map_or(0, |(s, _, _)| s.blocks());
    let g = l + x;
    let empty = empty_operand(dev)?;
    let (w1, s1, w2, s2) = match groups.routed {
        Some(e) => {
            let sc = e.fp8_scales().ok_or_else(|| {
                Error::invalid("experts", "bf16 experts", "the fp8 path needs fp8 experts")
            })?;
            (e.gate_up(), &sc.gate_up, e.down(), &sc.down)
        }
        None => (&empty.0, &empty.1, &empty.0, &empty.1),
    };
    let state = experts.grouped_state();
    let mut ws = workspace(state, &stream, g)?;
    let ws = ws.as_mut().expect("created by workspace()");
    ws.set_grid(match layout {
        GroupLayout::Contiguous { .. } => state.routed_grid(),
        GroupLayout::Masked { .. } => GemmGrid::Persistent,
    })?;
    let up = GroupedGemmShape {
        groups: g,
        rows,
        n: 2 * i,
        k: h,
        layout,
    };
    let down = GroupedGemmShape {
        groups: g,
        rows,
        n: h,
        k: i,
        layout,
    };
    let sg = i / ep_kernels::FP8_GROUP;
    let mut act_q = alloc_uninit::<F8E4M3>(&stream, rows * i)?;
    let mut act_s = alloc_uninit::<f32>(&stream, rows * sg)?;
    // Every buffer of the step allocated (and freed, when dropped) outside the GEMMs, so that no
    // stream-ordered allocation sits between the gate_up GEMV and the down GEMV, which starts
    // as the gate_up's blocks leave (a dependent launch; `docs/design.md`).
    let mut y = alloc_uninit::<bf16>(&stream, rows * h)?;
    let (mut products, mut hu) = (None, None);
    if groups.shared.is_none() && gemm_fp8::swiglu_in_epilogue(layout, rows, g) {
        // SwiGLU and the act quantization in the gate_up GEMM's epilogue.
        let a_d = DeviceTensor::new("a", a)?;
        let as_d = DeviceTensor::new("a scales", a_scales)?;
        let c_d = DeviceTensor::new("counts", counts)?;
        let w1 = DeviceTensor::new("gate_up", w1)?;
        let s1 = DeviceTensor::new("gate_up scales", s1)?;
        gemm_fp8::grouped_gemm_swiglu_fp8_cuda(
            &stream,
            &DeviceFp8 {
                q: &a_d.view::<F8E4M3>()?,
                scales: &as_d.view::<f32>()?,
            },
            &DeviceFp8 {
                q: &w1.view::<F8E4M3>()?,
                scales: &s1.view::<f32>()?,
            },
            &c_d.view::<i32>()?,
            &up,
            &mut act_q.slice_mut(0..rows * i),
            &mut act_s.slice_mut(0..rows * sg),
            ws,
        )?;
    } else {
        let a_d = DeviceTensor::new("a", a)?;
        let as_d = DeviceTensor::new("a scales", a_scales)?;
        let c_d = DeviceTensor::new("counts", counts)?;
        let w1 = DeviceTensor::new("gate_up", w1)?;
        let s1 = DeviceTensor::new("gate_up scales", s1)?;
        let (a_v, as_v, c_v, w1_v, s1_v) = (
            a_d.view::<F8E4M3>()?,
            as_d.view::<f32>()?,
            c_d.view::<i32>()?,
            w1.view::<F8E4M3>()?,
            s1.view::<f32>()?,
        );
        let shared_d = match groups.shared {
            Some((sh, tq, ts)) => Some((
                DeviceTensor::new("shared gate_up", &sh.gate_up)?,
                DeviceTensor::new("shared gate_up scales", &sh.gate_up_scale)?,
                DeviceTensor::new("tokens", tq)?,
                DeviceTensor::new("token scales", ts)?,
            )),
            None => None,
        };
        let shared_v = match &shared_d {
            Some((w, ws_, t, ts)) => Some((
                w.view::<F8E4M3>()?,
                ws_.view::<f32>()?,
                t.view::<F8E4M3>()?,
                ts.view::<f32>()?,
            )),
            None => None,
        };
        let extra = shared_v.as_ref().map(|(w, sw, t, ts)| ExtraGroupsFp8 {
            first: l,
            b: DeviceFp8 { q: w, scales: sw },
            a: Some(DeviceFp8 { q: t, scales: ts }),
        });
        let a_fp8 = DeviceFp8 {
            q: &a_v,
            scales: &as_v,
        };
        let w1_fp8 = DeviceFp8 {
            q: &w1_v,
            scales: &s1_v,
        };
        if tiles.resolve(layout, rows, g) == GemmTiles::Gemv && gemm_fp8::gemv_swiglu_takes(2 * i) {
            // Blocks of a few rows: the tile-less GEMV with SwiGLU and the act quantization
            // fused (its f32 act values staged in `products`).
            let products = products.insert(alloc_uninit::<f32>(&stream, rows * i)?);
            gemm_fp8::grouped_gemv_swiglu_fp8_cuda(
                &stream,
                &a_fp8,
                &w1_fp8,
                &c_v,
                &up,
                extra.as_ref(),
                &mut act_q.slice_mut(0..rows * i),
                &mut act_s.slice_mut(0..rows * sg),
                &mut products.slice_mut(0..rows * i),
                ws,
            )?;
        } else {
            let hu = hu.insert(alloc_uninit::<bf16>(&stream, rows * 2 * i)?);
            gemm_fp8::grouped_gemm_fp8_cuda(
                &stream,
                &a_fp8,
                &w1_fp8,
                &c_v,
                &up,
                extra.as_ref(),
                tiles,
                &mut hu.slice_mut(0..rows * 2 * i),
                ws,
            )?;
            // The down GEMM's rows: act = silu(gate) * up quantized 1 x 128, in one pass (rows
            // past the counts of a masked layout are skipped).
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
                gemm_fp8::FP8_GATE_UP_BLOCK,
                mask,
                &mut act_q.slice_mut(0..rows * i),
                &mut act_s.slice_mut(0..rows * sg),
            )?;
        }
    }
    {
        let c_d = DeviceTensor::new("counts", counts)?;
        let w2 = DeviceTensor::new("down", w2)?;
        let s2 = DeviceTensor::new("down scales", s2)?;
        let (q_v, s_v, w2_v, s2_v) = (
            act_q.slice(0..rows * i),
            act_s.slice(0..rows * sg),
            w2.view::<F8E4M3>()?,
            s2.view::<f32>()?,
        );
        let shared_d = match groups.shared {
            Some((sh, _, _)) => Some((
                DeviceTensor::new("shared down", &sh.down)?,
                DeviceTensor::new("shared down scales", &sh.down_scale)?,
            )),
            None => None,
        };
        let shared_v = match &shared_d {
            Some((w, sw)) => Some((w.view::<F8E4M3>()?, sw.view::<f32>()?)),
            None => None,
        };
        let extra = shared_v.as_ref().map(|(w, sw)| ExtraGroupsFp8 {
            first: l,
            b: DeviceFp8 { q: w, scales: sw },
            a: None,
        });
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
            extra.as_ref(),
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
        Groups {
            routed: Some(experts),
            shared: None,
        },
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
/// past the counts unwritten. With `shared` (its blocks and this rank's tokens `[T, H]`,
/// `T <= M`), the shared experts run as the last groups of the same GEMMs and their output
/// `[T, H]` comes back too.
pub(crate) fn forward_masked(
    experts: &Experts,
    input: &ExpertInput,
    counts: &Tensor,
    shared: Option<(&SharedFp8, &Tensor)>,
    tiles: GemmTiles,
) -> Result<(Tensor, Option<Tensor>)> {
    let dev = cuda(input.x.device())?;
    let stream = dev.cuda_stream();
    let (l, m, h) = input.x.dims3()?;
    let counts = counts.contiguous()?;
    let (xq, xs) = match &input.scales {
        Some(_) => fp8_rows(input)?,
        // Float rows: only the rows within the counts are quantized (a decode step's blocks
        // are mostly empty).
        None => masked_rows(
            dev,
            &input.float_rows()?.to_dtype(DType::BF16)?,
            &counts,
            (l, m, h),
        )?,
    };
    let tiles = match tiles {
        // Shapes the tile-less fp8 GEMV does not take: the 64 x 128 tiles.
        GemmTiles::Gemv if !gemm_fp8::gemv_takes(&[h, experts.intermediate_size()]) => {
            GemmTiles::Narrow
        }
        t => t,
    };
    let xq = xq.reshape((l * m, h))?;
    let xs = xs.reshape((l * m, h / ep_kernels::FP8_GROUP))?;
    let Some((blocks, tokens)) = shared else {
        let y = mlp_rows(
            experts,
            dev,
            Groups {
                routed: Some(experts),
                shared: None,
            },
            &xq,
            &xs,
            &counts,
            GroupLayout::Masked { m_max: m },
            l * m,
            tiles,
        )?;
        return Ok((y.reshape((l, m, h))?, None));
    };
    let t = tokens.dims2()?.0;
    if t == 0 || t > m {
        return Err(Error::invalid(
            "tokens",
            format!("{t} rows"),
            format!("the shared experts' groups take 1..={m} rows (the block size)"),
        ));
    }
    let x = blocks.blocks();
    let (tq, ts) = per_token_cast_to_fp8(&tokens.to_dtype(DType::BF16)?.contiguous()?, false)?;
    let mut all_counts = alloc_uninit::<i32>(&stream, l + x)?;
    {
        let c_d = DeviceTensor::new("counts", &counts)?;
        stream
            .memcpy_dtod(&c_d.view::<i32>()?, &mut all_counts.slice_mut(0..l))
            .map_err(ep_kernels::Error::from)?;
        ep_kernels::cuda::fill_i32_cuda(&stream, &mut all_counts.slice_mut(l..l + x), t as i32)?;
    }
    let all_counts = wrap(all_counts, l + x, dev);
    let y = mlp_rows(
        experts,
        dev,
        Groups {
            routed: Some(experts),
            shared: Some((blocks, &tq, &ts)),
        },
        &xq,
        &xs,
        &all_counts,
        GroupLayout::Masked { m_max: m },
        (l + x) * m,
        tiles,
    )?;
    let routed = y.narrow(0, 0, l * m)?.reshape((l, m, h))?;
    Ok((routed, Some(sum_blocks(&y, l, x, m, t)?)))
}

/// The shared experts alone over `tokens` (`[T, H]`): their blocks as a grouped fp8 GEMM whose
/// every group reads the tokens (quantized once); returns `[T, H]` bf16.
pub(crate) fn forward_shared(
    experts: &Experts,
    blocks: &SharedFp8,
    tokens: &Tensor,
) -> Result<Tensor> {
    let dev = cuda(tokens.device())?;
    let stream = dev.cuda_stream();
    let t = tokens.dims2()?.0;
    let x = blocks.blocks();
    let (tq, ts) = per_token_cast_to_fp8(&tokens.to_dtype(DType::BF16)?.contiguous()?, false)?;
    let mut counts = alloc_uninit::<i32>(&stream, x)?;
    ep_kernels::cuda::fill_i32_cuda(&stream, &mut counts.slice_mut(0..x), t as i32)?;
    let counts = wrap(counts, x, dev);
    let empty = empty_operand(dev)?;
    let y = mlp_rows(
        experts,
        dev,
        Groups {
            routed: None,
            shared: Some((blocks, &tq, &ts)),
        },
        &empty.0,
        &empty.1,
        &counts,
        GroupLayout::Masked { m_max: t },
        x * t,
        GemmTiles::Auto,
    )?;
    sum_blocks(&y, 0, x, t, t)
}

/// The sum of the first `t` rows of blocks `first..first + x` (of `m` rows each) of `y`.
fn sum_blocks(y: &Tensor, first: usize, x: usize, m: usize, t: usize) -> Result<Tensor> {
    let mut out = y.narrow(0, first * m, t)?;
    for j in 1..x {
        out = (out + y.narrow(0, (first + j) * m, t)?)?;
    }
    Ok(out)
}
