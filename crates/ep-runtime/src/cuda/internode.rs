//! Normal mode of a CUDA buffer across nodes (feature `nvshmem`): the internode kernels of
//! `ep_kernels::internode` over a buffer on NVSHMEM's symmetric heap. A token crosses the
//! network once per destination node, to the GPU with its home's local index there, and the
//! node's GPUs take theirs over NVLink; combine sums each node's rows on that GPU first.
//! Outputs, handle and receive order are those of the one-node path.

use super::common::{kernel_err, lock};
use super::handle_data::{CudaHandleData, InternodeHandle};
use super::normal::cuda_record;
use super::normal_launch::{
    check_payload_dtype, payload, wrap_recv_topk, x_tensors, zero_weights, RecvRows, TopkTensors,
};
use super::tensor::{alloc, alloc_uninit, wrap, DeviceTensor};
use super::CudaBuffer;
use crate::backend::parts::{
    CachedDispatch, CachedParts, CombineInput, CombineParts, DispatchParts, FreshDispatch,
    HandleTensors,
};
use crate::config::InternodeSizing;
use crate::error::{Error, Result};
use crate::topology::Topology;
use cudarc::driver::CudaStream;
use ep_kernels::internode as kn;
use ep_kernels::intranode as ki;
use std::sync::Arc;
use std::time::Duration;

/// The internode normal mode of one rank: its buffer on NVSHMEM's heap.
#[derive(Debug)]
pub(crate) struct InternodeCuda {
    buf: kn::InternodeBuffer,
}

impl InternodeCuda {
    /// Allocates this rank's internode buffer on `nv`'s heap (a collective over every rank).
    pub(super) fn new(
        comm: &Arc<CudaStream>,
        topo: Topology,
        sizing: InternodeSizing,
        nv: &Arc<nvshmem_sys::Nvshmem>,
        timeout: Duration,
    ) -> Result<Self> {
        let layout = kn::InternodeLayout::new(
            topo.num_ranks,
            topo.gpus_per_node,
            sizing.max_tokens_per_rank,
            sizing.hidden,
            sizing.max_topk,
        )?;
        let mut buf = kn::InternodeBuffer::new(comm, layout, nv, |q| topo.same_node(q))?;
        buf.set_timeout(timeout);
        tracing::debug!(
            rank = topo.rank,
            bytes = layout.total_bytes,
            "internode buffer ready"
        );
        Ok(Self { buf })
    }
}

impl CudaBuffer {
    fn kerr(&self, e: ep_kernels::Error) -> Error {
        kernel_err(e, self.timeout)
    }

