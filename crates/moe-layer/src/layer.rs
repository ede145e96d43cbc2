//! [`MoeLayer`]: route -> dispatch -> grouped GEMM -> combine, plus shared experts.

use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::experts::{Experts, Mlp};
use crate::router::Router;
use crate::step::{Mode, Step};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
use ep_runtime::{
    Buffer, CombineArgs, DispatchArgs, EventOverlap, LowLatencyCombineArgs, LowLatencyDispatchArgs,
    Reduction,
};
use std::sync::Arc;

/// One routed step on `(x, topk_idx, topk_weights)`: the combined routed output and the
/// shared experts' output (when computed alongside).
type RoutedOp = fn(&MoeLayer, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Option<Tensor>)>;

/// Where the shared experts run in low-latency mode (CUDA layers with grouped GEMMs; other
/// layers always run them as their own MLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SharedPlacement {
    /// `Grouped` in the steps of at most [`ep_kernels::gemm::GEMV_ROWS_PER_PASS`] rows expected
    /// per expert (a decode token or two per rank), where an extra group costs only its weight
    /// bytes with the tile-less kernel (and ties with `Overlap` with the 64 x 128 tiles an H200
    /// gets there: 0.259 against 0.260 ms at one token) and, at one rank, there is no dispatch
    /// to hide the shared MLP behind; `Overlap` in the others. The default.
    #[default]
    Auto,
    /// As their own MLP on the compute stream while the dispatch travels. With the tiled
    /// GEMMs (more rows per expert) this measured as fast as `Grouped` or faster
    /// (`docs/benchmarks.md`, "The MoE layer").
    Overlap,
    /// As extra groups of the routed experts' grouped GEMMs (one launch reads every weight)
    /// when their inner width is a multiple of the routed experts'; else as `Overlap`. The
    /// shared MLP's gate_up is re-laid once into the grouped GEMMs' blocked layout (a copy that
    /// replaces the layer's shared MLP, whose blocks are then views; `down_proj` is copied into
    /// blocks when the shared MLP is wider than one routed expert), also under `Auto`.
    Grouped,
}

/// How a [`MoeLayer`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeLayerOptions {
    /// The default mode of [`MoeLayer::forward`].
    pub mode: Mode,
    /// Low-latency slots per rank (the `Auto` threshold, and the `num_max_dispatch_tokens_per_rank`
    /// of low-latency ops). The buffer must be sized for at least this many.
    pub low_latency_max_tokens: usize,
    /// Send tokens as fp8 e4m3 with 1x128 scales (hidden must be a multiple of 128).
    pub fp8_dispatch: bool,
    /// Per-expert receive counts of normal mode rounded up to a multiple of this (DeepEP's
    /// `expert_alignment`; default 1: the grouped GEMMs need no alignment).
    pub expert_alignment: usize,
    /// Where the shared experts run in low-latency mode.
    pub shared_placement: SharedPlacement,
    /// The grouped GEMMs' configuration in low-latency mode (CUDA); `None`: chosen from the
    /// rows a step expects per expert and the GPU's bandwidth per SM
    /// ([`ep_kernels::gemm::GemmTiles::for_masked_rows`]: the tile-less kernel and the
    /// 64 x 128 tiles trade places between an H100 and an H200 at one token).
    pub low_latency_tiles: Option<ep_kernels::gemm::GemmTiles>,
    /// How the low-latency combine reduces a token's expert outputs: per rank (the default:
    /// each expert rank sends one partial sum per token, so fewer bytes travel back; the
    /// dispatch carries the gate weights for it) or per expert (DeepEP's numbers: one row per
    /// (token, expert), summed once at home). The same bits at one rank.
    pub low_latency_reduction: Reduction,
    /// Two-batch overlap at more than one rank (SGLang's TBO): each rank splits its tokens into
    /// two micro-batches, and the second's dispatch travels while the first's experts compute,
    /// the first's combine while the second's compute (both modes; the shared experts run
    /// once, over all tokens, while the first dispatch travels). It hides transfers behind
    /// GEMMs, but each micro-batch's GEMMs read the local experts' weights again: it pays when
    /// the GEMMs are bound by their math (many rows per local expert), not by their weight
    /// reads. Every rank must use the same setting. Off by default (`docs/benchmarks.md`).
    pub two_batch_overlap: bool,
    /// Run normal-mode steps (prefill) as low-latency ops of at most `low_latency_max_tokens`
    /// tokens per rank each, one after another (every rank runs as many as the rank with the
    /// most tokens needs). Always on for a buffer without a normal mode (a CUDA buffer across
    /// nodes built without `BufferConfig::with_internode`); off by default elsewhere, where the
    /// normal mode moves large batches faster. Every rank must use the same setting.
    pub prefill_in_low_latency_chunks: bool,
}

