//! [`MoeLayer`]: route -> dispatch -> grouped GEMM -> combine, plus shared experts.

use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::expert_load::ExpertLoad;
use crate::expert_map::ExpertMap;
use crate::experts::{Experts, Mlp};
use crate::options::MoeLayerOptions;
use crate::placement::Placement;
use crate::router::Router;
use crate::step::{Mode, Step};
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use ep_runtime::Buffer;
use std::sync::Arc;

/// Bytes of a layer's weights on one rank ([`MoeLayer::weight_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightBytes {
    /// This rank's routed experts (with their fp8 scales).
    pub routed: usize,
    /// The shared experts (their float MLP, and their fp8 blocks where the layer keeps them).
    pub shared: usize,
    /// The router's gate (the f32 weight and the bf16 copy it computes with) and bias.
    pub router: usize,
}

impl WeightBytes {
    /// All of them.
    pub fn total(&self) -> usize {
        self.routed + self.shared + self.router
    }
}

/// One routed step on `(x, topk_idx, topk_weights)`: the combined routed output and the
/// shared experts' output (when computed alongside).
type RoutedOp = fn(&MoeLayer, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Option<Tensor>)>;

/// An expert-parallel Mixture-of-Experts layer over candle tensors.
///
/// Each rank holds the router, its `E / R` routed experts and the shared experts. `forward`
/// routes this rank's tokens, dispatches them to the ranks holding their experts, runs each
/// local expert once over the tokens it received (grouped GEMM), combines the weighted
/// outputs back on the tokens' home ranks and adds the shared experts' output (in normal mode
/// inside the combine's sums, as its bias). In low-latency mode the shared experts run while
/// the routed tokens travel (receive hook).
#[derive(Debug)]
pub struct MoeLayer {
    pub(crate) router: Router,
    pub(crate) experts: Experts,
    pub(crate) shared: Option<Mlp>,
    pub(crate) buffer: Arc<Buffer>,
    pub(crate) num_experts: usize,
    pub(crate) options: MoeLayerOptions,
    /// The routing masks of [`MoeLayerOptions::expert_groups`] (more than one group, more
    /// than one rank).
    pub(crate) expert_groups: Option<crate::modes::expert_groups::ExpertGroups>,
    /// [`MoeLayerOptions::normal_gemm_grid`], resolved.
    pub(crate) normal_gemm_grid: ep_kernels::gemm::GemmGrid,
    /// Captured decode steps of [`MoeLayer::forward_decode`].
    #[cfg(feature = "cuda")]
    pub(crate) decode_graphs: crate::modes::captured_step::DecodeGraphs,
    /// The shared experts as extra groups of the low-latency grouped GEMMs, when placed there.
    #[cfg(feature = "cuda")]
    pub(crate) shared_groups: Option<crate::experts::shared_groups::SharedGroups>,
    /// The shared experts of an fp8 layer in fp8 ([`MoeLayer::with_fp8_shared`]): they run
    /// on the fp8 grouped GEMMs (as extra groups in low-latency mode) instead of `shared`.
    #[cfg(feature = "cuda")]
    pub(crate) shared_fp8: Option<crate::experts::shared_fp8::SharedFp8>,
    /// Redundant experts: the router's logical picks to physical slots.
    pub(crate) expert_map: Option<ExpertMap>,
    /// Tokens routed to each logical expert ([`MoeLayer::with_load_stats`]).
    pub(crate) expert_load: Option<ExpertLoad>,
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
        Self::assemble(router, experts, shared, buffer, options, None)
    }

    /// Assembles a layer with redundant experts: `map` turns the router's `E` logical experts
    /// into `P` physical slots, and `experts` must be this rank's slots (`first_expert = rank *
    /// P / R`, `P / R` slots, slot `s` holding the weights of logical expert
    /// `map.placement().phy_to_log[s]`; [`Experts::load_slots`]).
    pub fn with_placement(
        router: Router,
        experts: Experts,
        shared: Option<Mlp>,
        buffer: Arc<Buffer>,
        options: MoeLayerOptions,
        map: ExpertMap,
    ) -> Result<Self> {
        Self::assemble(router, experts, shared, buffer, options, Some(map))
    }

    fn assemble(
        router: Router,
        experts: Experts,
        shared: Option<Mlp>,
        buffer: Arc<Buffer>,
        options: MoeLayerOptions,
        expert_map: Option<ExpertMap>,
    ) -> Result<Self> {
        let topo = buffer.topology();
        if let Some(m) = expert_map
            .as_ref()
            .filter(|m| m.num_logical() != router.num_experts())
        {
            return Err(Error::invalid(
                "placement",
                format!("{} logical experts", m.num_logical()),
                format!("must be the router's {}", router.num_experts()),
            ));
        }
        // Physical experts: the router's, or the map's slots.
        let e = expert_map
            .as_ref()
            .map_or(router.num_experts(), ExpertMap::num_physical);
        if e % topo.num_ranks != 0 {
            return Err(Error::invalid(
                "n_routed_experts",
                e,
                format!(
                    "(physical experts) must be a multiple of the number of ranks {}",
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
        if options.expert_groups == 0 || options.expert_groups > l {
            return Err(Error::invalid(
                "expert_groups",
                options.expert_groups,
                format!("must be between 1 and the experts per rank ({l})"),
            ));
        }
        if options.expert_groups > 1 && options.two_batch_overlap {
            return Err(Error::invalid(
                "expert_groups",
                options.expert_groups,
                "must be 1 with two_batch_overlap (two pipelines of one step)",
            ));
        }
        let expert_groups = if options.expert_groups > 1 && topo.num_ranks > 1 {
            Some(crate::modes::expert_groups::ExpertGroups::new(
                options.expert_groups,
                e,
                topo.num_ranks,
                router.weight().device(),
            )?)
        } else {
            None
        };
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
        match options.normal_max_tokens_per_rank {
            Some(0) => {
                return Err(Error::invalid(
                    "normal_max_tokens_per_rank",
                    "Some(0)",
                    "must be at least 1 (None: exact outputs)",
                ))
            }
            Some(m) if buffer.normal_mode_max_tokens().is_some() => {
                return Err(Error::invalid(
                    "normal_max_tokens_per_rank",
                    m,
                    "worst-case outputs are one node only (this buffer spans nodes)",
                ))
            }
            _ => {}
        }
        if options.normal_gemm_grid == Some(ep_kernels::gemm::GemmGrid::PersistentOn(0)) {
            return Err(Error::invalid(
                "normal_gemm_grid",
                "PersistentOn(0)",
                "a persistent grid needs at least one SM",
            ));
        }
        let normal_gemm_grid = options
            .normal_gemm_grid
            .unwrap_or(if expert_groups.is_some() {
                ep_kernels::gemm::GemmGrid::PerTile
            } else {
                ep_kernels::gemm::GemmGrid::Persistent
            });
        #[cfg(feature = "cuda")]
        experts.grouped_state().set_routed_grid(normal_gemm_grid);
        #[cfg(feature = "cuda")]
        let (shared, shared_groups) = match (shared, options.shared_placement) {
            (Some(m), crate::SharedPlacement::Grouped | crate::SharedPlacement::Auto)
                if crate::experts::shared_groups::SharedGroups::eligible(&m, &experts) =>
            {
                // The shared MLP in the blocked layout; its blocks are views of its weights.
                let m = m.with_layout(crate::GateUpLayout::Blocked)?;
                let groups = crate::experts::shared_groups::SharedGroups::new(&m, &experts)?;
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
            expert_groups,
            normal_gemm_grid,
            #[cfg(feature = "cuda")]
            decode_graphs: Default::default(),
            #[cfg(feature = "cuda")]
            shared_groups,
            #[cfg(feature = "cuda")]
            shared_fp8: None,
            expert_map,
            expert_load: None,
        })
    }

    /// The layer counting the tokens its router sends to each logical expert, on its device
    /// (read with [`MoeLayer::take_expert_load`]).
    pub fn with_load_stats(mut self) -> Result<Self> {
        self.enable_load_stats()?;
        Ok(self)
    }

    /// [`MoeLayer::with_load_stats`] on a layer in place (steps captured before it do not
    /// count).
    pub fn enable_load_stats(&mut self) -> Result<()> {
        if self.expert_load.is_none() {
            self.expert_load = Some(ExpertLoad::new(
                self.router.num_experts(),
                self.router.weight().device(),
            )?);
        }
        Ok(())
    }

    /// Tokens routed to each logical expert since the last call (one device-to-host copy),
    /// `None` without [`MoeLayer::with_load_stats`].
    pub fn take_expert_load(&self) -> Result<Option<Vec<f64>>> {
        self.expert_load.as_ref().map(ExpertLoad::take).transpose()
    }

    /// The redundant experts' map, if the layer has one.
    pub fn expert_map(&self) -> Option<&ExpertMap> {
        self.expert_map.as_ref()
    }

    /// The layer with its shared experts also kept as block-scaled fp8 weights: where the
    /// routed experts are fp8 (CUDA) they then run on the fp8 grouped GEMMs (in low-latency
    /// steps as extra groups of the routed experts' GEMMs); elsewhere, or when their shapes
    /// cannot join the routed experts' GEMMs, the layer keeps running `shared` (its float MLP)
    /// and this changes nothing.
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    pub fn with_fp8_shared(mut self, shared: &crate::experts::Fp8Expert) -> Result<Self> {
        #[cfg(feature = "cuda")]
        {
            self.shared_fp8 = crate::experts::shared_fp8::SharedFp8::new(shared, &self.experts)?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = shared;
        Ok(self)
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
        Self::load_placed(vb, cfg, buffer, options, None)
    }

    /// [`MoeLayer::load`] with redundant experts when `placement` is given: this rank loads
    /// the logical experts of its physical slots (`rank * P / R ..`, each replica its own
    /// copy) and the layer maps the router's picks to slots ([`ExpertMap`]).
    pub fn load_placed(
        vb: VarBuilder,
        cfg: &MoeConfig,
        buffer: Arc<Buffer>,
        options: MoeLayerOptions,
        placement: Option<&Placement>,
    ) -> Result<Self> {
        cfg.validate()?;
        let topo = buffer.topology();
        let p = placement.map_or(cfg.n_routed_experts, Placement::num_physical);
        if p % topo.num_ranks != 0 {
            return Err(Error::invalid(
                "n_routed_experts",
                p,
                format!(
                    "(physical experts) must be a multiple of the number of ranks {}",
                    topo.num_ranks
                ),
            ));
        }
        let l = p / topo.num_ranks;
        let router = Router::load(vb.pp("gate"), cfg)?;
        let slots = topo.rank * l..(topo.rank + 1) * l;
        let experts = match placement {
            Some(pl) => {
                Experts::load_slots(vb.pp("experts"), cfg, slots.start, &pl.phy_to_log[slots])?
            }
            None => Experts::load(vb.pp("experts"), cfg, slots.start, l)?,
        };
        let svb = vb.pp("shared_experts");
        let fp8_shared = match cfg.shared_intermediate_size() {
            Some(i) if experts.is_fp8() => {
                crate::experts::Fp8Expert::load(&svb, cfg.hidden_size, i)?
            }
            _ => None,
        };
        // fp8 shared experts that join the routed experts' fp8 GEMMs hold no float copy;
        // elsewhere they are dequantized once, here.
        #[cfg(feature = "cuda")]
        let fp8_blocks = match &fp8_shared {
            Some(f) => crate::experts::shared_fp8::SharedFp8::new(f, &experts)?,
            None => None,
        };
        #[cfg(not(feature = "cuda"))]
        let fp8_blocks: Option<std::convert::Infallible> = None;
        let shared = match (cfg.shared_intermediate_size(), &fp8_shared) {
            (Some(_), Some(_)) if fp8_blocks.is_some() => None,
            (Some(_), Some(f)) => Some(f.dequantize(vb.dtype())?),
            (Some(i), None) => Some(Mlp::load(svb, cfg.hidden_size, i)?),
            (None, _) => None,
        };
        let map = placement
            .map(|pl| ExpertMap::new(pl.clone(), router.weight().device()))
            .transpose()?;
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut layer = Self::assemble(router, experts, shared, buffer, options, map)?;
        #[cfg(feature = "cuda")]
        {
            layer.shared_fp8 = fp8_blocks;
        }
        Ok(layer)
    }

    /// Bytes of the weights this rank's part of the layer holds, by kind.
    pub fn weight_bytes(&self) -> WeightBytes {
        #[cfg(feature = "cuda")]
        let shared_fp8 = self.shared_fp8.as_ref().map_or(0, |s| {
            [&s.gate_up, &s.gate_up_scale, &s.down, &s.down_scale]
                .iter()
                .map(|t| crate::experts::tensor_bytes(t))
                .sum()
        });
        #[cfg(not(feature = "cuda"))]
        let shared_fp8 = 0;
        WeightBytes {
            routed: self.experts.weight_bytes(),
            shared: self.shared.as_ref().map_or(0, Mlp::weight_bytes) + shared_fp8,
            router: self.router.weight_bytes(),
        }
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
    pub(crate) fn decode_graphs(&self) -> &crate::modes::captured_step::DecodeGraphs {
        &self.decode_graphs
    }

    /// The shared experts' float MLP, if the layer runs one: a layer loaded from fp8 shared
    /// experts that run on the routed experts' fp8 GEMMs (CUDA) holds none.
    pub fn shared(&self) -> Option<&Mlp> {
        self.shared.as_ref()
    }

    /// The options.
    pub fn options(&self) -> &MoeLayerOptions {
        &self.options
    }

    /// The grid normal mode's grouped GEMMs launch with on CUDA
    /// ([`MoeLayerOptions::normal_gemm_grid`] or its default).
    pub fn normal_gemm_grid(&self) -> ep_kernels::gemm::GemmGrid {
        self.normal_gemm_grid
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

    /// A low-latency step, through captured graphs on a CUDA build: the tokens are copied into the input of the
    /// step captured for the smallest power of two >= `T` (captured on first use; at most
    /// `low_latency_max_tokens`), the graph is replayed, and the first `T` rows of its output
    /// are returned. The padding rows hold earlier tokens: they are routed and computed like
    /// real ones, and dropped.
    ///
    /// Captured only for single-rank CUDA layers: with several ranks every rank would have to
    /// capture the same size at the same moment, which this method cannot arrange (use
    /// [`MoeLayer::capture_decode`] on every rank together for that). Other layers, and `T = 0`,
    /// run [`MoeLayer::forward_with_mode`] in low-latency mode.
    ///
    /// Without the `cuda` feature this is [`MoeLayer::forward_with_mode`] in low-latency mode.
    pub fn forward_decode(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        return self.forward_decode_captured(x);
        #[cfg(not(feature = "cuda"))]
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
        let worst = self.worst_case_tokens(mode, t, most)?;
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
            if let Some(load) = &self.expert_load {
                load.record(&routing.topk_idx)?;
            }
            let idx = match &self.expert_map {
                Some(map) => map.to_physical(&routing.topk_idx)?,
                None => routing.topk_idx,
            };
            (idx, routing.topk_weights)
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
                    // Across nodes: no worst-case outputs (refused at load).
                    |l, x, i, w| l.routed_normal(x, i, w, None),
                )?,
                None => self.routed_normal(&x2, &topk_idx, &topk_weights, worst)?,
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

    /// The worst-case received rows of this step's dispatches
    /// ([`MoeLayerOptions::normal_max_tokens_per_rank`]), or `None` for exact outputs: a
    /// normal step whose busiest rank (`most`, when known) fits the bound takes it on every
    /// rank, one over it takes exact outputs on every rank; without `most`, this rank's `t`
    /// over the bound is refused (the other ranks could not know).
    fn worst_case_tokens(
        &self,
        mode: Mode,
        t: usize,
        most: Option<usize>,
    ) -> Result<Option<usize>> {
        let Some(max) = self.options.normal_max_tokens_per_rank else {
            return Ok(None);
        };
        if mode == Mode::LowLatency || self.prefill_in_low_latency_chunks() {
            return Ok(None);
        }
        match most {
            Some(m) => Ok((m <= max).then_some(max)),
            None if t <= max => Ok(Some(max)),
            None => Err(Error::invalid(
                "x",
                format!("{t} tokens"),
                format!(
                    "normal mode takes at most normal_max_tokens_per_rank = {max} tokens per rank \
                     (forward_step or Mode::Auto run larger steps with exact outputs)"
                ),
            )),
        }
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

    pub(crate) fn shared_forward(&self, x: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Some(blocks) = &self.shared_fp8 {
            if x.dims()[0] == 0 {
                return Ok(None);
            }
            let y = crate::experts::grouped_fp8::forward_shared(&self.experts, blocks, x)?;
            return Ok(Some(y.to_dtype(x.dtype())?));
        }
        Ok(match &self.shared {
            Some(m) => Some(m.forward(x)?),
            None => None,
        })
    }
}

/// The two micro-batches of a two-batch-overlap step: the tokens (and their routing) split at
/// `ceil(T / 2)`, as views (either may be empty).
pub(crate) fn two_micro_batches(
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
pub(crate) fn join_parts(a: Tensor, b: Tensor) -> Result<Tensor> {
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
