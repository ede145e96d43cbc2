//! [`Experts`]: the shard of routed experts one rank holds, with the two expert-GEMM shapes of
//! expert parallelism: rows with their top-k routing (normal mode) and per-expert blocks with
//! row counts (low-latency mode).
//!
//! The weights are stacked once, when the shard is built: `gate_up` `[L, 2I, H]` (each
//! expert's `gate_proj` and `up_proj` rows, [`GateUpLayout::Blocked`] where the grouped GEMMs
//! run, else [`GateUpLayout::Stacked`]) and `down` `[L, H, I]`; each expert's [`Mlp`] is a view
//! of them. On CUDA with bf16 weights (and `H`, `I` multiples of 8) the forward passes run
//! as grouped GEMMs on the device (`grouped`): no routing or count is read by the host.
//! On the CPU (and for other dtypes) each expert runs over its rows, grouped on the host.
//!
//! Block-scaled fp8 checkpoints ([`crate::fp8`]) load as fp8 experts on CUDA (e4m3 weights with
//! their 128 x 128 scales, the gate_up weight [`GateUpLayout::Stacked`], block-scaled fp8
//! grouped GEMMs fed with e4m3 rows and their 1 x 128 scales, [`ExpertInput`]); elsewhere they
//! are dequantized once when the shard is built, exactly as DeepSeek's `weight_dequant`.
//!
//! This file holds the shard and its constructors; `forward` its forward passes.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ep_kernels::gemm::fp8::{weight_scale_dims, FP8_BLOCK};

use super::fp8_expert::{Fp8Expert, Fp8Scales};
use super::mlp::{tensor_bytes, GateUpLayout, Mlp};
use super::rules::{fp8_eligible, weight_layout};
use crate::config::MoeConfig;
use crate::error::{Error, Result};

/// The routed experts `first_expert .. first_expert + num_local` that one rank holds.
#[derive(Clone, Debug)]
pub struct Experts {
    pub(super) first_expert: usize,
    /// `[L, 2I, H]`: the gate_proj and up_proj rows of every expert, in `layout`.
    pub(super) gate_up: Tensor,
    pub(super) layout: GateUpLayout,
    /// `[L, H, I]`.
    pub(super) down: Tensor,
    /// With e4m3 weights (fp8 experts on CUDA): their block scales.
    fp8: Option<Fp8Scales>,
    /// Views of the stacked weights, one per expert (none for fp8 experts, which run on the
    /// grouped GEMMs only).
    pub(super) experts: Vec<Mlp>,
    /// The device grouped GEMMs' state (CUDA, bf16), created on first use.
    #[cfg(feature = "cuda")]
    pub(super) grouped: std::sync::Arc<super::grouped_state::GroupedState>,
}