impl Default for MoeLayerOptions {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            low_latency_max_tokens: 128,
            fp8_dispatch: false,
            expert_alignment: 1,
            shared_placement: SharedPlacement::Auto,
            low_latency_tiles: None,
            low_latency_reduction: Reduction::PerRank,
            two_batch_overlap: false,
            prefill_in_low_latency_chunks: false,
        }
    }
}

/// An expert-parallel Mixture-of-Experts layer over candle tensors.
///
/// Each rank holds the router, its `E / R` routed experts and the shared experts. `forward`
/// routes this rank's tokens, dispatches them to the ranks holding their experts, runs each
/// local expert once over the tokens it received (grouped GEMM), combines the weighted
/// outputs back on the tokens' home ranks and adds the shared experts' output. In
/// low-latency mode the shared experts run while the routed tokens travel (receive hook).
#[derive(Debug)]
pub struct MoeLayer {
    router: Router,
    experts: Experts,
    shared: Option<Mlp>,
    buffer: Arc<Buffer>,
    num_experts: usize,
    options: MoeLayerOptions,
    /// Captured decode steps of [`MoeLayer::forward_decode`].
    #[cfg(feature = "cuda")]
    decode_graphs: crate::graph::DecodeGraphs,
    /// The shared experts as extra groups of the low-latency grouped GEMMs, when placed there.
    #[cfg(feature = "cuda")]
    shared_groups: Option<crate::shared_groups::SharedGroups>,
}

impl MoeLayer {
    /// Assembles a layer from its parts; `experts` must be this rank's shard
    /// (`first_expert = rank * E / R`, `E / R` experts).
    pub fn new(
        router: Router,
        experts: Experts,
        shared: Option<Mlp>,
        buffer: Arc<Buffer>,
        options: MoeLayerOptions,
    ) -> Result<Self> {
        let topo = buffer.topology();
        let e = router.num_experts();
        if e % topo.num_ranks != 0 {
            return Err(Error::invalid(
                "n_routed_experts",
                e,
                format!(
                    "must be a multiple of the number of ranks {}",
                    topo.num_ranks
                ),
            ));
        }
        let l = e / topo.num_ranks;
        if experts.num_local() != l || experts.first_expert() != topo.rank * l {
            return Err(Error::invalid(
                "experts",
                format!(
                    "experts {}..{}",
                    experts.first_expert(),
                    experts.first_expert() + experts.num_local()
                ),
                format!(
                    "rank {} of {} must hold experts {}..{}",
                    topo.rank,
                    topo.num_ranks,
                    topo.rank * l,
                    (topo.rank + 1) * l
                ),
            ));
        }
        if options.fp8_dispatch && router.hidden_size() % ep_runtime::cast::FP8_GROUP != 0 {
            return Err(Error::invalid(
                "fp8_dispatch",
                true,
                format!(
                    "needs hidden_size ({}) to be a multiple of 128",
                    router.hidden_size()
                ),
            ));
        }
        if options.expert_alignment == 0 {
            return Err(Error::invalid("expert_alignment", 0, "must be >= 1"));
        }
        if options.mode != Mode::Normal {
            match buffer.config().low_latency {
                Some(ll) if ll.max_tokens_per_rank >= options.low_latency_max_tokens
                    && ll.hidden >= router.hidden_size()
                    && ll.num_experts >= e => {}
                other => {
                    return Err(Error::invalid(
                        "buffer",
                        format!("low-latency sizing {other:?}"),
                        format!(
                            "mode {:?} needs a buffer sized for >= {} tokens per rank, hidden >= {}, experts >= {e} \
                             (BufferConfig::with_low_latency)",
                            options.mode,
                            options.low_latency_max_tokens,
                            router.hidden_size()
                        ),
                    ))
                }
            }
        }
        #[cfg(feature = "cuda")]
        let (shared, shared_groups) = match (shared, options.shared_placement) {
            (Some(m), SharedPlacement::Grouped | SharedPlacement::Auto)
                if crate::shared_groups::SharedGroups::eligible(&m, &experts) =>
            {
                // The shared MLP in the blocked layout; its blocks are views of its weights.
                let m = m.with_layout(crate::GateUpLayout::Blocked)?;
                let groups = crate::shared_groups::SharedGroups::new(&m, &experts)?;
                (Some(m), Some(groups))
            }
            (shared, _) => (shared, None),
        };
        Ok(Self {
            router,
            experts,
            shared,
            buffer,
            num_experts: e,
            options,
            #[cfg(feature = "cuda")]
            decode_graphs: Default::default(),
            #[cfg(feature = "cuda")]
            shared_groups,
        })
    }

