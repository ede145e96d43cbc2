//! Normal mode on CUDA tensors: layout kernel, notify + poll, dispatch, combine (intranode).

use super::common::{kernel_err, lock};
use super::handle_data::CudaHandleData;
use super::normal_launch::{
    check_payload_dtype, payload, wrap_recv_topk, x_tensors, zero_weights, DispatchPath,
    DispatchRows, RecvRows, TopkTensors,
};
use super::tensor::{alloc, alloc_uninit, wrap, DeviceTensor};
use super::CudaBuffer;
use crate::backend::parts::{
    CachedDispatch, CachedParts, CombineInput, CombineParts, DispatchParts, FreshDispatch,
    HandleRecord, HandleTensors, LayoutParts,
};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};
use ep_kernels::intranode as ki;
use ep_kernels::layout::{self as kl, ExpertPlacement};
use ep_kernels::FP8_GROUP;
use std::sync::Arc;

impl CudaBuffer {
    /// Layout kernel on candle's stream (no host read).
    pub(crate) fn get_dispatch_layout(
        &self,
        topk_idx: &Tensor,
        num_topk: usize,
        placement: &ExpertPlacement,
    ) -> Result<LayoutParts> {
        let t = topk_idx.dims2()?.0;
        let (ntpr, ntpn, ntpe, itir) =
            self.device_layout(&self.compute, topk_idx, t, num_topk, placement)?;
        let event = EventOverlap::from_cuda(Arc::new(self.compute.record_event(None)?));
        Ok(LayoutParts {
            num_tokens_per_rank: ntpr,
            num_tokens_per_node: if placement.num_nodes() > 1 {
                Some(ntpn)
            } else {
                None
            },
            num_tokens_per_expert: ntpe,
            is_token_in_rank: itir,
            event,
            host: None,
        })
    }

    /// Runs the layout kernel on `stream`: `(per rank [R], per node [R/P], per expert [E],
    /// is_token_in_rank [T, R] u8)` as CUDA tensors.
    pub(super) fn device_layout(
        &self,
        stream: &Arc<cudarc::driver::CudaStream>,
        topk_idx: &Tensor,
        t: usize,
        k: usize,
        placement: &ExpertPlacement,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let r = placement.num_ranks;
        let nodes = placement.num_nodes();
        let e = placement.num_experts;
        if t == 0 || k == 0 {
            // Nothing is routed: every count is zero (and zero-sized launches are avoided).
            return Ok((
                wrap(alloc::<i32>(stream, r)?, r, &self.dev),
                wrap(alloc::<i32>(stream, nodes)?, nodes, &self.dev),
                wrap(alloc::<i32>(stream, e)?, e, &self.dev),
                wrap(alloc::<u8>(stream, t * r)?, (t, r), &self.dev),
            ));
        }
        let idx = DeviceTensor::new("topk_idx", topk_idx)?;
        let out = kl::get_dispatch_layout_cuda(stream, &idx.view::<i64>()?, t, k, placement)
            .map_err(|e| kernel_err(e, self.timeout))?;
        Ok((
            wrap(out.num_tokens_per_rank, r, &self.dev),
            wrap(out.num_tokens_per_node, nodes, &self.dev),
            wrap(out.num_tokens_per_expert, e, &self.dev),
            wrap(out.is_token_in_rank, (t, r), &self.dev),
        ))
    }

