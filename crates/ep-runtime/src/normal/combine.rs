//! Normal-mode combine.

use super::handle::Handle;
use crate::backend::{Backend, CombineInput};
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::error::Result;
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};

/// The inputs of [`Buffer::combine`].
#[derive(Debug, Clone)]
pub struct CombineArgs<'a> {
    /// `[N, H]` one row per received token (already reduced over this rank's experts),
    /// in the order of the dispatch's `recv_x`. bf16 (f16 and f32 on the host backend).
    pub x: &'a Tensor,
    /// The handle of the dispatch being reversed.
    pub handle: &'a Handle,
    /// `[N, K]` f32 weights to sum back as well (e.g. the dispatch's `recv_topk_weights`).
    pub topk_weights: Option<&'a Tensor>,
    /// `[T, H]` in `x`'s dtype, added to every combined row (DeepEP's `bias`): each token's
    /// f32 sum starts from its bias row, so a layer's shared experts' output joins the routed
    /// sum without a separate add (and with one rounding instead of two).
    pub bias: Option<&'a Tensor>,
    /// Work to wait for before starting (GPU buffers).
    pub previous_event: Option<&'a crate::event::EventOverlap>,
    /// Return before the work is done (GPU buffers).
    pub async_finish: bool,
}

impl<'a> CombineArgs<'a> {
    /// Combine of `x` along `handle`.
    pub fn new(x: &'a Tensor, handle: &'a Handle) -> Self {
        Self {
            x,
            handle,
            topk_weights: None,
            bias: None,
            previous_event: None,
            async_finish: false,
        }
    }

    /// Also sums these `[N, K]` weights back to the home ranks.
    pub fn topk_weights(mut self, w: &'a Tensor) -> Self {
        self.topk_weights = Some(w);
        self
    }

    /// Adds this `[T, H]` tensor (in `x`'s dtype) to every combined row: the sums start from
    /// it.
    pub fn bias(mut self, bias: &'a Tensor) -> Self {
        self.bias = Some(bias);
        self
    }

    /// Waits for `event` before starting.
    pub fn previous_event(mut self, event: &'a EventOverlap) -> Self {
        self.previous_event = Some(event);
        self
    }

    /// Returns before completion.
    pub fn async_finish(mut self, async_finish: bool) -> Self {
        self.async_finish = async_finish;
        self
    }
}

/// What [`Buffer::combine`] returns.
#[derive(Debug, Clone)]
pub struct CombineOutput {
    /// `[T, H]`: for every token, the f32 sum of its bias row (if any) and, in rank order, the
    /// rows the ranks holding it sent back, in `x`'s dtype. Tokens sent nowhere are zero (or
    /// their bias).
    pub combined_x: Tensor,
    /// `[T, K]` f32 sums of the weights, when `topk_weights` was given.
    pub combined_topk_weights: Option<Tensor>,
    /// Completion of the combine.
    pub event: EventOverlap,
}

impl Buffer {
    /// Normal-mode combine: sends each received token's row back to its home rank, which sums
    /// the rows of every rank holding that token (in rank order, in f32, starting from the
    /// token's `bias` row when one is given).
    pub fn combine(&self, args: &CombineArgs<'_>) -> Result<CombineOutput> {
        let h = args.handle;
        self.check_handle(h)?;
        let hi = &h.inner;
        self.check_device("x", args.x)?;
        check_shape("x", args.x, &[Some(hi.num_recv_tokens), None])?;
        check_dtype(
            "x",
            args.x,
            &[DType::BF16, DType::F16, DType::F32],
            "bf16, f16 or f32",
        )?;
        let hidden = args.x.dims2()?.1;
        if let Some(b) = args.bias {
            self.check_device("bias", b)?;
            check_shape("bias", b, &[Some(hi.num_tokens), Some(hidden)])?;
            if b.dtype() != args.x.dtype() {
                return Err(crate::error::Error::DType {
                    arg: "bias",
                    expected: "x's dtype",
                    got: b.dtype(),
                });
            }
        }
        let k = match args.topk_weights {
            Some(w) => {
                self.check_device("topk_weights", w)?;
                check_shape("topk_weights", w, &[Some(hi.num_recv_tokens), None])?;
                check_dtype("topk_weights", w, &[DType::F32], "f32")?;
                Some(w.dims2()?.1)
            }
            None => None,
        };
        let input = CombineInput {
            x: args.x,
            topk_weights: args.topk_weights,
            bias: args.bias,
            previous_event: args.previous_event,
            async_finish: args.async_finish,
            hidden,
            num_topk: k,
            handle: hi,
        };
        let parts = match &self.backend {
            Backend::Host => self.host_combine(input)?,
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                self.check_none_masked_cuda("combine")?;
                c.combine(input)?
            }
        };
        Ok(CombineOutput {
            combined_x: parts.combined_x,
            combined_topk_weights: parts.combined_topk_weights,
            event: parts.event,
        })
    }
}
