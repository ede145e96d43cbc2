//! What the normal-mode ops on CUDA tensors (`normal.rs`, and `internode.rs` across nodes)
//! share: the payload's dtype check and views, the routing's views, the receive buffers of the
//! rows; for the one-node dispatch the launch of either transfer path, and for it and the
//! combine the copy-engine configs of a copy-engine handle.

use super::common::kernel_err;
use super::tensor::{alloc, alloc_uninit, hand_to, wrap, DeviceTensor};
use super::CudaBuffer;
use crate::backend::parts::CombineParts;
use crate::error::{Error, Result};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use ep_kernels::intranode as ki;
use ep_kernels::FP8_GROUP;
use std::sync::Arc;

/// `x` and its optional scales of a dispatch, borrowed for the launch.
pub(super) fn x_tensors<'a>(
    x: &'a Tensor,
    x_scales: Option<&'a Tensor>,
) -> Result<(DeviceTensor<'a>, Option<DeviceTensor<'a>>)> {
    let x_d = DeviceTensor::new("x", x)?;
    let xs_d = x_scales
        .map(|s| DeviceTensor::new("x_scales", s))
        .transpose()?;
    Ok((x_d, xs_d))
}

/// CUDA buffers move bf16 or f8e4m3 rows.
pub(super) fn check_payload_dtype(x: &Tensor) -> Result<()> {
    if matches!(x.dtype(), DType::BF16 | DType::F8E4M3) {
        Ok(())
    } else {
        Err(Error::DType {
            arg: "x",
            expected: "bf16 or f8e4m3 (CUDA buffers)",
            got: x.dtype(),
        })
    }
}

/// The kernels' view of `x` (fp8 with its scales, or bf16).
pub(super) fn payload<'a>(
    x: &'a DeviceTensor<'_>,
    xs: Option<&'a DeviceTensor<'_>>,
    fp8: bool,
) -> Result<ki::Payload<'a>> {
    Ok(if fp8 {
        let xs = xs.ok_or_else(|| Error::invalid("x_scales", "None", "fp8 x needs scales"))?;
        ki::Payload::Fp8 {
            x: x.view::<float8::F8E4M3>()?,
            scales: xs.view::<f32>()?,
        }
    } else {
        ki::Payload::Bf16(x.view::<half::bf16>()?)
    })
}

/// `[t, k]` zeros on `comm` to stand in for the weights of a fresh dispatch that sends top-k
/// (`k > 0`) without `topk_weights` ([`TopkTensors::views`]); `None` otherwise.
pub(super) fn zero_weights(
    comm: &Arc<CudaStream>,
    topk_weights: Option<&Tensor>,
    t: usize,
    k: usize,
) -> Result<Option<CudaSlice<f32>>> {
    match (k > 0, topk_weights) {
        (true, None) => Ok(Some(alloc::<f32>(comm, t * k)?)),
        _ => Ok(None),
    }
}

/// The received top-k of a fresh dispatch (`idx`, `weights`) as `[n, k]` tensors of `dev`, or
/// `None`s when the dispatch sent none (`with_topk` false; the slices are then dropped).
pub(super) fn wrap_recv_topk(
    idx: CudaSlice<i64>,
    weights: CudaSlice<f32>,
    with_topk: bool,
    (n, k): (usize, usize),
    dev: &CudaDevice,
) -> (Option<Tensor>, Option<Tensor>) {
    if with_topk {
        (
            Some(wrap(idx, (n, k), dev)),
            Some(wrap(weights, (n, k), dev)),
        )
    } else {
        (None, None)
    }
}

/// The routing a fresh dispatch sends along (`k` > 0), borrowed for the launch.
pub(super) struct TopkTensors<'a> {
    idx: Option<DeviceTensor<'a>>,
    weights: Option<DeviceTensor<'a>>,
}

impl<'a> TopkTensors<'a> {
    pub(super) fn new(
        topk_idx: Option<&'a Tensor>,
        topk_weights: Option<&'a Tensor>,
        k: usize,
    ) -> Result<Self> {
        Ok(Self {
            idx: topk_idx
                .filter(|_| k > 0)
                .map(|i| DeviceTensor::new("topk_idx", i))
                .transpose()?,
            weights: topk_weights
                .filter(|_| k > 0)
                .map(|w| DeviceTensor::new("topk_weights", w))
                .transpose()?,
        })
    }

