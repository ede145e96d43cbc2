//! Normal-mode dispatch.

use super::handle::Handle;
use crate::backend::{Backend, CachedDispatch, CachedParts, DispatchParts, FreshDispatch};
use crate::buffer::{check_dtype, check_shape, Buffer};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::layout::DispatchLayout;
use candle_core::{DType, Tensor};
use ep_kernels::FP8_GROUP;

/// The inputs of [`Buffer::dispatch`], built with [`DispatchArgs::new`] and its setters.
#[derive(Debug, Clone)]
pub struct DispatchArgs<'a> {
    /// `[T, H]` tokens: bf16 (f16 and f32 on the host backend), or f8e4m3 with `x_scales`.
    pub x: &'a Tensor,
    /// `[T, H / 128]` f32 scales when `x` is fp8.
    pub x_scales: Option<&'a Tensor>,
    /// `[T, K]` i64 expert ids, `-1` = none. Sent along rewritten to the receiver's local ids.
    pub topk_idx: Option<&'a Tensor>,
    /// `[T, K]` f32 gate weights, sent along (zeroed where the expert is elsewhere).
    pub topk_weights: Option<&'a Tensor>,
    /// The layout from [`Buffer::get_dispatch_layout`]; computed here from `topk_idx` and
    /// `num_experts` when absent.
    pub layout: Option<&'a DispatchLayout>,
    /// Number of routed experts (needed when `layout` is absent).
    pub num_experts: Option<usize>,
    /// Cached mode: the handle of an earlier dispatch with the same routing.
    pub handle: Option<&'a Handle>,
    /// Round each local expert's receive count up to a multiple of this (>= 1).
    pub expert_alignment: usize,
    /// Work to wait for before starting (GPU buffers).
    pub previous_event: Option<&'a EventOverlap>,
    /// Return before the work is done; wait on the output's event (GPU buffers).
    pub async_finish: bool,
    /// Worst-case outputs (0 = exact): see [`DispatchArgs::num_worst_tokens`].
    pub num_worst_tokens: usize,
}

impl<'a> DispatchArgs<'a> {
    /// Dispatch of `x` with nothing else set.
    pub fn new(x: &'a Tensor) -> Self {
        Self {
            x,
            x_scales: None,
            topk_idx: None,
            topk_weights: None,
            layout: None,
            num_experts: None,
            handle: None,
            expert_alignment: 1,
            previous_event: None,
            async_finish: false,
            num_worst_tokens: 0,
        }
    }

    /// Sets fp8 scales (`x` must be f8e4m3).
    pub fn x_scales(mut self, scales: &'a Tensor) -> Self {
        self.x_scales = Some(scales);
        self
    }

    /// Sets the routing sent along with the tokens.
    pub fn topk(mut self, topk_idx: &'a Tensor, topk_weights: &'a Tensor) -> Self {
        self.topk_idx = Some(topk_idx);
        self.topk_weights = Some(topk_weights);
        self
    }

