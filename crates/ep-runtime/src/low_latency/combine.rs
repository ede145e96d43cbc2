//! Low-latency combine.

use super::{LowLatencyHandle, RecvHook};
use crate::backend::Backend;
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::host::low_latency::LlCombineInput;
use candle_core::{DType, Tensor};
use ep_kernels::low_latency::Reduction;

/// The inputs of [`Buffer::low_latency_combine`].
#[derive(Debug, Clone)]
pub struct LowLatencyCombineArgs<'a> {
    /// `[L, R * M, H]` expert outputs, row for row the dispatch's `recv_x` (bf16; f16/f32
    /// also on the host backend).
    pub x: &'a Tensor,
    /// `[T, K]` i64: the routing given to the dispatch.
    pub topk_idx: &'a Tensor,
    /// `[T, K]` f32 gate weights (read per expert; per rank the dispatch's count).
    pub topk_weights: &'a Tensor,
    /// The dispatch's handle.
    pub handle: &'a LowLatencyHandle,
    /// How the expert outputs are reduced: DeepEP's per-expert rows (the default), or one
    /// partial sum per (token, rank), which needs a dispatch that carried the weights
    /// ([`LowLatencyDispatchArgs::weights`](crate::LowLatencyDispatchArgs::weights)). Every rank
    /// must use the same.
    pub reduction: Reduction,
    /// Write the result into this `[T, H]` tensor (same dtype as `x`) instead of a new one.
    pub out: Option<&'a Tensor>,
    /// Return before the work is done (GPU buffers).
    pub async_finish: bool,
}

impl<'a> LowLatencyCombineArgs<'a> {
    /// Combine of `x` for the tokens routed by `topk_idx` / `topk_weights`.
    pub fn new(
        x: &'a Tensor,
        topk_idx: &'a Tensor,
        topk_weights: &'a Tensor,
        handle: &'a LowLatencyHandle,
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights,
            handle,
            reduction: Reduction::PerExpert,
            out: None,
            async_finish: false,
        }
    }

    /// Reduces as `reduction` says.
    pub fn reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// Writes into `out`.
    pub fn out(mut self, out: &'a Tensor) -> Self {
        self.out = Some(out);
        self
    }
}

/// What [`Buffer::low_latency_combine`] returns.
#[derive(Debug, Clone)]
pub struct LowLatencyCombineOutput {
    /// `[T, H]`: `sum_k w_k * y_k` in f32, in `x`'s dtype (the `out` tensor if one was given).
    pub combined_x: Tensor,
    /// Completion of the combine.
    pub event: EventOverlap,
}

impl Buffer {
    /// Low-latency combine: every expert output row goes back to its token's home rank,
    /// which computes the weighted sum. Masked ranks contribute zero.
    pub fn low_latency_combine(
        &self,
        args: &LowLatencyCombineArgs<'_>,
    ) -> Result<LowLatencyCombineOutput> {
        self.low_latency_combine_send(args)?.recv()
    }

    /// The send phase of [`Buffer::low_latency_combine`]; the returned hook receives.
    pub fn low_latency_combine_send<'b>(
        &'b self,
        args: &LowLatencyCombineArgs<'_>,
    ) -> Result<RecvHook<'b, LowLatencyCombineOutput>> {
        if args.handle.buffer_id != self.id {
            return Err(Error::HandleMismatch(format!(
                "the low-latency handle was made by another buffer (id {}, this buffer is {})",
                args.handle.buffer_id, self.id
            )));
        }
        let h = &args.handle.inner;
        let r = self.topology.num_ranks;
        let l = h.placement.experts_per_rank();
        let (t, k, m, hid) = (h.num_tokens, h.num_topk, h.max_tokens, h.hidden);
        self.check_device("x", args.x)?;
        check_shape("x", args.x, &[Some(l), Some(r * m), Some(hid)])?;
        check_dtype(
            "x",
            args.x,
            &[DType::BF16, DType::F16, DType::F32],
            "bf16, f16 or f32",
        )?;
        self.check_device("topk_idx", args.topk_idx)?;
        check_shape("topk_idx", args.topk_idx, &[Some(t), Some(k)])?;
        check_dtype("topk_idx", args.topk_idx, &[DType::I64], "i64")?;
        self.check_device("topk_weights", args.topk_weights)?;
        check_shape("topk_weights", args.topk_weights, &[Some(t), Some(k)])?;
        check_dtype("topk_weights", args.topk_weights, &[DType::F32], "f32")?;
        if let Some(o) = args.out {
            self.check_device("out", o)?;
            check_shape("out", o, &[Some(t), Some(hid)])?;
            check_dtype("out", o, &[args.x.dtype()], "the dtype of x")?;
        }
        if args.reduction == Reduction::PerRank && !h.carries_weights {
            return Err(Error::HandleMismatch(
                "a per-rank combine needs a dispatch that carried topk_weights \
                 (LowLatencyDispatchArgs::weights)"
                    .into(),
            ));
        }
        match &self.backend {
            Backend::Host => {
                let pending = self.host_ll_combine_send(LlCombineInput {
                    x: args.x,
                    topk_idx: args.topk_idx,
                    topk_weights: args.topk_weights,
                    handle: &args.handle.inner,
                    reduction: args.reduction,
                    out: args.out,
                })?;
                Ok(RecvHook {
                    finish: Box::new(move || {
                        let c = self.host_ll_combine_recv(pending)?;
                        Ok(LowLatencyCombineOutput {
                            combined_x: c.combined_x,
                            event: c.event,
                        })
                    }),
                })
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                let ll = c.low_latency();
                let dims = crate::cuda::LlCombineDims {
                    num_tokens: t,
                    num_topk: k,
                    hidden: hid,
                    max_tokens: m,
                    num_experts: h.placement.num_experts,
                };
                let pending = ll.combine_send(
                    self,
                    args.x,
                    args.topk_idx,
                    args.topk_weights,
                    h.cuda.as_ref(),
                    dims,
                    args.reduction,
                    args.out,
                    args.async_finish,
                )?;
                Ok(RecvHook {
                    finish: Box::new(move || {
                        let c = ll.combine_recv(self, pending)?;
                        Ok(LowLatencyCombineOutput {
                            combined_x: c.combined_x,
                            event: c.event,
                        })
                    }),
                })
            }
        }
    }
}