    /// Loads this rank's part of a layer from HF DeepSeek-V3 names under `vb` (the layer's
    /// `mlp` prefix): `gate.weight`, `gate.e_score_correction_bias`, `experts.{e}.*` for this
    /// rank's experts only, and `shared_experts.*`.
    pub fn load(
        vb: VarBuilder,
        cfg: &MoeConfig,
        buffer: Arc<Buffer>,
        options: MoeLayerOptions,
    ) -> Result<Self> {
        cfg.validate()?;
        let topo = buffer.topology();
        if cfg.n_routed_experts % topo.num_ranks != 0 {
            return Err(Error::invalid(
                "n_routed_experts",
                cfg.n_routed_experts,
                format!(
                    "must be a multiple of the number of ranks {}",
                    topo.num_ranks
                ),
            ));
        }
        let l = cfg.n_routed_experts / topo.num_ranks;
        let router = Router::load(vb.pp("gate"), cfg)?;
        let experts = Experts::load(vb.pp("experts"), cfg, topo.rank * l, l)?;
        let shared = match cfg.shared_intermediate_size() {
            Some(i) => Some(Mlp::load(vb.pp("shared_experts"), cfg.hidden_size, i)?),
            None => None,
        };
        Self::new(router, experts, shared, buffer, options)
    }