    /// Sets a precomputed layout.
    pub fn layout(mut self, layout: &'a DispatchLayout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// Sets the number of routed experts.
    pub fn num_experts(mut self, num_experts: usize) -> Self {
        self.num_experts = Some(num_experts);
        self
    }

    /// Cached mode: reuse the routing of `handle`.
    pub fn cached(mut self, handle: &'a Handle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Sets the per-expert receive-count alignment.
    pub fn expert_alignment(mut self, alignment: usize) -> Self {
        self.expert_alignment = alignment;
        self
    }

    /// Waits for `event` before starting.
    pub fn previous_event(mut self, event: &'a EventOverlap) -> Self {
        self.previous_event = Some(event);
        self
    }

    /// Returns before completion (see [`EventOverlap`]).
    pub fn async_finish(mut self, async_finish: bool) -> Self {
        self.async_finish = async_finish;
        self
    }

    /// Worst-case outputs, as DeepEP's `num_worst_tokens`: the received tensors get
    /// `num_worst_tokens` rows whatever the routing, so a fresh dispatch on a CUDA buffer
    /// never waits for the received count on the host (its notify and transfer are queued back
    /// to back, and the op can be captured in a CUDA graph). Give the same value on every rank,
    /// at least what any rank receives (at most `num_ranks` x the most tokens a rank sends).
    ///
    /// The rows past this rank's count have source `-1`, routing `-1` and weight 0; their
    /// payload is unspecified (zeros on the host backend). The count per local expert is not
    /// returned (`num_recv_tokens_per_expert` is empty); the handle's
    /// [`rank_prefix_matrix`](Handle::rank_prefix_matrix) holds the exact counts on the
    /// device. When a rank would receive more, no rank moves anything and the dispatch (on
    /// CUDA buffers the next op, as for a device timeout) fails with
    /// [`Error::RecvCapacity`]. Combine takes all `num_worst_tokens` rows (only the received
    /// ones are read); cached dispatches along the handle keep the worst-case shape. One node
    /// only (SM rings; the copy-engine path sizes its copies on the host).
    pub fn num_worst_tokens(mut self, num_worst_tokens: usize) -> Self {
        self.num_worst_tokens = num_worst_tokens;
        self
    }
}

/// What [`Buffer::dispatch`] returns: exactly-sized received tensors and the handle.
#[derive(Debug, Clone)]
pub struct DispatchOutput {
    /// `[N, H]` received tokens, ordered by source rank, then token order (`N` =
    /// [`DispatchArgs::num_worst_tokens`] rows when given).
    pub recv_x: Tensor,
    /// `[N, H / 128]` f32 scales, when `x` was fp8.
    pub recv_x_scales: Option<Tensor>,
    /// `[N, K]` i64 local expert ids (`-1`: expert not on this rank), when routing was sent.
    pub recv_topk_idx: Option<Tensor>,
    /// `[N, K]` f32 weights (0 where the id is `-1`), when routing was sent.
    pub recv_topk_weights: Option<Tensor>,
    /// `[N]` i32 index of each received token on its source rank.
    pub recv_src_idx: Tensor,
    /// Tokens each local expert receives, rounded up to `expert_alignment` (empty in cached
    /// mode, where the counts are not exchanged, and with worst-case outputs, where the host
    /// does not read them).
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// The record of this dispatch, for combine and cached dispatch.
    pub handle: Handle,
    /// Completion of the dispatch.
    pub event: EventOverlap,
}

impl DispatchOutput {
    /// The output of a fresh dispatch from a backend's parts, its handle made by `buf`.
    fn fresh(buf: &Buffer, p: DispatchParts) -> Self {
        let handle = Handle::new(buf.id, p.handle);
        Self {
            recv_x: p.recv_x,
            recv_x_scales: p.recv_x_scales,
            recv_topk_idx: p.recv_topk_idx,
            recv_topk_weights: p.recv_topk_weights,
            recv_src_idx: handle.inner.tensors.recv_src_idx.clone(),
            num_recv_tokens_per_expert: p.num_recv_tokens_per_expert,
            handle,
            event: p.event,
        }
    }

    /// The output of a cached dispatch along `handle`: the received rows (and scales), the
    /// handle's source indices, no routing and no counts.
    fn cached(p: CachedParts, handle: &Handle) -> Self {
        Self {
            recv_x: p.recv_x,
            recv_x_scales: p.recv_x_scales,
            recv_topk_idx: None,
            recv_topk_weights: None,
            recv_src_idx: handle.inner.tensors.recv_src_idx.clone(),
            num_recv_tokens_per_expert: Vec::new(),
            handle: handle.clone(),
            event: p.event,
        }
    }
}

/// What [`check_x`] learnt about `x`.
struct CheckedX {
    num_tokens: usize,
    hidden: usize,
    fp8: bool,
}

fn check_x(buf: &Buffer, x: &Tensor, x_scales: Option<&Tensor>) -> Result<CheckedX> {
    buf.check_device("x", x)?;
    check_shape("x", x, &[None, None])?;
    check_dtype(
        "x",
        x,
        &[DType::BF16, DType::F16, DType::F32, DType::F8E4M3],
        "bf16, f16, f32 or f8e4m3",
    )?;
    let (num_tokens, hidden) = x.dims2()?;
    let fp8 = x.dtype() == DType::F8E4M3;
    match (fp8, x_scales) {
        (true, None) => {
            return Err(Error::invalid(
                "x_scales",
                "None",
                "fp8 x needs [num_tokens, hidden / 128] f32 scales",
            ))
        }
        (false, Some(_)) => {
            return Err(Error::invalid(
                "x_scales",
                "Some",
                format!("only allowed when x is f8e4m3 (x is {:?})", x.dtype()),
            ))
        }
        (true, Some(s)) => {
            if hidden % FP8_GROUP != 0 {
                return Err(Error::invalid(
                    "hidden",
                    hidden,
                    format!("fp8 needs a multiple of {FP8_GROUP}"),
                ));
            }
            buf.check_device("x_scales", s)?;
            check_shape("x_scales", s, &[Some(num_tokens), Some(hidden / FP8_GROUP)])?;
            check_dtype("x_scales", s, &[DType::F32], "f32")?;
        }
        (false, None) => {}
    }
    Ok(CheckedX {
        num_tokens,
        hidden,
        fp8,
    })
}

impl Buffer {
    /// Normal-mode dispatch (see [`crate::normal`]): every rank sends each token once to
    /// each rank holding one of its experts, and receives exactly the tokens sent to it.
    ///
    /// Without a handle, the layout counts are exchanged first; with
    /// [`DispatchArgs::cached`], the handle's routing is reused and only `x` (and its scales)
    /// move. All inputs are checked before anything is sent.
    pub fn dispatch(&self, args: &DispatchArgs<'_>) -> Result<DispatchOutput> {
        let cx = check_x(self, args.x, args.x_scales)?;
        if args.expert_alignment == 0 {
            return Err(Error::invalid("expert_alignment", 0, "must be >= 1"));
        }
        // Both backends keep the internode buffer's bound, so code that runs on CPU runs on GPUs.
        if let Some(cap) = self.normal_mode_max_tokens() {
            if cx.num_tokens > cap {
                return Err(Error::invalid(
                    "x",
                    format!("{} tokens", cx.num_tokens),
                    format!(
                        "normal mode across nodes takes at most \
                         BufferConfig::internode.max_tokens_per_rank = {cap} tokens per rank"
                    ),
                ));
            }
        }
        // The host backend waits for `previous_event` here; CUDA buffers order it on their
        // stream instead.
        if self.backend.is_host() {
            if let Some(e) = args.previous_event {
                e.wait()?;
            }
        }
        if args.num_worst_tokens > i32::MAX as usize {
            return Err(Error::invalid(
                "num_worst_tokens",
                args.num_worst_tokens,
                format!("must be at most {} (32-bit row offsets)", i32::MAX),
            ));
        }
        match args.handle {
            Some(_) if args.num_worst_tokens > 0 => Err(Error::invalid(
                "num_worst_tokens",
                args.num_worst_tokens,
                "a cached dispatch takes the handle's rows: give it only to the fresh dispatch",
            )),
            Some(h) => self.dispatch_cached(args, &cx, h),
            None => self.dispatch_fresh(args, &cx),
        }
    }

    fn dispatch_fresh(&self, args: &DispatchArgs<'_>, cx: &CheckedX) -> Result<DispatchOutput> {
        let r = self.topology.num_ranks;
        // Routing and layout.
        let num_experts = match (args.layout, args.num_experts) {
            (Some(l), Some(n)) if l.num_experts != n => {
                return Err(Error::invalid(
                    "num_experts",
                    n,
                    format!("must match the layout's {}", l.num_experts),
                ))
            }
            (Some(l), _) => l.num_experts,
            (None, Some(n)) => n,
            (None, None) => {
                return Err(Error::invalid(
                    "layout",
                    "None",
                    "give a layout from get_dispatch_layout, or topk_idx and num_experts",
                ))
            }
        };
        if num_experts == 0 || num_experts % r != 0 {
            return Err(Error::invalid(
                "num_experts",
                num_experts,
                format!("must be a positive multiple of num_ranks = {r}"),
            ));
        }
        let fresh = FreshDispatch {
            x: args.x,
            x_scales: args.x_scales,
            topk_idx: args.topk_idx,
            topk_weights: args.topk_weights,
            layout: args.layout.map(DispatchLayout::input),
            expert_alignment: args.expert_alignment,
            num_worst_tokens: args.num_worst_tokens,
            previous_event: args.previous_event,
            async_finish: args.async_finish,
            num_tokens: cx.num_tokens,
            hidden: cx.hidden,
            fp8: cx.fp8,
            num_experts,
            placement: self.placement(num_experts)?,
        };
        let parts = match &self.backend {
            // The host backend reads the routing back and checks it there.
            Backend::Host => self.host_dispatch_fresh(fresh)?,
            // CUDA buffers: shapes and dtypes only; the routing stays on the device.
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                self.check_none_masked_cuda("dispatch")?;
                let num_topk = self.check_routing_cuda(args, cx.num_tokens)?;
                c.dispatch_fresh(fresh, num_topk)?
            }
        };
        Ok(DispatchOutput::fresh(self, parts))
    }

    /// The routing checks of a fresh dispatch on a CUDA buffer (shapes and dtypes only: the
    /// routing is never read back): returns the top-k of `topk_idx` (0 when none).
    #[cfg(feature = "cuda")]
    fn check_routing_cuda(&self, args: &DispatchArgs<'_>, t: usize) -> Result<usize> {
        let num_topk = match args.topk_idx {
            Some(idx) => {
                self.check_device("topk_idx", idx)?;
                check_shape("topk_idx", idx, &[Some(t), None])?;
                check_dtype("topk_idx", idx, &[DType::I64], "i64")?;
                idx.dims2()?.1
            }
            None => 0,
        };
        match (args.topk_weights, args.topk_idx) {
            (Some(_), None) => {
                return Err(Error::invalid(
                    "topk_weights",
                    "Some",
                    "needs topk_idx as well",
                ))
            }
            (Some(w), Some(_)) => {
                self.check_device("topk_weights", w)?;
                check_shape("topk_weights", w, &[Some(t), Some(num_topk)])?;
                check_dtype("topk_weights", w, &[DType::F32], "f32")?;
            }
            _ => {}
        }
        match args.layout {
            Some(l) if l.num_tokens != t => {
                return Err(Error::invalid(
                    "layout",
                    format!("a layout of {} tokens", l.num_tokens),
                    format!("must be for x's {t} tokens"),
                ))
            }
            None if args.topk_idx.is_none() => {
                return Err(Error::invalid(
                    "topk_idx",
                    "None",
                    "needed to compute the layout when none is given",
                ))
            }
            _ => {}
        }
        Ok(num_topk)
    }

    /// Normal mode on CUDA buffers exchanges with every rank: refused while one is masked.
    #[cfg(feature = "cuda")]
    pub(crate) fn check_none_masked_cuda(&self, op: &str) -> Result<()> {
        let masked = self.masked_ranks();
        if masked.is_empty() {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "normal-mode {op} on a CUDA buffer while ranks {masked:?} are masked (its kernels \
             exchange with every rank): use the low-latency mode, or reset_active_ranks"
        )))
    }

    /// Checks that `handle` was made by this buffer.
    pub(crate) fn check_handle(&self, handle: &Handle) -> Result<()> {
        if handle.buffer_id != self.id {
            return Err(Error::HandleMismatch(format!(
                "the handle was made by another buffer (id {}, this buffer is {})",
                handle.buffer_id, self.id
            )));
        }
        Ok(())
    }

    fn dispatch_cached(
        &self,
        args: &DispatchArgs<'_>,
        cx: &CheckedX,
        h: &Handle,
    ) -> Result<DispatchOutput> {
        self.check_handle(h)?;
        if args.topk_idx.is_some() || args.topk_weights.is_some() || args.layout.is_some() {
            return Err(Error::invalid(
                "handle",
                "Some",
                "cached dispatch reuses the handle's routing: do not pass topk_idx, topk_weights or layout",
            ));
        }
        let hi = &h.inner;
        if cx.num_tokens != hi.num_tokens {
            return Err(Error::HandleMismatch(format!(
                "x has {} tokens but the handle was made for {}",
                cx.num_tokens, hi.num_tokens
            )));
        }
        let cached = CachedDispatch {
            x: args.x,
            x_scales: args.x_scales,
            previous_event: args.previous_event,
            async_finish: args.async_finish,
            hidden: cx.hidden,
            fp8: cx.fp8,
            handle: hi,
        };
        let parts = match &self.backend {
            Backend::Host => self.host_dispatch_cached(cached)?,
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                self.check_none_masked_cuda("dispatch")?;
                c.dispatch_cached(cached)?
            }
        };
        Ok(DispatchOutput::cached(parts, h))
    }
}
