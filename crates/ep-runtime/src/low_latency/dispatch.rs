//! Low-latency dispatch.

use super::RecvHook;
use crate::backend::{Backend, LlDispatchParts, LlDispatchShape, LlHandleRecord};
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use candle_core::{DType, Tensor};
use ep_kernels::FP8_GROUP;
use std::sync::Arc;

/// The inputs of [`Buffer::low_latency_dispatch`].
#[derive(Debug, Clone)]
pub struct LowLatencyDispatchArgs<'a> {
    /// `[T, H]` tokens (bf16; f16/f32 also on the host backend), `T <= max tokens per rank`.
    pub x: &'a Tensor,
    /// `[T, K]` i64 expert ids, `-1` = none.
    pub topk_idx: &'a Tensor,
    /// `[T, K]` f32 gate weights, sent along for a per-rank combine
    /// ([`Reduction::PerRank`](crate::Reduction)); `None`: DeepEP's dispatch. Every rank must
    /// pass them or none.
    pub topk_weights: Option<&'a Tensor>,
    /// Slots per (expert, source); at most what the buffer was sized for, and >= `T`.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// Number of routed experts (a multiple of the number of ranks).
    pub num_experts: usize,
    /// Cast to fp8 e4m3 with 1x128 scales on the way (`hidden % 128 == 0`).
    pub use_fp8: bool,
    /// With `use_fp8`: power-of-two (UE8M0) scales.
    pub use_ue8m0: bool,
    /// Return before the work is done (GPU buffers).
    pub async_finish: bool,
}

impl<'a> LowLatencyDispatchArgs<'a> {
    /// bf16 dispatch of `x` routed by `topk_idx`.
    pub fn new(
        x: &'a Tensor,
        topk_idx: &'a Tensor,
        num_max_dispatch_tokens_per_rank: usize,
        num_experts: usize,
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights: None,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            use_fp8: false,
            use_ue8m0: false,
            async_finish: false,
        }
    }

    /// Sends fp8 with per-128-channel scales (`ue8m0`: power-of-two scales).
    pub fn fp8(mut self, ue8m0: bool) -> Self {
        self.use_fp8 = true;
        self.use_ue8m0 = ue8m0;
        self
    }

    /// Sends the gate weights `[T, K]` f32 along, so that the combine can reduce per rank
    /// ([`Reduction::PerRank`](crate::Reduction)).
    pub fn weights(mut self, topk_weights: &'a Tensor) -> Self {
        self.topk_weights = Some(topk_weights);
        self
    }
}

/// What [`Buffer::low_latency_dispatch`] returns.
#[derive(Debug, Clone)]
pub struct LowLatencyDispatchOutput {
    /// `[L, R * M, H]` received tokens per local expert (bf16, or f8e4m3 with `use_fp8`);
    /// rows past `recv_count[l]` are unspecified.
    pub recv_x: Tensor,
    /// `[L, R * M, H / 128]` f32 scales with `use_fp8`.
    pub recv_x_scales: Option<Tensor>,
    /// `[L]` i32 tokens received per local expert (on the buffer's device; CUDA buffers never
    /// read it back: see [`LowLatencyDispatchOutput::recv_count_host`]).
    pub recv_count: Tensor,
    /// The record of this dispatch, for combine.
    pub handle: LowLatencyHandle,
    /// Completion of the dispatch.
    pub event: EventOverlap,
}

impl LowLatencyDispatchOutput {
    /// The output of a dispatch from a backend's parts, its handle made by `buf`.
    fn from_parts(buf: &Buffer, p: LlDispatchParts) -> Self {
        Self {
            recv_x: p.recv_x,
            recv_x_scales: p.recv_x_scales,
            recv_count: p.recv_count,
            handle: LowLatencyHandle {
                buffer_id: buf.id,
                inner: Arc::new(p.handle),
            },
            event: p.event,
        }
    }

    /// A host copy of `recv_count` (for CUDA buffers a device-to-host read that waits for the
    /// dispatch: keep it off the hot path).
    pub fn recv_count_host(&self) -> Result<Vec<usize>> {
        let counts = self.recv_count.to_vec1::<i32>()?;
        Ok(counts.iter().map(|&c| c.max(0) as usize).collect())
    }
}

/// The record of a low-latency dispatch.
#[derive(Debug, Clone)]
pub struct LowLatencyHandle {
    /// The buffer that made it.
    pub(crate) buffer_id: u64,
    pub(crate) inner: Arc<LlHandleRecord>,
}

impl LowLatencyHandle {
    /// `[L, R * M]` i32: source token index of each received row (`-1` past the count).
    pub fn src_info(&self) -> &Tensor {
        &self.inner.src_info
    }

    /// `[L, R]` i64: `offset << 32 | count` of each source's rows in `recv_x[l]`, on the
    /// buffer's device. For CUDA buffers this reads the kernel's ranges back to the host (it
    /// waits for the dispatch): an inspection call, not for the hot path.
    pub fn layout_range(&self) -> Result<Tensor> {
        if let Some(t) = &self.inner.layout_range {
            return Ok(t.clone());
        }
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.inner.cuda {
            return c.layout_range(self.inner.src_info.device());
        }
        Err(Error::invalid(
            "handle",
            "a handle without ranges",
            "made by neither backend",
        ))
    }

    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }
}