    /// The kernels' view (`None` without routing); `zero_w` (`[T, K]` zeros) stands in for
    /// weights the caller did not give.
    pub(super) fn views<'b>(
        &'b self,
        zero_w: Option<&'b CudaSlice<f32>>,
        t: usize,
        k: usize,
    ) -> Result<Option<ki::TopK<'b>>> {
        let Some(i) = &self.idx else {
            return Ok(None);
        };
        let weights = match (&self.weights, zero_w) {
            (Some(w), _) => w.view::<f32>()?,
            (None, Some(z)) => z.slice(0..t * k),
            (None, None) => {
                return Err(Error::invalid(
                    "topk_weights",
                    "None",
                    "needed (or zeros in their place) with topk_idx",
                ))
            }
        };
        Ok(Some(ki::TopK {
            idx: i.view::<i64>()?,
            weights,
        }))
    }
}

/// The receive buffers of a dispatch's rows: bf16, or fp8 and its scales.
#[derive(Default)]
pub(super) struct RecvRows {
    bf16: Option<CudaSlice<half::bf16>>,
    fp8: Option<CudaSlice<float8::F8E4M3>>,
    scales: Option<CudaSlice<f32>>,
}

impl RecvRows {
    /// Allocates `[n, h]` rows on `comm`, fp8 with `[n, h / FP8_GROUP]` scales or bf16, and
    /// returns them as the kernels' receive payload. No memset: the dispatch kernels write
    /// every received row and scale (a stale row would fail the GPU tests' comparisons).
    pub(super) fn alloc(
        &mut self,
        comm: &Arc<CudaStream>,
        fp8: bool,
        n: usize,
        h: usize,
    ) -> Result<ki::RecvPayload<'_>> {
        let groups = h / FP8_GROUP;
        Ok(if fp8 {
            let rx = self
                .fp8
                .insert(alloc_uninit::<float8::F8E4M3>(comm, n * h)?);
            let rs = self.scales.insert(alloc_uninit::<f32>(comm, n * groups)?);
            ki::RecvPayload::Fp8 {
                x: rx.slice_mut(0..n * h),
                scales: rs.slice_mut(0..n * groups),
            }
        } else {
            let rx = self.bf16.insert(alloc_uninit::<half::bf16>(comm, n * h)?);
            ki::RecvPayload::Bf16(rx.slice_mut(0..n * h))
        })
    }

    /// The received rows, `[n, h]`, and fp8 scales, `[n, h / FP8_GROUP]`, as tensors of `dev`.
    pub(super) fn wrap(self, n: usize, h: usize, dev: &CudaDevice) -> (Tensor, Option<Tensor>) {
        let recv_x = match (self.bf16, self.fp8) {
            (Some(b), _) => wrap(b, (n, h), dev),
            (None, Some(q)) => wrap(q, (n, h), dev),
            (None, None) => unreachable!("one payload buffer was allocated"),
        };
        let recv_x_scales = self.scales.map(|s| wrap(s, (n, h / FP8_GROUP), dev));
        (recv_x, recv_x_scales)
    }
}

/// The inputs and outputs of a dispatch launch ([`CudaBuffer::launch_dispatch`]) of its
/// transfer path, in the kernels' argument order.
pub(super) enum DispatchPath<'a> {
    /// The copy-engine kernels, with the buffer's dispatch config.
    CopyEngine {
        config: &'a ki::CeConfig,
        send_index: CudaView<'a, i32>,
        rank_prefix_matrix: CudaView<'a, i32>,
        recv_per_source: &'a [usize],
    },
    /// The SM ring kernels.
    Rings {
        is_token_in_rank: CudaView<'a, u8>,
        rank_prefix_matrix: CudaView<'a, i32>,
        channel_prefix_matrix: CudaView<'a, i32>,
        recv_channel_offset: CudaViewMut<'a, i32>,
        send_head: CudaViewMut<'a, i32>,
        num_recv_tokens: usize,
        /// `num_recv_tokens` is a worst case every rank shares, not this rank's count.
        worst_case: bool,
    },
}

/// What a dispatch launch moves on either path: the rows and routing, and their receive
/// buffers.
pub(super) struct DispatchRows<'a> {
    pub(super) x: ki::Payload<'a>,
    pub(super) topk: Option<ki::TopK<'a>>,
    pub(super) num_experts: usize,
    pub(super) recv_x: ki::RecvPayload<'a>,
    pub(super) recv_src_idx: CudaViewMut<'a, i32>,
    pub(super) recv_topk: Option<ki::RecvTopK<'a>>,
    pub(super) hidden: usize,
    pub(super) num_topk: usize,
}