    /// Fresh dispatch across nodes: barrier and counts, send, poll, plan and receive.
    pub(super) fn internode_dispatch_fresh(
        &self,
        inn: &InternodeCuda,
        f: FreshDispatch<'_>,
        num_topk: usize,
    ) -> Result<DispatchParts> {
        let args = &f;
        check_payload_dtype(args.x)?;
        let _op = lock(&self.op);
        inn.buf.check_error().map_err(|e| self.kerr(e))?;
        let lay = inn.buf.layout();
        let (r, t, h, k) = (self.num_ranks, f.num_tokens, f.hidden, num_topk);
        let (nodes, p, m) = (lay.num_nodes(), lay.gpus_per_node, lay.max_tokens);
        let l = f.num_experts / r;
        self.begin(args.previous_event)?;
        let comm = &self.comm;
        let (ntpr, ntpn, ntpe, itir) = match &args.layout {
            Some(lay) => (
                lay.num_tokens_per_rank.clone(),
                lay.num_tokens_per_node.cloned().ok_or_else(|| {
                    Error::invalid(
                        "layout",
                        "a layout without num_tokens_per_node",
                        "a buffer across nodes needs a layout of its own topology",
                    )
                })?,
                lay.num_tokens_per_expert.clone(),
                lay.is_token_in_rank.clone(),
            ),
            None => {
                let idx = args.topk_idx.ok_or_else(|| {
                    Error::invalid("topk_idx", "None", "needed to compute the layout")
                })?;
                self.device_layout(comm, idx, t, k, &f.placement)?
            }
        };
        let mut rpm = alloc::<i32>(comm, r * r)?;
        let mut block_count = alloc::<i32>(comm, p * nodes)?;
        let mut nsi = alloc::<i32>(comm, t * nodes)?;
        let mut send_head = alloc::<i32>(comm, t * r)?;
        let zero_w = zero_weights(comm, args.topk_weights, t, k)?;
        let seq = {
            let ntpr_d = DeviceTensor::new("layout.num_tokens_per_rank", &ntpr)?;
            let ntpn_d = DeviceTensor::new("layout.num_tokens_per_node", &ntpn)?;
            let ntpe_d = DeviceTensor::new("layout.num_tokens_per_expert", &ntpe)?;
            let itir_d = DeviceTensor::new("layout.is_token_in_rank", &itir)?;
            let seq = kn::notify_cuda(
                comm,
                &inn.buf,
                Some(kn::NotifyCounts {
                    num_tokens_per_rank: ntpr_d.view::<i32>()?,
                    num_tokens_per_node: ntpn_d.view::<i32>()?,
                    num_tokens_per_expert: ntpe_d.view::<i32>()?,
                    is_token_in_rank: itir_d.view::<u8>()?,
                    num_tokens: t,
                    num_experts: f.num_experts,
                    expert_alignment: args.expert_alignment,
                    rank_prefix_matrix: rpm.slice_mut(0..r * r),
                    block_count: block_count.slice_mut(0..p * nodes),
                    node_send_index: nsi.slice_mut(0..t * nodes),
                    send_head: send_head.slice_mut(0..t * r),
                }),
            )
            .map_err(|e| self.kerr(e))?;
            let (x_d, xs_d) = x_tensors(args.x, args.x_scales)?;
            let topk_d = TopkTensors::new(args.topk_idx, args.topk_weights, k)?;
            let topk = topk_d.views(zero_w.as_ref(), t, k)?;
            kn::dispatch_send_cuda(
                comm,
                &inn.buf,
                seq,
                kn::InternodeSendArgs {
                    x: payload(&x_d, xs_d.as_ref(), f.fp8)?,
                    num_topk: if topk.is_some() { k } else { 0 },
                    topk,
                    node_send_index: nsi.slice(0..t * nodes),
                    is_token_in_rank: itir_d.view::<u8>()?,
                    num_tokens: t,
                    hidden: h,
                },
            )
            .map_err(|e| self.kerr(e))?;
            seq
        };
        // The one host read of the op: the receive counts.
        let counts = inn
            .buf
            .recv_counts(l, self.timeout)
            .map_err(|e| self.kerr(e))?;
        let n = counts.num_recv_tokens;
        tracing::trace!(rank = self.rank, recv = n, "internode notify done");
        let with_topk = k > 0 && args.topk_idx.is_some();
        let mut recv_src_idx = alloc::<i32>(comm, n)?;
        let mut recv_idx = alloc::<i64>(comm, n * k)?;
        let mut recv_w = alloc::<f32>(comm, n * k)?;
        let mut dest = alloc_uninit::<i32>(comm, p * nodes * m)?;
        let mut fwd_mask = alloc::<u8>(comm, nodes * m)?;
        let mut origin = alloc_uninit::<i32>(comm, n)?;
        let mut recv_rows = RecvRows::default();
        kn::dispatch_recv_cuda(
            comm,
            &inn.buf,
            seq,
            kn::DispatchPlan::Fresh {
                block_count: block_count.slice(0..p * nodes),
                rank_prefix_matrix: rpm.slice(0..r * r),
                dest: dest.slice_mut(0..p * nodes * m),
                fwd_mask: fwd_mask.slice_mut(0..nodes * m),
                origin: origin.slice_mut(0..n),
            },
            kn::InternodeRecvArgs {
                recv_x: recv_rows.alloc(comm, f.fp8, n, h)?,
                recv_src_idx: Some(recv_src_idx.slice_mut(0..n)),
                recv_topk: if with_topk {
                    Some(ki::RecvTopK {
                        idx: recv_idx.slice_mut(0..n * k),
                        weights: recv_w.slice_mut(0..n * k),
                    })
                } else {
                    None
                },
                num_topk: if with_topk { k } else { 0 },
                num_recv_tokens: n,
                hidden: h,
                num_experts: if with_topk { f.num_experts } else { 0 },
            },
        )
        .map_err(|e| self.kerr(e))?;
        let event = self.finish(args.async_finish)?;
        let dev = &self.dev;
        let (recv_x, recv_x_scales) = recv_rows.wrap(n, h, dev);
        let (recv_topk_idx, recv_topk_weights) =
            wrap_recv_topk(recv_idx, recv_w, with_topk, (n, k), dev);
        let recv_src_idx = wrap(recv_src_idx, n, dev);
        // One channel: the channel prefix is the per-destination count.
        let cpm = ntpr.reshape((r, 1))?;
        let handle = cuda_record(
            (t, n),
            HandleTensors {
                rank_prefix_matrix: wrap(rpm, (r, r), dev),
                channel_prefix_matrix: cpm,
                recv_src_idx,
                is_token_in_rank: itir,
                send_head: wrap(send_head, (t, r), dev),
            },
            CudaHandleData::Internode(InternodeHandle {
                node_send_index: wrap(nsi, (t, nodes), dev),
                block_count: wrap(block_count, (p, nodes), dev),
                dest: wrap(dest, (p, nodes, m), dev),
                fwd_mask: wrap(fwd_mask, (nodes, m), dev),
                origin: wrap(origin, n, dev),
            }),
        );
        Ok(DispatchParts {
            recv_x,
            recv_x_scales,
            recv_topk_idx,
            recv_topk_weights,
            num_recv_tokens_per_expert: counts.per_expert,
            handle,
            event,
        })
    }