impl Buffer {
    pub(crate) fn check_low_latency_sizing(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
    ) -> Result<()> {
        let Some(ll) = self.config.low_latency else {
            return Err(Error::invalid(
                "low_latency",
                "None",
                "build the buffer with BufferConfig::with_low_latency(..) to use low-latency ops",
            ));
        };
        if max_tokens == 0 || max_tokens > ll.max_tokens_per_rank {
            return Err(Error::invalid(
                "num_max_dispatch_tokens_per_rank",
                max_tokens,
                format!(
                    "must be in [1, {}] (the buffer's low-latency sizing)",
                    ll.max_tokens_per_rank
                ),
            ));
        }
        if hidden > ll.hidden {
            return Err(Error::invalid(
                "hidden",
                hidden,
                format!("must be <= {} (the buffer's low-latency sizing)", ll.hidden),
            ));
        }
        if num_experts > ll.num_experts {
            return Err(Error::invalid(
                "num_experts",
                num_experts,
                format!(
                    "must be <= {} (the buffer's low-latency sizing)",
                    ll.num_experts
                ),
            ));
        }
        Ok(())
    }

    /// Low-latency dispatch: sends, waits for every active peer, and returns the packed
    /// per-expert tokens. See [`crate::low_latency`] for the layout and the masking rules.
    pub fn low_latency_dispatch(
        &self,
        args: &LowLatencyDispatchArgs<'_>,
    ) -> Result<LowLatencyDispatchOutput> {
        self.low_latency_dispatch_send(args)?.recv()
    }

    /// The send phase of [`Buffer::low_latency_dispatch`]; the returned hook receives.
    pub fn low_latency_dispatch_send<'b>(
        &'b self,
        args: &LowLatencyDispatchArgs<'_>,
    ) -> Result<RecvHook<'b, LowLatencyDispatchOutput>> {
        let shape = self.check_ll_dispatch(args)?;
        match &self.backend {
            Backend::Host => {
                let pending =
                    self.host_ll_dispatch_send(args.x, args.topk_idx, args.topk_weights, shape)?;
                Ok(RecvHook {
                    finish: Box::new(move || {
                        let parts = self.host_ll_dispatch_recv(pending)?;
                        Ok(LowLatencyDispatchOutput::from_parts(self, parts))
                    }),
                })
            }
            // CUDA buffers send from the device and never read the routing back: no host plan.
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                check_dtype("topk_idx", args.topk_idx, &[DType::I64], "i64")?;
                let ll = c.low_latency();
                let pending = ll.dispatch_send(
                    self,
                    args.x,
                    args.topk_idx,
                    args.topk_weights,
                    shape.num_topk,
                    args.use_fp8,
                    args.use_ue8m0,
                    args.async_finish,
                    crate::cuda::LlHostPlan {
                        placement: shape.placement,
                        max_tokens: shape.max_tokens,
                        hidden: shape.hidden,
                    },
                )?;
                Ok(RecvHook {
                    finish: Box::new(move || {
                        let d = ll.dispatch_recv(self, pending)?;
                        let parts = LlDispatchParts {
                            recv_x: d.recv_x,
                            recv_x_scales: d.recv_x_scales,
                            recv_count: d.recv_count,
                            handle: LlHandleRecord::device_only(shape, d.src_info, d.data),
                            event: d.event,
                        };
                        Ok(LowLatencyDispatchOutput::from_parts(self, parts))
                    }),
                })
            }
        }
    }

    /// The argument checks of a low-latency dispatch, shared by both backends.
    fn check_ll_dispatch(&self, args: &LowLatencyDispatchArgs<'_>) -> Result<LlDispatchShape> {
        let x = args.x;
        self.check_device("x", x)?;
        check_shape("x", x, &[None, None])?;
        let float = [DType::BF16, DType::F16, DType::F32];
        check_dtype("x", x, &float, "bf16, f16 or f32")?;
        let (t, h) = x.dims2()?;
        let m = args.num_max_dispatch_tokens_per_rank;
        let r = self.topology.num_ranks;
        if args.num_experts == 0 || args.num_experts % r != 0 {
            return Err(Error::invalid(
                "num_experts",
                args.num_experts,
                format!("must be a positive multiple of num_ranks = {r}"),
            ));
        }
        self.check_low_latency_sizing(m, h, args.num_experts)?;
        if t > m {
            return Err(Error::invalid(
                "x",
                format!("{t} tokens"),
                format!("at most num_max_dispatch_tokens_per_rank = {m} tokens per rank"),
            ));
        }
        if args.use_fp8 && h % FP8_GROUP != 0 {
            return Err(Error::invalid(
                "hidden",
                h,
                format!("fp8 needs a multiple of {FP8_GROUP}"),
            ));
        }
        if args.use_ue8m0 && !args.use_fp8 {
            return Err(Error::invalid(
                "use_ue8m0",
                true,
                "only meaningful with use_fp8",
            ));
        }
        self.check_device("topk_idx", args.topk_idx)?;
        check_shape("topk_idx", args.topk_idx, &[Some(t), None])?;
        let k = args.topk_idx.dims2()?.1;
        if let Some(w) = args.topk_weights {
            self.check_device("topk_weights", w)?;
            check_shape("topk_weights", w, &[Some(t), Some(k)])?;
            check_dtype("topk_weights", w, &[DType::F32], "f32")?;
        }
        Ok(LlDispatchShape {
            placement: self.placement(args.num_experts)?,
            num_tokens: t,
            num_topk: k,
            hidden: h,
            max_tokens: m,
            fp8: args.use_fp8,
            ue8m0: args.use_ue8m0,
            carries_weights: args.topk_weights.is_some(),
        })
    }
}
