//! The experts' forward passes on CUDA as grouped GEMMs (`ep_kernels::gemm`), entirely on
//! candle's stream, with no host read of routing or counts:
//!
//! - routed rows (normal mode): expert-major permute (`ep_kernels::expert_order`) ->
//!   contiguous gate_up GEMM with SwiGLU in its epilogue -> down GEMM -> weighted un-permute;
//! - blocks with device counts (low-latency mode): masked gate_up GEMM with SwiGLU -> down GEMM
//!   (`GemmTiles::Gemv` for a few rows per block on GPUs of moderate bandwidth per SM).
//!
//! The gate_up weights are in the blocked layout the SwiGLU epilogue pairs
//! (`ep_kernels::gemm::GATE_UP_BLOCK`; see [`crate::Experts`]).
//!
//! Intermediates are allocated uninitialised (every row the next step reads is written by the
//! previous one). The GEMM workspace is created on first use and reused; a lock keeps one
//! forward at a time per [`Experts`] (the setup tables of a GEMM must not be overwritten by
//! another forward before it has run: all launches are on candle's one stream).

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use ep_kernels::expert_order;
use ep_kernels::gemm::{self, ExtraGroups, GemmGrid, GemmTiles, GroupLayout, GroupedGemmShape};
use ep_runtime::device_tensor::{alloc_uninit, wrap, DeviceTensor};
use half::bf16;

use super::grouped_state::workspace;
use super::shard::Experts;
use super::shared_groups::SharedGroups;
use crate::error::{Error, Result};

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

/// The shared experts' blocks joining a masked [`mlp_rows`] as its last groups, over `tokens`
/// (`[T, H]` bf16, contiguous).
struct SharedRows<'a> {
    groups: &'a SharedGroups,
    tokens: &'a Tensor,
}

/// gate_up GEMM with SwiGLU -> down GEMM over the rows of `a` (`[rows, H]` bf16) that `layout`
/// and `counts` (`[groups]` i32, device) make valid; returns `y` `[rows, H]` bf16 (other rows
/// unwritten). With `shared`, the last groups are its blocks (masked layout; `a` then holds
/// only the routed experts' blocks).
#[allow(clippy::too_many_arguments)]
fn mlp_rows(
    experts: &Experts,
    dev: &CudaDevice,
    a: &Tensor,
    counts: &Tensor,
    layout: GroupLayout,
    rows: usize,
    shared: Option<SharedRows<'_>>,
    tiles: GemmTiles,
) -> Result<Tensor> {
    let stream = dev.cuda_stream();
    let (l, h, i) = (
        experts.num_local(),
        experts.hidden_size(),
        experts.intermediate_size(),
    );
    let groups = l + shared.as_ref().map_or(0, |s| s.groups.blocks());
    let mut ws = workspace(experts.grouped_state(), &stream, groups)?;
    let ws = ws.as_mut().expect("created by workspace()");
    ws.set_grid(match layout {
        GroupLayout::Contiguous { .. } => experts.grouped_state().routed_grid(),
        GroupLayout::Masked { .. } => GemmGrid::Persistent,
    })?;
    let up = GroupedGemmShape {
        groups,
        rows,
        n: 2 * i,
        k: h,
        layout,
    };
    let down = GroupedGemmShape {
        groups,
        rows,
        n: h,
        k: i,
        layout,
    };
    let mut act = alloc_uninit::<bf16>(&stream, rows * i)?;
    let mut y = alloc_uninit::<bf16>(&stream, rows * h)?;
    {
        let a_d = DeviceTensor::new("a", a)?;
        let c_d = DeviceTensor::new("counts", counts)?;
        let w1 = DeviceTensor::new("gate_up", experts.gate_up())?;
        let w2 = DeviceTensor::new("down", experts.down())?;
        let shared_d = match &shared {
            Some(s) => Some((
                DeviceTensor::new("tokens", s.tokens)?,
                DeviceTensor::new("shared gate_up", s.groups.gate_up())?,
                DeviceTensor::new("shared down", s.groups.down())?,
            )),
            None => None,
        };
        let shared_v = match &shared_d {
            Some((t, gu, dn)) => Some((t.view::<bf16>()?, gu.view::<bf16>()?, dn.view::<bf16>()?)),
            None => None,
        };
        let extra_up = shared_v.as_ref().map(|(t, gu, _)| ExtraGroups {
            first: l,
            b: gu,
            a: Some(t),
        });
        let extra_down = shared_v.as_ref().map(|(_, _, dn)| ExtraGroups {
            first: l,
            b: dn,
            a: None,
        });
        let c_v = c_d.view::<i32>()?;
        let mut act_v = act.slice_mut(0..rows * i);
        let mut y_v = y.slice_mut(0..rows * h);
        // SwiGLU runs in the gate_up GEMM's epilogue: no [rows, 2I] intermediate.
        gemm::grouped_gemm_swiglu_bf16_cuda(
            &stream,
            &a_d.view::<bf16>()?,
            &w1.view::<bf16>()?,
            &c_v,
            &up,
            extra_up.as_ref(),
            tiles,
            &mut act_v,
            ws,
        )?;
        gemm::grouped_gemm_bf16_extra_cuda(
            &stream,
            &act_v,
            &w2.view::<bf16>()?,
            &c_v,
            &down,
            extra_down.as_ref(),
            tiles,
            &mut y_v,
            ws,
        )?;
    }
    Ok(wrap(y, (rows, h), dev))
}