    /// Cached dispatch across nodes: barrier, send along the handle's routing, receive with
    /// its plan.
    pub(super) fn internode_dispatch_cached(
        &self,
        inn: &InternodeCuda,
        args: &CachedDispatch<'_>,
        ih: &InternodeHandle,
    ) -> Result<CachedParts> {
        check_payload_dtype(args.x)?;
        let (hi, hidden, fp8) = (args.handle, args.hidden, args.fp8);
        let _op = lock(&self.op);
        inn.buf.check_error().map_err(|e| self.kerr(e))?;
        let lay = inn.buf.layout();
        let (t, n, h) = (hi.num_tokens, hi.num_recv_tokens, hidden);
        let (nodes, p, m) = (lay.num_nodes(), lay.gpus_per_node, lay.max_tokens);
        self.begin(args.previous_event)?;
        let comm = &self.comm;
        let mut recv_rows = RecvRows::default();
        {
            let seq = kn::notify_cuda(comm, &inn.buf, None).map_err(|e| self.kerr(e))?;
            let (x_d, xs_d) = x_tensors(args.x, args.x_scales)?;
            let nsi = DeviceTensor::new("handle.node_send_index", &ih.node_send_index)?;
            let itir = DeviceTensor::new("handle.is_token_in_rank", &hi.tensors.is_token_in_rank)?;
            let bc = DeviceTensor::new("handle.block_count", &ih.block_count)?;
            let dest = DeviceTensor::new("handle.dest", &ih.dest)?;
            kn::dispatch_send_cuda(
                comm,
                &inn.buf,
                seq,
                kn::InternodeSendArgs {
                    x: payload(&x_d, xs_d.as_ref(), fp8)?,
                    topk: None,
                    num_topk: 0,
                    node_send_index: nsi.view::<i32>()?,
                    is_token_in_rank: itir.view::<u8>()?,
                    num_tokens: t,
                    hidden: h,
                },
            )
            .map_err(|e| self.kerr(e))?;
            kn::dispatch_recv_cuda(
                comm,
                &inn.buf,
                seq,
                kn::DispatchPlan::Cached {
                    block_count: bc.view::<i32>()?,
                    dest: dest.view::<i32>()?,
                },
                kn::InternodeRecvArgs {
                    recv_x: recv_rows.alloc(comm, fp8, n, h)?,
                    recv_src_idx: None,
                    recv_topk: None,
                    num_topk: 0,
                    num_recv_tokens: n,
                    hidden: h,
                    num_experts: 0,
                },
            )
            .map_err(|e| self.kerr(e))?;
            debug_assert_eq!(ih.dest.elem_count(), p * nodes * m);
        }
        let event = self.finish(args.async_finish)?;
        let (recv_x, recv_x_scales) = recv_rows.wrap(n, h, &self.dev);
        Ok(CachedParts {
            recv_x,
            recv_x_scales,
            event,
        })
    }

