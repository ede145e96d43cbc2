//! The single-process reference MoE layer: the router, every routed expert and the optional
//! shared expert in one place, with no expert parallelism. Expert-parallel runs over `R` ranks
//! are checked against it.

use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;

use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::experts::{Experts, Mlp};
use crate::router::Router;

/// A whole MoE layer on one device: `shared(x) + sum_k w_k * expert_{idx_k}(x)`.
#[derive(Clone, Debug)]
pub struct DenseMoe {
    router: Router,
    experts: Experts,
    shared: Option<Mlp>,
}

impl DenseMoe {
    /// Assembles the layer. `experts` must hold all of the router's experts (first expert 0)
    /// and every part must have the router's hidden size.
    pub fn new(router: Router, experts: Experts, shared: Option<Mlp>) -> Result<Self> {
        if experts.first_expert() != 0 || experts.num_local() != router.num_experts() {
            return Err(Error::invalid(
                "experts",
                format!(
                    "experts {}..{}",
                    experts.first_expert(),
                    experts.first_expert() + experts.num_local()
                ),
                format!(
                    "must hold all n_routed_experts = 0..{}",
                    router.num_experts()
                ),
            ));
        }
        if experts.hidden_size() != router.hidden_size() {
            return Err(Error::invalid(
                "experts",
                format!("hidden size {}", experts.hidden_size()),
                format!("must be the router's {}", router.hidden_size()),
            ));
        }
        if let Some(s) = &shared {
            if s.hidden_size() != router.hidden_size() {
                return Err(Error::invalid(
                    "shared",
                    format!("hidden size {}", s.hidden_size()),
                    format!("must be the router's {}", router.hidden_size()),
                ));
            }
        }
        Ok(Self {
            router,
            experts,
            shared,
        })
    }

    /// Loads the layer from `vb` at its `mlp` prefix: `gate`, `experts.{0..E}` and, when
    /// `n_shared_experts > 0`, `shared_experts` of width `moe_intermediate_size * n_shared_experts`.
    pub fn load(vb: VarBuilder, cfg: &MoeConfig) -> Result<Self> {
        cfg.validate()?;
        let router = Router::load(vb.pp("gate"), cfg)?;
        let experts = Experts::load(vb.pp("experts"), cfg, 0, cfg.n_routed_experts)?;
        let shared = match cfg.shared_intermediate_size() {
            Some(i) => Some(Mlp::load(vb.pp("shared_experts"), cfg.hidden_size, i)?),
            None => None,
        };
        Self::new(router, experts, shared)
    }

    /// The router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// All routed experts.
    pub fn experts(&self) -> &Experts {
        &self.experts
    }

    /// The shared expert, if any.
    pub fn shared(&self) -> Option<&Mlp> {
        self.shared.as_ref()
    }

    /// Bytes of its weights (router, every expert, shared experts).
    pub fn weight_bytes(&self) -> usize {
        self.router.weight_bytes()
            + self.experts.weight_bytes()
            + self.shared.as_ref().map_or(0, Mlp::weight_bytes)
    }

    /// Applies the layer to `x` `[T, H]`; the sum is taken in f32 and returned in `x`'s dtype.
    /// Returns candle's error type, like [`crate::MoeLayer::forward`] (layer errors are
    /// wrapped: [`Error::from_candle`] gives them back).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let routing = self.router.forward(x)?;
        let mut acc =
            self.experts
                .forward_grouped_f32(x, &routing.topk_idx, &routing.topk_weights)?;
        if let Some(shared) = &self.shared {
            acc = (acc + shared.forward(x)?.to_dtype(DType::F32)?)?;
        }
        acc.to_dtype(x.dtype())
    }
}

impl Module for DenseMoe {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        DenseMoe::forward(self, xs)
    }
}
