//! What the normal-mode ops on CUDA tensors (`normal.rs`) share: for the fresh and cached
//! dispatch, the receive buffers of the rows and the launch of either transfer path; for those
//! and the combine, the copy-engine configs of a copy-engine handle.

use super::common::kernel_err;
use super::tensor::{alloc_uninit, wrap, DeviceTensor};
use super::CudaBuffer;
use crate::error::{Error, Result};
use crate::normal::DispatchArgs;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Tensor;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use ep_kernels::intranode as ki;
use ep_kernels::FP8_GROUP;
use std::sync::Arc;

/// `x` and its optional scales of a dispatch, borrowed for the launch.
pub(super) fn x_tensors<'a>(
    args: &DispatchArgs<'a>,
) -> Result<(DeviceTensor<'a>, Option<DeviceTensor<'a>>)> {
    let x_d = DeviceTensor::new("x", args.x)?;
    let xs_d = args
        .x_scales
        .map(|s| DeviceTensor::new("x_scales", s))
        .transpose()?;
    Ok((x_d, xs_d))
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

impl CudaBuffer {
    /// The copy-engine configs `(dispatch, combine)`, or the error for a handle of a
    /// copy-engine dispatch when this buffer has the copy-engine path off.
    pub(super) fn ce_configs(&self) -> Result<&(ki::CeConfig, ki::CeConfig)> {
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
                },
            ),
        }
        .map_err(|e| kernel_err(e, self.timeout))
    }
}