    /// Combine across nodes along `args.handle`.
    pub(super) fn internode_combine(
        &self,
        inn: &InternodeCuda,
        args: &CombineInput<'_>,
        ih: &InternodeHandle,
    ) -> Result<CombineParts> {
        let hi = args.handle;
        let (t, n) = (hi.num_tokens, hi.num_recv_tokens);
        let h = args.x.dims2()?.1;
        let k = match args.topk_weights {
            Some(w) => w.dims2()?.1,
            None => 0,
        };
        let _op = lock(&self.op);
        inn.buf.check_error().map_err(|e| self.kerr(e))?;
        self.begin(args.previous_event)?;
        let comm = &self.comm;
        // Every row and weight is written by the home's sum: no memset.
        let mut combined = alloc_uninit::<half::bf16>(comm, t * h)?;
        let mut combined_w = alloc_uninit::<f32>(comm, t * k)?;
        {
            let x_d = DeviceTensor::new("x", args.x)?;
            let w_d = args
                .topk_weights
                .map(|w| DeviceTensor::new("topk_weights", w))
                .transpose()?;
            let origin = DeviceTensor::new("handle.origin", &ih.origin)?;
            let bc = DeviceTensor::new("handle.block_count", &ih.block_count)?;
            let fm = DeviceTensor::new("handle.fwd_mask", &ih.fwd_mask)?;
            let dest = DeviceTensor::new("handle.dest", &ih.dest)?;
            let nsi = DeviceTensor::new("handle.node_send_index", &ih.node_send_index)?;
            let bias_d = args
                .bias
                .map(|b| DeviceTensor::new("bias", b))
                .transpose()?;
            kn::combine_cuda(
                comm,
                &inn.buf,
                kn::InternodeCombineArgs {
                    x: x_d.view::<half::bf16>()?,
                    topk_weights: w_d.as_ref().map(|w| w.view::<f32>()).transpose()?,
                    origin: origin.view::<i32>()?,
                    block_count: bc.view::<i32>()?,
                    fwd_mask: fm.view::<u8>()?,
                    dest: dest.view::<i32>()?,
                    node_send_index: nsi.view::<i32>()?,
                    bias: bias_d
                        .as_ref()
                        .map(|b| b.view::<half::bf16>())
                        .transpose()?,
                    combined_x: combined.slice_mut(0..t * h),
                    combined_topk_weights: if k > 0 {
                        Some(combined_w.slice_mut(0..t * k))
                    } else {
                        None
                    },
                    num_recv_tokens: n,
                    num_tokens: t,
                    hidden: h,
                    num_topk: k,
                },
            )
            .map_err(|e| self.kerr(e))?;
        }
        self.combine_output(combined, combined_w, (t, h, k), args.async_finish)
    }
}