    /// Fresh (non-cached) dispatch: notify, poll the counts, allocate, dispatch. With
    /// `num_worst_tokens` the outputs are allocated for that many rows before the notify and
    /// the host reads nothing: notify and dispatch are queued back to back (SM rings only).
    pub(crate) fn dispatch_fresh(
        &self,
        f: FreshDispatch<'_>,
        num_topk: usize,
    ) -> Result<DispatchParts> {
        let worst = f.num_worst_tokens;
        #[cfg(feature = "nvshmem")]
        if let Some(inn) = &self.internode {
            if worst > 0 {
                return Err(Error::Unsupported(
                    "num_worst_tokens across nodes (the internode dispatch sizes its outputs \
                     from the count the host reads)"
                        .into(),
                ));
            }
            return self.internode_dispatch_fresh(inn, f, num_topk);
        }
        let nm = self.normal_mode()?;
        let args = &f;
        check_payload_dtype(args.x)?;
        let _op = lock(&self.op);
        self.check_nvl_error()?;
        let (r, me, t, h, k) = (self.num_ranks, self.rank, f.num_tokens, f.hidden, num_topk);
        let c = nm.kdispatch.num_channels();
        let l = f.num_experts / r;
        if l > ki::MAX_LOCAL_EXPERTS {
            return Err(Error::invalid(
                "num_experts",
                f.num_experts,
                format!(
                    "CUDA buffers support at most {} local experts per rank",
                    ki::MAX_LOCAL_EXPERTS
                ),
            ));
        }
        self.begin(args.previous_event)?;
        let comm = &self.comm;
        let (ntpr, ntpe, itir) = match &args.layout {
            Some(lay) => (
                lay.num_tokens_per_rank.clone(),
                lay.num_tokens_per_expert.clone(),
                lay.is_token_in_rank.clone(),
            ),
            None => {
                let idx = args.topk_idx.ok_or_else(|| {
                    Error::invalid("topk_idx", "None", "needed to compute the layout")
                })?;
                let (a, _, b, c) = self.device_layout(comm, idx, t, k, &f.placement)?;
                (a, b, c)
            }
        };
        // The copy-engine path when the NVLink buffer holds this op (and its combine); its
        // copies are sized on the host, so worst-case outputs take the rings.
        let use_ce = worst == 0 && nm.ce.is_some() && {
            let bytes = nm.peer_buffers.bytes();
            let (row, sc) = if f.fp8 {
                (h, h / FP8_GROUP)
            } else {
                (2 * h, 0)
            };
            t <= ki::CeSlotLayout::dispatch(bytes, r, row, sc, k).capacity
                && t <= ki::CeSlotLayout::combine(bytes, r, h, k).capacity
        };
        // Notify.
        if worst == 0 {
            nm.recv_counter.fill(-1);
            nm.expert_counter.fill(-1);
        }
        // Every output whose size does not depend on the received count is allocated here,
        // while the host would otherwise wait for the notify; the rest between the notify and
        // the dispatch, where the GPU waits for the host. Outputs that the kernels write in full
        // are not zeroed: a memset is a host call and a stream operation.
        let mut rpm = alloc_uninit::<i32>(comm, r * r)?;
        let mut cpm = alloc_uninit::<i32>(comm, r * c)?;
        let mut send_index = if use_ce {
            Some(alloc_uninit::<i32>(comm, (t * r).max(1))?)
        } else {
            None
        };
        // Written by the rings' receivers for every (source, channel).
        let mut recv_channel_offset = alloc_uninit::<i32>(comm, r * c)?;
        // Zeroed: the own rank's entries after its last token are not written.
        let mut send_head = alloc::<i32>(comm, t * r)?;
        let zero_w = zero_weights(comm, args.topk_weights, t, k)?;
        {
            let ntpr_d = DeviceTensor::new("layout.num_tokens_per_rank", &ntpr)?;
            let ntpe_d = DeviceTensor::new("layout.num_tokens_per_expert", &ntpe)?;
            let itir_d = DeviceTensor::new("layout.is_token_in_rank", &itir)?;
            ki::notify_dispatch_cuda(
                comm,
                &nm.peer_buffers,
                &nm.kdispatch,
                ki::NotifyArgs {
                    num_tokens_per_rank: ntpr_d.view::<i32>()?,
                    num_tokens_per_expert: ntpe_d.view::<i32>()?,
                    is_token_in_rank: itir_d.view::<u8>()?,
                    num_tokens: t,
                    num_experts: f.num_experts,
                    expert_alignment: args.expert_alignment,
                    rank_prefix_matrix: rpm.slice_mut(0..r * r),
                    channel_prefix_matrix: cpm.slice_mut(0..r * c),
                    moe_recv_counter: (worst == 0).then_some(&nm.recv_counter),
                    moe_recv_expert_counter: (worst == 0).then_some(&nm.expert_counter),
                    send_index: send_index.as_mut().map(|s| s.slice_mut(0..t * r)),
                },
            )
            .map_err(|e| kernel_err(e, self.timeout))?;
        }
        let (n, recv_per_source, per_expert) = if worst > 0 {
            (worst, Vec::new(), Vec::new())
        } else {
            let counts = ep_kernels::notify::poll_recv_counts(
                &nm.recv_counter,
                &nm.expert_counter,
                r,
                l,
                self.timeout,
                || self.check_nvl_error(),
                // The device never reported: blame the first peer, the barrier's first wait.
                |waited| Error::Timeout {
                    rank: (0..self.num_ranks)
                        .find(|&p| p != self.rank)
                        .unwrap_or(self.rank),
                    what: "notify_dispatch (receive counts never arrived)".into(),
                    waited,
                },
            )?;
            let n = counts.num_recv_tokens;
            tracing::trace!(rank = me, recv = n, "notify done");
            (n, counts.per_source, counts.per_expert)
        };

        // Outputs of the received count (exact sizes; the dispatch writes every row) and dispatch.
        let mut recv_src_idx = alloc_uninit::<i32>(comm, n)?;
        let mut recv_idx = alloc_uninit::<i64>(comm, n * k)?;
        let mut recv_w = alloc_uninit::<f32>(comm, n * k)?;
        let mut recv_rows = RecvRows::default();
        {
            let (x_d, xs_d) = x_tensors(args.x, args.x_scales)?;
            let topk_d = TopkTensors::new(args.topk_idx, args.topk_weights, k)?;
            let itir_d = DeviceTensor::new("layout.is_token_in_rank", &itir)?;
            let payload = payload(&x_d, xs_d.as_ref(), f.fp8)?;
            let recv_payload = recv_rows.alloc(comm, f.fp8, n, h)?;
            let topk = topk_d.views(zero_w.as_ref(), t, k)?;
            let recv_topk = if topk.is_some() {
                Some(ki::RecvTopK {
                    idx: recv_idx.slice_mut(0..n * k),
                    weights: recv_w.slice_mut(0..n * k),
                })
            } else {
                None
            };
            let rows = DispatchRows {
                x: payload,
                topk,
                num_experts: f.num_experts,
                recv_x: recv_payload,
                recv_src_idx: recv_src_idx.slice_mut(0..n),
                recv_topk,
                hidden: h,
                num_topk: k,
            };
            let path = match (&nm.ce, &send_index) {
                (Some(ce), Some(si)) => DispatchPath::CopyEngine {
                    config: ce.dispatch(f.fp8),
                    send_index: si.slice(0..t * r),
                    rank_prefix_matrix: rpm.slice(0..r * r),
                    recv_per_source: &recv_per_source,
                },
                _ => DispatchPath::Rings {
                    is_token_in_rank: itir_d.view::<u8>()?,
                    rank_prefix_matrix: rpm.slice(0..r * r),
                    channel_prefix_matrix: cpm.slice(0..r * c),
                    recv_channel_offset: recv_channel_offset.slice_mut(0..r * c),
                    send_head: send_head.slice_mut(0..t * r),
                    num_recv_tokens: n,
                    worst_case: worst > 0,
                },
            };
            self.launch_dispatch(path, rows)?;
        }
        let event = self.finish(args.async_finish)?;
        let dev = &self.dev;
        let (recv_x, recv_x_scales) = recv_rows.wrap(n, h, dev);
        let with_topk = k > 0 && args.topk_idx.is_some();
        let (recv_topk_idx, recv_topk_weights) =
            wrap_recv_topk(recv_idx, recv_w, with_topk, (n, k), dev);
        let recv_src_idx = wrap(recv_src_idx, n, dev);
        let (send_head, cuda) = match send_index {
            Some(si) => {
                let si = wrap(si, (t, r), dev);
                (
                    si.clone(),
                    CudaHandleData::CopyEngine {
                        send_index: si,
                        recv_per_source,
                    },
                )
            }
            None => {
                let sh = wrap(send_head, (t, r), dev);
                (
                    sh.clone(),
                    CudaHandleData::Rings {
                        recv_channel_offset: wrap(recv_channel_offset, (r, c), dev),
                        kernel_send_head: sh,
                        worst_case: worst > 0,
                    },
                )
            }
        };
        let handle = cuda_record(
            (t, n),
            HandleTensors {
                rank_prefix_matrix: wrap(rpm, (r, r), dev),
                channel_prefix_matrix: wrap(cpm, (r, c), dev),
                recv_src_idx,
                is_token_in_rank: itir,
                send_head,
            },
            cuda,
        );
        Ok(DispatchParts {
            recv_x,
            recv_x_scales,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert: per_expert,
            handle,
            event,
        })
    }