impl Experts {
    /// Builds the shard from its experts (copied into stacked weights), local expert `l` being
    /// global expert `first_expert + l`. All experts must share shapes, dtype and device; at
    /// least one is needed.
    pub fn new(first_expert: usize, experts: Vec<Mlp>) -> Result<Self> {
        let Some(first) = experts.first() else {
            return Err(Error::invalid(
                "experts",
                "[]",
                "at least one local expert is needed",
            ));
        };
        let (h, i, dtype) = (
            first.hidden_size(),
            first.intermediate_size(),
            first.dtype(),
        );
        for (l, m) in experts.iter().enumerate() {
            if m.hidden_size() != h || m.intermediate_size() != i {
                return Err(Error::invalid(
                    "experts",
                    format!(
                        "expert {} of [intermediate, hidden] = [{}, {}]",
                        first_expert + l,
                        m.intermediate_size(),
                        m.hidden_size()
                    ),
                    format!("must be [{i}, {h}] like expert {first_expert}"),
                ));
            }
            if m.dtype() != dtype || !m.device().same_device(first.device()) {
                return Err(Error::invalid(
                    "experts",
                    format!(
                        "expert {} of {:?} on {:?}",
                        first_expert + l,
                        m.dtype(),
                        m.device()
                    ),
                    format!(
                        "must be {dtype:?} on {:?} like expert {first_expert}",
                        first.device()
                    ),
                ));
            }
        }
        let layout = weight_layout(first.device(), dtype, experts.len(), h, i);
        let gate_up = experts
            .iter()
            .map(|m| Ok(m.with_layout(layout)?.gate_up().clone()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let down: Vec<&Tensor> = experts.iter().map(Mlp::down_proj).collect();
        Self::from_parts(
            first_expert,
            Tensor::stack(&gate_up, 0)?,
            layout,
            Tensor::stack(&down, 0)?,
        )
    }

    /// Builds the shard from stacked weights: `gate_up` `[L, 2I, H]` (each expert's
    /// `gate_proj` rows, then its `up_proj` rows) and `down` `[L, H, I]`, one dtype and device.
    /// Where the grouped GEMMs run, `gate_up` is re-laid into [`GateUpLayout::Blocked`] (a copy;
    /// [`Experts::load`] writes that layout as it reads, without the second copy).
    pub fn from_stacked(first_expert: usize, gate_up: Tensor, down: Tensor) -> Result<Self> {
        Self::from_parts(first_expert, gate_up, GateUpLayout::Stacked, down)
    }

    /// [`Experts::from_stacked`] with `gate_up` in `layout`.
    fn from_parts(
        first_expert: usize,
        gate_up: Tensor,
        layout: GateUpLayout,
        down: Tensor,
    ) -> Result<Self> {
        let (l, i2, h) = gate_up.dims3().map_err(|_| {
            Error::invalid(
                "gate_up",
                format!("shape {:?}", gate_up.dims()),
                "must be [num_local, 2 * intermediate, hidden]",
            )
        })?;
        if l == 0 || i2 == 0 || i2 % 2 != 0 || h == 0 {
            return Err(Error::invalid(
                "gate_up",
                format!("shape {:?}", gate_up.dims()),
                "must be [num_local >= 1, 2 * intermediate >= 2, hidden >= 1]",
            ));
        }
        let i = i2 / 2;
        if down.dims() != [l, h, i] {
            return Err(Error::invalid(
                "down",
                format!("shape {:?}", down.dims()),
                format!(
                    "must be [{l}, {h}, {i}] to match gate_up {:?}",
                    gate_up.dims()
                ),
            ));
        }
        if down.dtype() != gate_up.dtype() || !down.device().same_device(gate_up.device()) {
            return Err(Error::invalid(
                "down",
                format!("{:?} on {:?}", down.dtype(), down.device()),
                format!(
                    "must be {:?} on {:?} like gate_up",
                    gate_up.dtype(),
                    gate_up.device()
                ),
            ));
        }
        let target = weight_layout(gate_up.device(), gate_up.dtype(), l, h, i);
        let gate_up = if layout == target {
            gate_up.contiguous()?
        } else {
            // One expert at a time: candle's strided copy kernels index with 32 bits, and a
            // whole stack (7.5e9 values at DeepSeek-V3 shapes) is past that.
            let blocks = (0..l)
                .map(|e| super::mlp::relaid_gate_up(&gate_up.get(e)?, layout, target))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::stack(&blocks, 0)?
        };
        let down = down.contiguous()?;
        let experts = (0..l)
            .map(|e| {
                // Views of the stacked weights: no copy.
                Mlp::from_parts(gate_up.get(e)?, target, down.get(e)?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            first_expert,
            gate_up,
            layout: target,
            down,
            fp8: None,
            experts,
            #[cfg(feature = "cuda")]
            grouped: Default::default(),
        })
    }

    /// Builds the shard from block-scaled fp8 experts, local expert `l` being global expert
    /// `first_expert + l`. Where fp8 grouped GEMMs run (CUDA on sm_90, `H` a multiple of 128,
    /// `I` of 128, at most 1024 local experts) the shard keeps the e4m3 weights and their scales
    /// (gate_up in [`GateUpLayout::ScaleBlocks`]: 128 gate rows and the same 128 up rows in
    /// turn, one scale block each);
    /// elsewhere every expert is dequantized to `dtype` ([`Fp8Expert::dequantize`]) and the
    /// shard is a plain one.
    pub fn from_fp8(first_expert: usize, experts: Vec<Fp8Expert>, dtype: DType) -> Result<Self> {
        let l = experts.len();
        Self::from_fp8_each(first_expert, l, experts.into_iter().map(Ok), dtype)
    }

    /// [`Experts::from_fp8`] over `l` experts given one at a time, each dropped once it is in
    /// the shard: a load holds the shard plus one expert, and the device keeps no scratch
    /// between the stacks (the scales gather on the host and go up once).
    fn from_fp8_each(
        first_expert: usize,
        l: usize,
        mut experts: impl Iterator<Item = Result<Fp8Expert>>,
        dtype: DType,
    ) -> Result<Self> {
        let Some(first) = experts.next().transpose()? else {
            return Err(Error::invalid(
                "experts",
                "[]",
                "at least one local expert is needed",
            ));
        };
        let (i, h) = first.gate.dims();
        let check = |l: usize, e: &Fp8Expert| -> Result<()> {
            let dims = [e.gate.dims(), e.up.dims(), e.down.dims()];
            if dims != [(i, h), (i, h), (h, i)] {
                return Err(Error::invalid(
                    "experts",
                    format!("expert {} of shapes {dims:?}", first_expert + l),
                    format!(
                        "must be gate/up [{i}, {h}] and down [{h}, {i}] like expert {first_expert}"
                    ),
                ));
            }
            Ok(())
        };
        let device = first.gate.q().device().clone();
        let mut rest = experts.enumerate().map(|(k, x)| {
            let x = x?;
            check(k + 1, &x)?;
            Ok::<_, Error>(x)
        });
        if !fp8_eligible(&device, l, h, i)? {
            let mut mlps = vec![first.dequantize(dtype)?];
            drop(first);
            for x in rest {
                mlps.push(x?.dequantize(dtype)?);
            }
            return Self::new(first_expert, mlps);
        }
        let gate_up = Tensor::zeros((l, 2 * i, h), DType::F8E4M3, &device)?;
        let down = Tensor::zeros((l, h, i), DType::F8E4M3, &device)?;
        let (mut gate_up_scales, mut down_scales) = (Vec::new(), Vec::new());
        let mut put = |e: usize, x: Fp8Expert| -> Result<()> {
            let (gu, gu_scales) = x.gate_up_blocks()?;
            gate_up.slice_set(&gu.unsqueeze(0)?, 0, e)?;
            down.slice_set(&x.down.q().unsqueeze(0)?, 0, e)?;
            let host = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
            gate_up_scales.extend(host(&gu_scales)?);
            down_scales.extend(host(x.down.scale())?);
            Ok(())
        };
        put(0, first)?;
        let mut count = 1;
        for x in rest.by_ref() {
            put(count, x?)?;
            count += 1;
        }
        if count != l {
            return Err(Error::invalid(
                "experts",
                count,
                format!("must be the {l} experts the shard was sized for"),
            ));
        }
        let (gs, ds) = (
            weight_scale_dims(i, h, FP8_BLOCK),
            weight_scale_dims(h, i, FP8_BLOCK),
        );
        Ok(Self {
            first_expert,
            gate_up,
            layout: GateUpLayout::ScaleBlocks,
            down,
            fp8: Some(Fp8Scales {
                gate_up: Tensor::from_vec(gate_up_scales, (l, 2 * gs.0, gs.1), &device)?,
                down: Tensor::from_vec(down_scales, (l, ds.0, ds.1), &device)?,
            }),
            experts: Vec::new(),
            #[cfg(feature = "cuda")]
            grouped: Default::default(),
        })
    }

    /// Loads global experts `first_expert .. first_expert + num_local` from `vb` at the layer's
    /// `mlp.experts` prefix, reading `{e}.gate_proj.weight`, `{e}.up_proj.weight` and
    /// `{e}.down_proj.weight` for those ids only: other experts' tensors are never touched.
    /// Each expert is copied into the stacked weights as it is read (memory: the stack plus
    /// one expert).
    pub fn load(
        vb: VarBuilder,
        cfg: &MoeConfig,
        first_expert: usize,
        num_local: usize,
    ) -> Result<Self> {
        let end = first_expert.saturating_add(num_local);
        if end > cfg.n_routed_experts {
            return Err(Error::invalid(
                "num_local",
                num_local,
                format!(
                    "first_expert {first_expert} + num_local = {end} exceeds n_routed_experts = {}",
                    cfg.n_routed_experts
                ),
            ));
        }
        let ids: Vec<usize> = (first_expert..end).collect();
        Self::load_slots(vb, cfg, first_expert, &ids)
    }

    /// Loads a shard of physical expert slots (redundant experts, [`crate::placement`]): slot
    /// `first_slot + l` holds logical expert `logical[l]` of `vb` (an expert may fill several
    /// slots, each its own copy of the weights). As [`Experts::load`] otherwise.
    pub fn load_slots(
        vb: VarBuilder,
        cfg: &MoeConfig,
        first_slot: usize,
        logical: &[usize],
    ) -> Result<Self> {
        cfg.validate()?;
        let num_local = logical.len();
        let Some(&first_id) = logical.first() else {
            return Err(Error::invalid(
                "num_local",
                0,
                "at least one local expert is needed",
            ));
        };
        if let Some(&e) = logical.iter().find(|&&e| e >= cfg.n_routed_experts) {
            return Err(Error::invalid(
                "logical",
                e,
                format!("must be below n_routed_experts = {}", cfg.n_routed_experts),
            ));
        }
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        if Fp8Expert::load(&vb.pp(first_id), h, i)?.is_some() {
            let experts = logical.iter().map(|&e| {
                Fp8Expert::load(&vb.pp(e), h, i)?.ok_or_else(|| {
                    Error::invalid(
                        "experts",
                        format!("expert {e} without weight_scale_inv"),
                        format!("must be fp8 like expert {first_id}"),
                    )
                })
            });
            return Self::from_fp8_each(first_slot, num_local, experts, vb.dtype());
        }
        let mut stacked: Option<(Tensor, Tensor)> = None;
        let mut layout = GateUpLayout::Stacked;
        for (l, &e) in logical.iter().enumerate() {
            let m = Mlp::load(vb.pp(e), h, i)?;
            if l == 0 {
                layout = weight_layout(m.device(), m.dtype(), num_local, h, i);
            }
            let m = m.with_layout(layout)?;
            let (gate_up, down) = match &stacked {
                Some(s) => s,
                None => stacked.insert((
                    Tensor::zeros((num_local, 2 * i, h), m.dtype(), m.device())?,
                    Tensor::zeros((num_local, h, i), m.dtype(), m.device())?,
                )),
            };
            gate_up.slice_set(&m.gate_up().unsqueeze(0)?, 0, l)?;
            down.slice_set(&m.down_proj().unsqueeze(0)?, 0, l)?;
        }
        let (gate_up, down) = stacked.expect("num_local >= 1");
        Self::from_parts(first_slot, gate_up, layout, down)
    }

    /// Global id of local expert 0.
    pub fn first_expert(&self) -> usize {
        self.first_expert
    }

    /// Number of local experts `L`.
    pub fn num_local(&self) -> usize {
        self.gate_up.dims()[0]
    }

    /// Hidden size `H`.
    pub fn hidden_size(&self) -> usize {
        self.gate_up.dims()[2]
    }

    /// Inner width `I` of each expert.
    pub fn intermediate_size(&self) -> usize {
        self.down.dims()[2]
    }

    /// Weight dtype (`F8E4M3` for fp8 experts).
    pub fn dtype(&self) -> DType {
        self.gate_up.dtype()
    }

    /// Bytes of the weights the shard holds (values and, for fp8 experts, their scales).
    pub fn weight_bytes(&self) -> usize {
        let mut t = vec![&self.gate_up, &self.down];
        if let Some(s) = &self.fp8 {
            t.extend([&s.gate_up, &s.down]);
        }
        t.iter().map(|t| tensor_bytes(t)).sum()
    }

    /// Whether the shard holds block-scaled e4m3 weights (fp8 experts on CUDA).
    pub fn is_fp8(&self) -> bool {
        self.fp8.is_some()
    }

    /// The block scales of fp8 experts.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn fp8_scales(&self) -> Option<&Fp8Scales> {
        self.fp8.as_ref()
    }

    /// Weight device.
    pub fn device(&self) -> &Device {
        self.gate_up.device()
    }

    /// The local experts, local id order (views of the stacked weights; empty for fp8
    /// experts).
    pub fn experts(&self) -> &[Mlp] {
        &self.experts
    }

    /// The stacked `[L, 2I, H]` gate_proj / up_proj weights, in [`Experts::gate_up_layout`].
    pub fn gate_up(&self) -> &Tensor {
        &self.gate_up
    }

    /// How [`Experts::gate_up`] holds each expert's gate and up rows:
    /// [`GateUpLayout::Blocked`] where the grouped GEMMs run ([`Experts::uses_grouped_gemm`]).
    pub fn gate_up_layout(&self) -> GateUpLayout {
        self.layout
    }

    /// The stacked `[L, H, I]` down_proj weights.
    pub fn down(&self) -> &Tensor {
        &self.down
    }

    /// Whether the forward passes run as device grouped GEMMs (CUDA, bf16 weights, `H` and `I`
    /// multiples of 8, at most 1024 local experts; or fp8 experts).
    pub fn uses_grouped_gemm(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.is_fp8()
                || super::rules::grouped_shape_eligible(
                    self.device(),
                    self.dtype(),
                    self.num_local(),
                    self.hidden_size(),
                    self.intermediate_size(),
                )
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// The device grouped GEMMs' state.
    #[cfg(feature = "cuda")]
    pub(crate) fn grouped_state(&self) -> &super::grouped_state::GroupedState {
        &self.grouped
    }
}