    /// The communication buffer.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buffer
    }

    /// The router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// This rank's routed experts.
    pub fn experts(&self) -> &Experts {
        &self.experts
    }

    /// The captured decode steps.
    #[cfg(feature = "cuda")]
    pub(crate) fn decode_graphs(&self) -> &crate::graph::DecodeGraphs {
        &self.decode_graphs
    }

    /// The shared experts, if any.
    pub fn shared(&self) -> Option<&Mlp> {
        self.shared.as_ref()
    }

    /// The options.
    pub fn options(&self) -> &MoeLayerOptions {
        &self.options
    }

    /// Forward in the layer's default mode. `x: [.., H]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with_mode(x, self.options.mode)
    }

    /// Forward in `mode`. Every rank must call this the same number of times with the same
    /// mode (a rank without tokens passes `[0, H]`). Where the layer needs the busiest rank's
    /// token count ([`Step`]) it learns it with one host all-gather; a model that runs many
    /// layers per step passes a [`Step`] to [`MoeLayer::forward_step`] instead.
    pub fn forward_with_mode(&self, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        Ok(self.forward_impl(x, mode, None)?)
    }

    /// Forward as part of `step` (the same on every rank): no collective beyond the
    /// dispatches and combines, however many ops the step needs. Refuses `x` with more tokens
    /// than `step.most_tokens()` before anything runs.
    pub fn forward_step(&self, x: &Tensor, step: Step) -> candle_core::Result<Tensor> {
        Ok(self.forward_impl(x, step.mode(), Some(step.most_tokens()))?)
    }

    /// The [`Step`] of `mode` when this rank brings `num_tokens` tokens: one host all-gather
    /// learns the busiest rank's count (a collective). Once per model step is enough: every
    /// layer of the step takes the same [`Step`].
    pub fn plan_step(&self, num_tokens: usize, mode: Mode) -> Result<Step> {
        Ok(Step::new(mode, self.most_tokens(num_tokens)?))
    }

    /// A low-latency step; CUDA builds replay captured graphs for single-rank CUDA layers
    /// (see the `cuda` build's docs). This build runs [`MoeLayer::forward_with_mode`] in
    /// low-latency mode.
    #[cfg(not(feature = "cuda"))]
    pub fn forward_decode(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with_mode(x, Mode::LowLatency)
    }

    /// The mode `Auto` resolves to for `num_tokens` on this rank (a collective).
    pub fn resolve_mode(&self, num_tokens: usize) -> Result<Mode> {
        Ok(self.mode_for(self.most_tokens(num_tokens)?))
    }

    /// The most tokens any rank has this step (a collective: one host all-gather).
    fn most_tokens(&self, num_tokens: usize) -> Result<usize> {
        let max = self.buffer.max_over_ranks(num_tokens as u64)?;
        Ok(usize::try_from(max).unwrap_or(usize::MAX))
    }

    /// The mode `Auto` resolves to when the busiest rank has `most` tokens.
    fn mode_for(&self, most: usize) -> Mode {
        if most <= self.options.low_latency_max_tokens {
            Mode::LowLatency
        } else {
            Mode::Normal
        }
    }

    /// `most`: the busiest rank's token count when the caller knows it (else it is asked for
    /// where needed).
    fn forward_impl(&self, x: &Tensor, mode: Mode, most: Option<usize>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let h = *dims
            .last()
            .ok_or_else(|| Error::invalid("x", "a scalar", "needs a hidden dimension"))?;
        if h != self.router.hidden_size() {
            return Err(Error::invalid(
                "x",
                format!("shape {dims:?}"),
                format!(
                    "last dimension must be hidden_size = {}",
                    self.router.hidden_size()
                ),
            ));
        }
        let x2 = x.reshape(((), h))?;
        let t = x2.dims()[0];
        if let Some(most) = most.filter(|&m| t > m) {
            return Err(Error::invalid(
                "x",
                format!("{t} tokens"),
                format!("the step's most_tokens = {most} bounds every rank's tokens"),
            ));
        }
        // `Auto` learns the busiest rank's token count (also what low-latency chunks need).
        let (mode, most) = match (mode, most) {
            (Mode::Auto, Some(most)) => (self.mode_for(most), Some(most)),
            (Mode::Auto, None) => {
                let most = self.most_tokens(t)?;
                (self.mode_for(most), Some(most))
            }
            (m, most) => (m, most),
        };
        if mode == Mode::LowLatency && t > self.options.low_latency_max_tokens {
            return Err(Error::invalid(
                "x",
                format!("{t} tokens"),
                format!(
                    "low-latency mode takes at most low_latency_max_tokens = {} tokens per rank",
                    self.options.low_latency_max_tokens
                ),
            ));
        }
        let (topk_idx, topk_weights) = if t == 0 {
            // A rank without tokens still joins the collectives, with empty routing (built
            // without zero-byte device allocations, which CUDA refuses).
            let k = self.router.top_k();
            let dev = x2.device();
            (
                crate::empty::empty((0, k), DType::I64, dev)?,
                crate::empty::empty((0, k), DType::F32, dev)?,
            )
        } else {
            let routing = self.router.forward(&x2)?;
            (routing.topk_idx, routing.topk_weights)
        };
        let (routed, shared) = match mode {
            Mode::LowLatency => self.routed_low_latency(&x2, &topk_idx, &topk_weights)?,
            _ if self.prefill_in_low_latency_chunks() => self.routed_in_chunks(
                (&x2, &topk_idx, &topk_weights),
                most,
                self.options.low_latency_max_tokens,
                Self::routed_low_latency,
            )?,
            _ => match self.buffer.normal_mode_max_tokens() {
                // Across nodes the internode buffer bounds the tokens of one normal op.
                Some(cap) => self.routed_in_chunks(
                    (&x2, &topk_idx, &topk_weights),
                    most,
                    cap,
                    Self::routed_normal,
                )?,
                None => self.routed_normal(&x2, &topk_idx, &topk_weights)?,
            },
        };
        if t == 0 {
            return Ok(crate::empty::empty(dims, x.dtype(), x.device())?);
        }
        Ok(with_shared(routed, shared, x.dtype())?.reshape(dims)?)
    }

    /// Whether normal-mode steps run as low-latency chunks (the option, or a buffer without a
    /// normal mode).
    pub fn prefill_in_low_latency_chunks(&self) -> bool {
        self.options.prefill_in_low_latency_chunks || !self.buffer.has_normal_mode()
    }

    /// A normal-mode step as ops `op` (low-latency ops, or normal ops of a buffer whose normal
    /// mode bounds the tokens per op) of at most `cap` rows per rank each (a collective: every
    /// rank runs as many ops as the rank with the most tokens needs, empty ones once its own
    /// rows are done; `most`: that count if the step already learned it); returns the routed
    /// output with the shared experts' added in.
    fn routed_in_chunks(
        &self,
        (x, idx, w): (&Tensor, &Tensor, &Tensor),
        most: Option<usize>,
        cap: usize,
        op: RoutedOp,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (t, h) = x.dims2()?;
        let k = idx.dims()[1];
        let c = cap.max(1);
        let most = match most {
            Some(m) => m,
            None => self.most_tokens(t)?,
        };
        if most <= c {
            return op(self, x, idx, w);
        }
        let dev = x.device();
        let mut outs = Vec::new();
        for i in 0..most.div_ceil(c) {
            let lo = (i * c).min(t);
            let n = c.min(t - lo);
            let (xc, ic, wc) = if n == 0 {
                (
                    crate::empty::empty((0, h), x.dtype(), dev)?,
                    crate::empty::empty((0, k), DType::I64, dev)?,
                    crate::empty::empty((0, k), DType::F32, dev)?,
                )
            } else {
                (
                    x.narrow(0, lo, n)?,
                    idx.narrow(0, lo, n)?,
                    w.narrow(0, lo, n)?,
                )
            };
            let (routed, shared) = op(self, &xc, &ic, &wc)?;
            if n > 0 {
                outs.push(with_shared(routed, shared, x.dtype())?);
            }
        }
        Ok(match outs.len() {
            0 => (x.clone(), None),
            1 => (outs.remove(0), None),
            _ => (Tensor::cat(&outs, 0)?, None),
        })
    }

    fn shared_forward(&self, x: &Tensor) -> Result<Option<Tensor>> {
        Ok(match &self.shared {
            Some(m) => Some(m.forward(x)?),
            None => None,
        })
    }

    /// Normal mode; returns the combined routed output and the shared experts' output.
    ///
    /// Stream timeline on CUDA (see `docs/design.md`): routing, layout and the fp8 cast on the
    /// compute stream, then the shared experts on the compute stream while the dispatch runs
    /// on the communication stream (it waits only for the layout's event); the host waits once,
    /// for the received-token count; the expert GEMMs wait for the dispatch's event; the combine
    /// waits for the GEMMs' event, and the compute stream for the combine.
    fn routed_normal(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if self.buffer.topology().num_ranks == 1 && !self.options.fp8_dispatch {
            return self.routed_local(x, idx, w);
        }
        if self.options.two_batch_overlap {
            return self.routed_normal_two_batches(x, idx, w);
        }
        let dev = x.device();
        // The dispatch is issued (its kernel grabs its SMs) before the shared experts are
        // queued: queued first, they measured no faster (docs/benchmarks.md).
        let send = self.prepare_dispatch(x, idx)?;
        let ready = EventOverlap::record(dev)?;
        let out = self.dispatch_normal(&send, idx, w, &ready)?;
        let shared = if x.dims()[0] == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        let y = self.experts_normal(&out, dev, x.dtype())?;
        let computed = EventOverlap::record(dev)?;
        let combined = self
            .buffer
            .combine(&CombineArgs::new(&y, &out.handle).previous_event(&computed))?;
        Ok((combined.combined_x, shared))
    }

    /// What a normal-mode dispatch of `x` routed by `idx` sends, computed on the compute
    /// stream: the layout and, with [`MoeLayerOptions::fp8_dispatch`], the fp8 rows and scales.
    fn prepare_dispatch(&self, x: &Tensor, idx: &Tensor) -> Result<SendRows> {
        let layout = self.buffer.get_dispatch_layout(idx, self.num_experts)?;
        let (x, scales) = if self.options.fp8_dispatch {
            let (q, s) = per_token_cast_to_fp8(x, false)?;
            (q, Some(s))
        } else {
            (x.clone(), None)
        };
        Ok(SendRows { layout, x, scales })
    }

    /// The normal-mode dispatch of `send` routed by `idx`, `w` on the communication stream
    /// after `ready`; returns once it is issued: the host has read the received count, the
    /// rows are not yet in.
    fn dispatch_normal(
        &self,
        send: &SendRows,
        idx: &Tensor,
        w: &Tensor,
        ready: &EventOverlap,
    ) -> Result<ep_runtime::DispatchOutput> {
        let mut args = DispatchArgs::new(&send.x)
            .topk(idx, w)
            .layout(&send.layout)
            .expert_alignment(self.options.expert_alignment)
            .previous_event(ready)
            .async_finish(true);
        if let Some(s) = &send.scales {
            args = args.x_scales(s);
        }
        Ok(self.buffer.dispatch(&args)?)
    }

    /// The routed experts over what `out` received (fp8 rows cast back to `dtype`), on the
    /// compute stream once it is in.
    fn experts_normal(
        &self,
        out: &ep_runtime::DispatchOutput,
        dev: &Device,
        dtype: DType,
    ) -> Result<Tensor> {
        out.event.compute_wait(dev)?;
        let recv_x = match &out.recv_x_scales {
            Some(s) => per_token_cast_back(&out.recv_x, s, dtype)?,
            None => out.recv_x.clone(),
        };
        let recv_idx = out.recv_topk_idx.as_ref().expect("routing was dispatched");
        let recv_w = out
            .recv_topk_weights
            .as_ref()
            .expect("routing was dispatched");
        self.experts.forward_grouped(&recv_x, recv_idx, recv_w)
    }

    /// Normal mode as two micro-batches ([`MoeLayerOptions::two_batch_overlap`]): dispatch A;
    /// the shared experts while A travels; A's experts while B's dispatch travels (its count
    /// exchange and copy are on the communication stream behind A's); A's combine while B's
    /// experts compute; B's combine. Two host reads of a received count (one per dispatch).
    fn routed_normal_two_batches(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let dev = x.device();
        let t = x.dims()[0];
        let [(xa, ia, wa), (xb, ib, wb)] = two_micro_batches(x, idx, w)?;
        let send_a = self.prepare_dispatch(&xa, &ia)?;
        let send_b = self.prepare_dispatch(&xb, &ib)?;
        let ready = EventOverlap::record(dev)?;
        let shared = if t == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        let out_a = self.dispatch_normal(&send_a, &ia, &wa, &ready)?;
        let ya = self.experts_normal(&out_a, dev, x.dtype())?;
        let computed_a = EventOverlap::record(dev)?;
        let out_b = self.dispatch_normal(&send_b, &ib, &wb, &ready)?;
        let comb_a = self.buffer.combine(
            &CombineArgs::new(&ya, &out_a.handle)
                .previous_event(&computed_a)
                .async_finish(true),
        )?;
        let yb = self.experts_normal(&out_b, dev, x.dtype())?;
        let computed_b = EventOverlap::record(dev)?;
        let comb_b = self
            .buffer
            .combine(&CombineArgs::new(&yb, &out_b.handle).previous_event(&computed_b))?;
        comb_a.event.compute_wait(dev)?;
        Ok((join_parts(comb_a.combined_x, comb_b.combined_x)?, shared))
    }

    /// Normal mode at one rank: every expert is local and there is nothing to send, so the
    /// routed experts run on this rank's tokens as they are: no layout, dispatch or combine,
    /// and no host synchronisation (the fp8 wire format keeps the buffer's path, so that its
    /// rounding is the same at any rank count). The shared MLP runs first, on the same stream.
    fn routed_local(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let shared = if x.dims()[0] == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        Ok((self.experts.forward_grouped(x, idx, w)?, shared))
    }

    /// The expert stage of a low-latency step alone, as [`MoeLayer::forward`] runs it: the
    /// routed experts over received blocks `recv_x` `[L, M, H]` with device counts
    /// `recv_count` `[L]`, and, when they run inside the grouped GEMMs
    /// ([`MoeLayer::shared_in_grouped_gemm`]), the shared experts over this rank's tokens `x`
    /// `[T, H]` (else `None`). For benchmarks and custom pipelines.
    pub fn low_latency_experts(
        &self,
        recv_x: &Tensor,
        recv_count: &Tensor,
        x: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.expert_blocks(recv_x, recv_count, x, None)
    }

    /// Whether the shared experts run inside the low-latency grouped GEMMs of a step of
    /// `tokens` tokens on this rank ([`SharedPlacement`]).
    pub fn shared_in_grouped_gemm(&self, tokens: usize) -> bool {
        #[cfg(feature = "cuda")]
        {
            tokens > 0
                && self.shared_groups.is_some()
                && match self.options.shared_placement {
                    SharedPlacement::Grouped => true,
                    SharedPlacement::Auto => {
                        self.expected_rows(tokens) <= ep_kernels::gemm::GEMV_ROWS_PER_PASS
                    }
                    SharedPlacement::Overlap => false,
                }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = tokens;
            false
        }
    }

    /// The low-latency grouped GEMMs' configuration for `expected` rows per expert on `dev`.
    fn low_latency_tiles(
        &self,
        dev: &Device,
        expected: usize,
    ) -> Result<ep_kernels::gemm::GemmTiles> {
        if let Some(tiles) = self.options.low_latency_tiles {
            return Ok(tiles);
        }
        #[cfg(feature = "cuda")]
        if dev.is_cuda() {
            return crate::grouped::masked_tiles(dev, expected);
        }
        let _ = (dev, expected);
        Ok(ep_kernels::gemm::GemmTiles::Auto)
    }

    /// Rows an expert's low-latency block can expect in a step of `tokens` tokens per rank:
    /// one from each rank (a token picks an expert at most once).
    fn expected_rows(&self, tokens: usize) -> usize {
        tokens * self.buffer.topology().num_ranks
    }

    /// The routed experts over the received blocks, and the shared experts' output: `shared`
    /// as computed already, or computed here over `x` as extra groups of the grouped GEMMs.
    fn expert_blocks(
        &self,
        recv_x: &Tensor,
        recv_count: &Tensor,
        x: &Tensor,
        shared: Option<Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let expected = self.expected_rows(x.dims()[0]);
        #[cfg(feature = "cuda")]
        if let Some(groups) = self
            .shared_groups
            .as_ref()
            .filter(|_| self.shared_in_grouped_gemm(x.dims()[0]))
        {
            let (y, s) = crate::grouped::forward_masked_with_shared(
                &self.experts,
                recv_x,
                recv_count,
                x,
                groups,
                self.low_latency_tiles(x.device(), expected)?,
            )?;
            return Ok((y, Some(s)));
        }
        let tiles = self.low_latency_tiles(x.device(), expected)?;
        Ok((
            self.experts
                .forward_masked_tiled(recv_x, recv_count, tiles)?,
            shared,
        ))
    }

    /// Low-latency mode; the shared experts run between the send and receive phases, or inside
    /// the grouped GEMMs ([`SharedPlacement`]). No host synchronisation: the expert GEMMs read
    /// the received counts on the device.
    fn routed_low_latency(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if self.options.two_batch_overlap && self.buffer.topology().num_ranks > 1 {
            return self.routed_low_latency_two_batches(x, idx, w);
        }
        let t = x.dims()[0];
        let hook = self
            .buffer
            .low_latency_dispatch_send(&self.low_latency_dispatch_args(x, idx, w))?;
        let shared = if t == 0 || self.shared_in_grouped_gemm(t) {
            None
        } else {
            self.shared_forward(x)?
        };
        let out = hook.recv()?;
        let recv_x = self.low_latency_rows(&out, x.dtype())?;
        let (y, shared) = self.expert_blocks(&recv_x, &out.recv_count, x, shared)?;
        let y = y.to_dtype(recv_x.dtype())?;
        let combined = self.buffer.low_latency_combine(
            &LowLatencyCombineArgs::new(&y, idx, w, &out.handle)
                .reduction(self.options.low_latency_reduction),
        )?;
        Ok((combined.combined_x, shared))
    }

    /// The low-latency dispatch of `x` routed by `idx`, `w` (the weights travel for a per-rank
    /// combine).
    fn low_latency_dispatch_args<'a>(
        &self,
        x: &'a Tensor,
        idx: &'a Tensor,
        w: &'a Tensor,
    ) -> LowLatencyDispatchArgs<'a> {
        let mut args = LowLatencyDispatchArgs::new(
            x,
            idx,
            self.options.low_latency_max_tokens,
            self.num_experts,
        );
        if self.options.fp8_dispatch {
            args = args.fp8(false);
        }
        if self.options.low_latency_reduction == Reduction::PerRank {
            args = args.weights(w);
        }
        args
    }

    /// The received rows of a low-latency dispatch in `dtype` (fp8 cast back).
    fn low_latency_rows(
        &self,
        out: &ep_runtime::LowLatencyDispatchOutput,
        dtype: DType,
    ) -> Result<Tensor> {
        Ok(match &out.recv_x_scales {
            Some(s) => per_token_cast_back(&out.recv_x, s, dtype)?,
            None => out.recv_x.clone(),
        })
    }

    /// Low-latency mode as two micro-batches ([`MoeLayerOptions::two_batch_overlap`]): both
    /// dispatches are sent, the shared experts run while they travel, then A is received, its
    /// experts run and its combine is sent, while B's tokens are already in; then B; then both
    /// combines are received. The shared experts run as their own MLP.
    fn routed_low_latency_two_batches(
        &self,
        x: &Tensor,
        idx: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let t = x.dims()[0];
        let [(xa, ia, wa), (xb, ib, wb)] = two_micro_batches(x, idx, w)?;
        let red = self.options.low_latency_reduction;
        let hook_a = self
            .buffer
            .low_latency_dispatch_send(&self.low_latency_dispatch_args(&xa, &ia, &wa))?;
        let hook_b = self
            .buffer
            .low_latency_dispatch_send(&self.low_latency_dispatch_args(&xb, &ib, &wb))?;
        let shared = if t == 0 {
            None
        } else {
            self.shared_forward(x)?
        };
        let tiles = self.low_latency_tiles(x.device(), self.expected_rows(xa.dims()[0]))?;
        // A micro-batch's rows in, its experts, its combine sent.
        let experts = |out: &ep_runtime::LowLatencyDispatchOutput| -> Result<Tensor> {
            let rows = self.low_latency_rows(out, x.dtype())?;
            Ok(self
                .experts
                .forward_masked_tiled(&rows, &out.recv_count, tiles)?
                .to_dtype(rows.dtype())?)
        };
        let out_a = hook_a.recv()?;
        let ya = experts(&out_a)?;
        let comb_a = self.buffer.low_latency_combine_send(
            &LowLatencyCombineArgs::new(&ya, &ia, &wa, &out_a.handle).reduction(red),
        )?;
        let out_b = hook_b.recv()?;
        let yb = experts(&out_b)?;
        let comb_b = self.buffer.low_latency_combine_send(
            &LowLatencyCombineArgs::new(&yb, &ib, &wb, &out_b.handle).reduction(red),
        )?;
        let (ca, cb) = (comb_a.recv()?, comb_b.recv()?);
        Ok((join_parts(ca.combined_x, cb.combined_x)?, shared))
    }
}