    /// Cached dispatch: reuses the handle's routing (barrier, then dispatch of `x` only).
    pub(crate) fn dispatch_cached(&self, args: CachedDispatch<'_>) -> Result<CachedParts> {
        let hi = args.handle;
        let (hidden, fp8) = (args.hidden, args.fp8);
        let cd = hi.cuda_data()?;
        #[cfg(feature = "nvshmem")]
        if let CudaHandleData::Internode(ih) = cd {
            return self.internode_dispatch_cached(self.internode()?, &args, ih);
        }
        let nm = self.normal_mode()?;
        check_payload_dtype(args.x)?;
        let _op = lock(&self.op);
        self.check_nvl_error()?;
        let (r, t, n, h) = (self.num_ranks, hi.num_tokens, hi.num_recv_tokens, hidden);
        let c = nm.kdispatch.num_channels();
        self.begin(args.previous_event)?;
        let comm = &self.comm;
        ki::cached_notify_cuda(comm, &nm.peer_buffers).map_err(|e| kernel_err(e, self.timeout))?;
        let (ce, worst_case) = match cd {
            CudaHandleData::CopyEngine {
                send_index,
                recv_per_source,
            } => (
                Some((
                    send_index,
                    recv_per_source,
                    self.ce_configs()?.dispatch(fp8),
                )),
                false,
            ),
            CudaHandleData::Rings { worst_case, .. } => (None, *worst_case),
            #[cfg(feature = "nvshmem")]
            CudaHandleData::Internode(_) => unreachable!("internode handles returned above"),
        };
        let mut scratch_src = alloc::<i32>(comm, n)?;
        let mut scratch_off = alloc::<i32>(comm, r * c)?;
        let mut scratch_head = alloc::<i32>(comm, t * r)?;
        let mut recv_rows = RecvRows::default();
        {
            let (x_d, xs_d) = x_tensors(args.x, args.x_scales)?;
            let itir = DeviceTensor::new("handle.is_token_in_rank", &hi.tensors.is_token_in_rank)?;
            let rpm =
                DeviceTensor::new("handle.rank_prefix_matrix", &hi.tensors.rank_prefix_matrix)?;
            let cpm = DeviceTensor::new(
                "handle.channel_prefix_matrix",
                &hi.tensors.channel_prefix_matrix,
            )?;
            let payload = payload(&x_d, xs_d.as_ref(), fp8)?;
            let recv_payload = recv_rows.alloc(comm, fp8, n, h)?;
            let rows = DispatchRows {
                x: payload,
                topk: None,
                num_experts: 0,
                recv_x: recv_payload,
                recv_src_idx: scratch_src.slice_mut(0..n),
                recv_topk: None,
                hidden: h,
                num_topk: 0,
            };
            let si_d;
            let path = match ce {
                Some((si, per_source, ce)) => {
                    si_d = DeviceTensor::new("handle.send_index", si)?;
                    DispatchPath::CopyEngine {
                        config: ce,
                        send_index: si_d.view::<i32>()?,
                        rank_prefix_matrix: rpm.view::<i32>()?,
                        recv_per_source: per_source,
                    }
                }
                None => DispatchPath::Rings {
                    is_token_in_rank: itir.view::<u8>()?,
                    rank_prefix_matrix: rpm.view::<i32>()?,
                    channel_prefix_matrix: cpm.view::<i32>()?,
                    recv_channel_offset: scratch_off.slice_mut(0..r * c),
                    send_head: scratch_head.slice_mut(0..t * r),
                    num_recv_tokens: n,
                    worst_case,
                },
            };
            self.launch_dispatch(path, rows)?;
        }
        let event = self.finish(args.async_finish)?;
        let (recv_x, recv_x_scales) = recv_rows.wrap(n, h, &self.dev);
        Ok(CachedParts {
            recv_x,
            recv_x_scales,
            event,
        })
    }