/// Normal-mode path of [`Experts::forward_grouped`]: returns `[N, H]` bf16. `rows`: the
/// (token, local expert) pairs of the routing when the caller knows them (else every slot's).
pub(crate) fn forward_routed(
    experts: &Experts,
    x: &Tensor,
    topk_idx: &Tensor,
    topk_weights: &Tensor,
    rows: Option<usize>,
) -> Result<Tensor> {
    let dev = cuda(x.device())?;
    let stream = dev.cuda_stream();
    let (n, h) = x.dims2()?;
    let k = topk_idx.dims2()?.1;
    let l = experts.num_local();
    let x = x.to_dtype(DType::BF16)?.contiguous()?;
    let idx = topk_idx.to_dtype(DType::I64)?.contiguous()?;
    let w = topk_weights.to_dtype(DType::F32)?.contiguous()?;
    let bound = expert_order::rows_bound(n, k, l, 1);
    // Never more than the routing can hold; at least one row (no zero-byte allocation).
    let rows = rows.map_or(bound, |r| r.clamp(1, bound));
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
        None,
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

/// The masked GEMMs' configuration for blocks expected to hold `expected_rows` rows on `dev`
/// (its DRAM bandwidth per SM decides; [`GemmTiles::for_masked_rows`]).
pub(crate) fn masked_tiles(dev: &Device, expected_rows: usize) -> Result<GemmTiles> {
    let dev = cuda(dev)?;
    Ok(GemmTiles::for_masked_rows_cuda(
        &dev.cuda_stream(),
        expected_rows,
    )?)
}

/// Low-latency path of [`Experts::forward_masked`]: `x` `[L, M, H]`, `counts` `[L]` i32
/// (device); returns `[L, M, H]` bf16 with the rows past the counts unwritten. `tiles`: the
/// GEMMs' configuration ([`masked_tiles`]).
pub(crate) fn forward_masked(
    experts: &Experts,
    x: &Tensor,
    counts: &Tensor,
    tiles: GemmTiles,
) -> Result<Tensor> {
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
        None,
        tiles,
    )?;
    Ok(y.reshape((l, m, h))?)
}

/// [`forward_masked`] with the shared experts' blocks as extra groups over `tokens` (`[T, H]`,
/// `T <= M`): returns the routed experts' `[L, M, H]` (rows past the counts unwritten) and the
/// shared experts' output `[T, H]`, both bf16 (`tiles` as for [`forward_masked`]). The counts of the extra groups (`T`) join the
/// routed ones on the device (a copy and a memset: capturable, no host read).
pub(crate) fn forward_masked_with_shared(
    experts: &Experts,
    x: &Tensor,
    counts: &Tensor,
    tokens: &Tensor,
    shared: &SharedGroups,
    tiles: GemmTiles,
) -> Result<(Tensor, Tensor)> {
    let dev = cuda(x.device())?;
    let stream = dev.cuda_stream();
    let (l, m, h) = x.dims3()?;
    let t = tokens.dims2()?.0;
    if t == 0 || t > m {
        return Err(Error::invalid(
            "tokens",
            format!("{t} rows"),
            format!("the shared experts' groups take 1..={m} rows (the block size)"),
        ));
    }
    let blocks = shared.blocks();
    let groups = l + blocks;
    let x = x.to_dtype(DType::BF16)?.contiguous()?;
    let tokens = tokens.to_dtype(DType::BF16)?.contiguous()?;
    let counts = counts.contiguous()?;
    let mut all_counts = alloc_uninit::<i32>(&stream, groups)?;
    {
        let c_d = DeviceTensor::new("counts", &counts)?;
        stream
            .memcpy_dtod(&c_d.view::<i32>()?, &mut all_counts.slice_mut(0..l))
            .map_err(ep_kernels::Error::from)?;
        ep_kernels::cuda::fill_i32_cuda(&stream, &mut all_counts.slice_mut(l..groups), t as i32)?;
    }
    let all_counts = wrap(all_counts, groups, dev);
    let y = mlp_rows(
        experts,
        dev,
        &x.reshape((l * m, h))?,
        &all_counts,
        GroupLayout::Masked { m_max: m },
        groups * m,
        Some(SharedRows {
            groups: shared,
            tokens: &tokens,
        }),
        tiles,
    )?;
    let routed = y.narrow(0, 0, l * m)?.reshape((l, m, h))?;
    let mut out = y.narrow(0, l * m, t)?;
    for j in 1..blocks {
        out = (out + y.narrow(0, (l + j) * m, t)?)?;
    }
    Ok((routed, out))
}