/// The copy-engine path's launch configurations (`ki::CeConfig`'s tuned defaults).
#[derive(Debug, Clone, Copy)]
pub(super) struct CeConfigs {
    /// Dispatch of bf16 rows.
    dispatch: ki::CeConfig,
    /// Dispatch of fp8 rows (the pushed blocks keep the general chunking).
    dispatch_fp8: ki::CeConfig,
    /// Combine.
    pub(super) combine: ki::CeConfig,
}

impl CeConfigs {
    /// The defaults for `num_ranks` ranks and `num_sms` SMs.
    pub(super) fn new(num_ranks: usize, num_sms: usize) -> Self {
        Self {
            dispatch: ki::CeConfig::dispatch_for(num_ranks, num_sms),
            dispatch_fp8: ki::CeConfig::dispatch_fp8_for(num_ranks, num_sms),
            combine: ki::CeConfig::combine_for(num_ranks, num_sms),
        }
    }

    /// The dispatch's configuration for fp8 or bf16 rows.
    pub(super) fn dispatch(&self, fp8: bool) -> &ki::CeConfig {
        if fp8 {
            &self.dispatch_fp8
        } else {
            &self.dispatch
        }
    }
}

impl CudaBuffer {
    /// Ends a combine launched on the communication stream: its event, and its parts from the
    /// kernels' `[T, H]` rows and `[T, K]` weights (`K` = 0: none).
    pub(super) fn combine_output(
        &self,
        combined: CudaSlice<half::bf16>,
        combined_w: CudaSlice<f32>,
        (t, h, k): (usize, usize, usize),
        async_finish: bool,
    ) -> Result<CombineParts> {
        let event = self.finish(async_finish)?;
        let (combined, combined_w) = if async_finish {
            (combined, combined_w)
        } else {
            // candle's stream has waited for the combine: the outputs become its own.
            (
                hand_to(combined, &self.compute),
                hand_to(combined_w, &self.compute),
            )
        };
        let dev = &self.dev;
        Ok(CombineParts {
            combined_x: wrap(combined, (t, h), dev),
            combined_topk_weights: (k > 0).then(|| wrap(combined_w, (t, k), dev)),
            event,
        })
    }

    /// The copy-engine configs, or the error for a handle of a copy-engine dispatch when this
    /// buffer has the copy-engine path off.
    pub(super) fn ce_configs(&self) -> Result<&CeConfigs> {
        let nm = self.normal_mode()?;
        nm.ce.as_ref().ok_or_else(|| {
            Error::invalid(
                "handle",
                "a copy-engine dispatch's",
                "this buffer has the copy-engine path off",
            )
        })
    }

    /// Launches the dispatch of `rows` along `path` on the communication stream.
    pub(super) fn launch_dispatch(
        &self,
        path: DispatchPath<'_>,
        rows: DispatchRows<'_>,
    ) -> Result<()> {
        let nm = self.normal_mode()?;
        match path {
            DispatchPath::CopyEngine {
                config,
                send_index,
                rank_prefix_matrix,
                recv_per_source,
            } => ki::ce_dispatch_cuda(
                &self.comm,
                &nm.copies,
                &nm.peer_buffers,
                config,
                ki::CeDispatchArgs {
                    x: rows.x,
                    topk: rows.topk,
                    num_experts: rows.num_experts,
                    send_index,
                    rank_prefix_matrix,
                    recv_per_source,
                    recv_x: rows.recv_x,
                    recv_src_idx: rows.recv_src_idx,
                    recv_topk: rows.recv_topk,
                    hidden: rows.hidden,
                    num_topk: rows.num_topk,
                },
            ),
            DispatchPath::Rings {
                is_token_in_rank,
                rank_prefix_matrix,
                channel_prefix_matrix,
                recv_channel_offset,
                send_head,
                num_recv_tokens,
                worst_case,
            } => ki::dispatch_cuda(
                &self.comm,
                &nm.peer_buffers,
                &nm.kdispatch,
                ki::DispatchArgs {
                    x: rows.x,
                    topk: rows.topk,
                    num_experts: rows.num_experts,
                    is_token_in_rank,
                    rank_prefix_matrix,
                    channel_prefix_matrix,
                    recv_x: rows.recv_x,
                    recv_src_idx: rows.recv_src_idx,
                    recv_topk: rows.recv_topk,
                    recv_channel_offset,
                    send_head,
                    num_recv_tokens,
                    hidden: rows.hidden,
                    num_topk: rows.num_topk,
                    worst_case,
                },
            ),
        }
        .map_err(|e| kernel_err(e, self.timeout))
    }
}