/// What a normal-mode dispatch sends: the layout of its routing and its rows (bf16, or fp8
/// with their scales).
struct SendRows {
    layout: ep_runtime::DispatchLayout,
    x: Tensor,
    scales: Option<Tensor>,
}

/// The two micro-batches of a two-batch-overlap step: the tokens (and their routing) split at
/// `ceil(T / 2)`, as views (either may be empty).
fn two_micro_batches(
    x: &Tensor,
    idx: &Tensor,
    w: &Tensor,
) -> Result<[(Tensor, Tensor, Tensor); 2]> {
    let t = x.dims()[0];
    let ta = t.div_ceil(2);
    let part = |start: usize, len: usize| -> Result<(Tensor, Tensor, Tensor)> {
        Ok((
            x.narrow(0, start, len)?,
            idx.narrow(0, start, len)?,
            w.narrow(0, start, len)?,
        ))
    };
    Ok([part(0, ta)?, part(ta, t - ta)?])
}

/// The outputs of two micro-batches in token order (an empty second part adds nothing).
fn join_parts(a: Tensor, b: Tensor) -> Result<Tensor> {
    Ok(if b.dims()[0] == 0 {
        a
    } else if a.dims()[0] == 0 {
        b
    } else {
        Tensor::cat(&[&a, &b], 0)?
    })
}

impl candle_nn::Module for MoeLayer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        MoeLayer::forward(self, x)
    }
}

/// The routed output plus the shared experts' (if they ran apart), in `dtype`: bf16 + bf16
/// rounds the exact sum once, as an f32 sum rounded to bf16 would (one kernel instead of four).
fn with_shared(
    routed: Tensor,
    shared: Option<Tensor>,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    match shared {
        Some(s) if routed.dtype() == dtype && s.dtype() == dtype => routed + s,
        Some(s) => (routed.to_dtype(DType::F32)? + s.to_dtype(DType::F32)?)?.to_dtype(dtype),
        None => routed.to_dtype(dtype),
    }
}