    /// Combine along `args.handle` (barrier, then the combine kernel).
    pub(crate) fn combine(&self, args: CombineInput<'_>) -> Result<CombineParts> {
        if args.x.dtype() != DType::BF16 {
            return Err(Error::DType {
                arg: "x",
                expected: "bf16 (CUDA buffers)",
                got: args.x.dtype(),
            });
        }
        let hi = args.handle;
        let cd = hi.cuda_data()?;
        #[cfg(feature = "nvshmem")]
        if let CudaHandleData::Internode(ih) = cd {
            return self.internode_combine(self.internode()?, &args, ih);
        }
        let nm = self.normal_mode()?;
        let (t, n) = (hi.num_tokens, hi.num_recv_tokens);
        let h = args.hidden;
        let k = args.num_topk.unwrap_or(0);
        let _op = lock(&self.op);
        self.check_nvl_error()?;
        self.begin(args.previous_event)?;
        let comm = &self.comm;
        ki::cached_notify_cuda(comm, &nm.peer_buffers).map_err(|e| kernel_err(e, self.timeout))?;
        // Every row is written by the combine kernels: no memset.
        let mut combined = alloc_uninit::<half::bf16>(comm, t * h)?;
        let mut combined_w = alloc::<f32>(comm, t * k)?;
        {
            let x_d = DeviceTensor::new("x", args.x)?;
            let w_d = args
                .topk_weights
                .map(|w| DeviceTensor::new("topk_weights", w))
                .transpose()?;
            let bias_d = args
                .bias
                .map(|b| DeviceTensor::new("bias", b))
                .transpose()?;
            let bias = bias_d
                .as_ref()
                .map(|b| b.view::<half::bf16>())
                .transpose()?;
            let rpm =
                DeviceTensor::new("handle.rank_prefix_matrix", &hi.tensors.rank_prefix_matrix)?;
            let topk_weights = w_d.as_ref().map(|w| w.view::<f32>()).transpose()?;
            let combined_topk_weights = if topk_weights.is_some() {
                Some(combined_w.slice_mut(0..t * k))
            } else {
                None
            };
            match cd {
                CudaHandleData::Rings {
                    recv_channel_offset,
                    kernel_send_head,
                    ..
                } => {
                    let rco = DeviceTensor::new("handle.recv_channel_offset", recv_channel_offset)?;
                    let sh = DeviceTensor::new("handle.send_head", kernel_send_head)?;
                    ki::combine_cuda(
                        comm,
                        &nm.peer_buffers,
                        &nm.kcombine,
                        ki::CombineArgs {
                            x: x_d.view::<half::bf16>()?,
                            topk_weights,
                            rank_prefix_matrix: rpm.view::<i32>()?,
                            recv_channel_offset: rco.view::<i32>()?,
                            send_head: sh.view::<i32>()?,
                            bias,
                            combined_x: combined.slice_mut(0..t * h),
                            combined_topk_weights,
                            num_recv_tokens: n,
                            hidden: h,
                            num_topk: k,
                        },
                    )
                }
                CudaHandleData::CopyEngine {
                    send_index,
                    recv_per_source,
                } => {
                    let ce = &self.ce_configs()?.combine;
                    let si = DeviceTensor::new("handle.send_index", send_index)?;
                    ki::ce_combine_cuda(
                        comm,
                        &nm.copies,
                        &nm.peer_buffers,
                        ce,
                        ki::CeCombineArgs {
                            x: x_d.view::<half::bf16>()?,
                            topk_weights,
                            rank_prefix_matrix: rpm.view::<i32>()?,
                            send_index: si.view::<i32>()?,
                            recv_per_source,
                            bias,
                            combined_x: combined.slice_mut(0..t * h),
                            combined_topk_weights,
                            hidden: h,
                            num_topk: k,
                        },
                    )
                }
                #[cfg(feature = "nvshmem")]
                CudaHandleData::Internode(_) => unreachable!("internode handles returned above"),
            }
            .map_err(|e| kernel_err(e, self.timeout))?;
        }
        self.combine_output(combined, combined_w, (t, h, k), args.async_finish)
    }
}

/// The record of a fresh dispatch of `t` tokens that received `n` (host-side copies of the
/// matrices stay empty: CUDA handles keep them on the device).
pub(super) fn cuda_record(
    (t, n): (usize, usize),
    tensors: HandleTensors,
    cuda: CudaHandleData,
) -> HandleRecord {
    HandleRecord {
        num_tokens: t,
        num_recv_tokens: n,
        rank_prefix_matrix: Vec::new(),
        is_token_in_rank: Vec::new(),
        tensors,
        cuda: Some(cuda),
    }
}
