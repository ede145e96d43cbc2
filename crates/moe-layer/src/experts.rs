//! [`Experts`]: the shard of routed experts one rank holds, with the two expert-GEMM shapes of
//! expert parallelism: rows with their top-k routing (normal mode) and per-expert blocks with
//! row counts (low-latency mode).
//!
//! The weights are stacked once, when the shard is built: `gate_up` `[L, 2I, H]` (each
//! expert's `gate_proj` and `up_proj` rows, [`GateUpLayout::Blocked`] where the grouped GEMMs
//! run, else [`GateUpLayout::Stacked`]) and `down` `[L, H, I]`; each expert's [`Mlp`] is a view
//! of them. On CUDA with bf16 weights (and `H`, `I` multiples of 8) the forward passes run
//! as grouped GEMMs on the device (`crate::grouped`): no routing or count is read by the host.
//! On the CPU (and for other dtypes) each expert runs over its rows, grouped on the host.
//!
//! Block-scaled fp8 checkpoints ([`crate::fp8`]) load as fp8 experts on CUDA (e4m3 weights with
//! their 128 x 128 scales, the gate_up weight [`GateUpLayout::Stacked`], block-scaled fp8
//! grouped GEMMs fed with e4m3 rows and their 1 x 128 scales, [`ExpertInput`]); elsewhere they
//! are dequantized once when the shard is built, exactly as DeepSeek's `weight_dequant`.

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;

use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::fp8::Fp8Weight;
pub use crate::mlp::{GateUpLayout, Mlp};

/// The rows the experts run over: rows in a float dtype, or e4m3 rows with their 1 x 128 f32
/// scales (`[.., H / 128]`, what an fp8 dispatch delivers).
#[derive(Clone, Debug)]
pub struct ExpertInput {
    /// The rows (`[N, H]` or `[L, M, H]`).
    pub x: Tensor,
    /// With e4m3 rows: their scales, one per row per 128 channels.
    pub scales: Option<Tensor>,
}

impl ExpertInput {
    /// Rows in a float dtype.
    pub fn plain(x: &Tensor) -> Self {
        Self {
            x: x.clone(),
            scales: None,
        }
    }

    /// The rows in `dtype` (e4m3 rows dequantized).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        Ok(match &self.scales {
            Some(s) => ep_runtime::cast::per_token_cast_back(&self.x, s, dtype)?,
            None => self.x.to_dtype(dtype)?,
        })
    }
}

/// One routed expert of a block-scaled fp8 checkpoint: its three projections.
#[derive(Clone, Debug)]
pub struct Fp8Expert {
    /// `gate_proj` `[I, H]`.
    pub gate: Fp8Weight,
    /// `up_proj` `[I, H]`.
    pub up: Fp8Weight,
    /// `down_proj` `[H, I]`.
    pub down: Fp8Weight,
}

impl Fp8Expert {
    /// The expert at `vb` (`gate_proj`, `up_proj`, `down_proj`, each with its
    /// `weight_scale_inv`), or `None` when its `gate_proj` has no scales (an unquantized
    /// expert). A projection of an fp8 expert without scales is an error naming it.
    pub fn load(vb: &VarBuilder, h: usize, i: usize) -> Result<Option<Self>> {
        let Some(gate) = Fp8Weight::load(&vb.pp("gate_proj"), i, h)? else {
            return Ok(None);
        };
        let need = |name: &str, n: usize, k: usize| -> Result<Fp8Weight> {
            let pvb = vb.pp(name);
            Fp8Weight::load(&pvb, n, k)?.ok_or_else(|| {
                Error::invalid(
                    "fp8 weight",
                    format!("{}.weight_scale_inv", pvb.prefix()),
                    "is missing: every projection of an fp8 expert needs its scales",
                )
            })
        };
        Ok(Some(Self {
            gate,
            up: need("up_proj", i, h)?,
            down: need("down_proj", h, i)?,
        }))
    }

    /// The expert dequantized to `dtype` ([`Fp8Weight::dequantize`]).
    pub fn dequantize(&self, dtype: DType) -> Result<Mlp> {
        Ok(Mlp::new(
            self.gate.dequantize(dtype)?,
            self.up.dequantize(dtype)?,
            self.down.dequantize(dtype)?,
        )?)
    }
}

/// The block scales of an fp8 shard (the e4m3 weights are [`Experts::gate_up`] and
/// [`Experts::down`]).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Fp8Scales {
    /// `[L, 2I / 128, ceil(H / 128)]`: the gate_proj scales, then the up_proj scales.
    pub(crate) gate_up: Tensor,
    /// `[L, ceil(H / 128), ceil(I / 128)]`.
    pub(crate) down: Tensor,
}

/// The gate_up layout of a shard of `l` experts of `[2I, H]` on `device`: blocked where the
/// grouped GEMMs run (their SwiGLU epilogue reads it), else stacked.
fn weight_layout(device: &Device, dtype: DType, l: usize, h: usize, i: usize) -> GateUpLayout {
    #[cfg(feature = "cuda")]
    if crate::grouped::eligible_shape(device, dtype, l, h, i) {
        return GateUpLayout::Blocked;
    }
    let _ = (device, dtype, l, h, i);
    GateUpLayout::Stacked
}

/// Whether `l` fp8 experts of `[2I, H]` on `device` run on the fp8 grouped GEMMs (else they are
/// dequantized): CUDA, `H` a multiple of 16, `I` of 128 (whole scale blocks per projection),
/// at most 1024 local experts. A CUDA device without fp8 tensor cores (before sm_90) is an
/// error.
fn fp8_eligible(device: &Device, l: usize, h: usize, i: usize) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        let props = *ep_kernels::cuda::Kernels::for_stream(&dev.cuda_stream())?.props();
        if props.compute_capability.0 < 9 {
            return Err(Error::invalid(
                "fp8 experts",
                format!(
                    "a GPU of compute capability {}.{}",
                    props.compute_capability.0, props.compute_capability.1
                ),
                "the fp8 grouped GEMMs need sm_90 (Hopper)",
            ));
        }
        return Ok(fp8_shapes_supported(l, h, i));
    }
    let _ = (device, l, h, i);
    Ok(false)
}

/// Whether the fp8 grouped GEMMs take `l` experts of hidden size `h` and inner width `i`
/// (`h` a multiple of 16, `i` of the 128-wide scale blocks, at most `MAX_GROUPS` groups).
pub(crate) fn fp8_shapes_supported(l: usize, h: usize, i: usize) -> bool {
    h % 16 == 0 && i % ep_kernels::gemm::fp8::FP8_BLOCK == 0 && l <= ep_kernels::gemm::MAX_GROUPS
}

/// The blocks of the routed experts' width `i` that shared experts of width `i_s` run as
/// beside `l` fp8 routed experts (extra groups of their GEMMs), or `None` where they cannot
/// (their width not a multiple of `i`, or too many groups): the layer then runs their float MLP
/// only.
pub(crate) fn shared_fp8_blocks(l: usize, i: usize, i_s: usize) -> Option<usize> {
    (i > 0 && i_s % i == 0 && l + i_s / i <= ep_kernels::gemm::MAX_GROUPS).then_some(i_s / i)
}

/// Bytes of a tensor's elements.
pub(crate) fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// The routed experts `first_expert .. first_expert + num_local` that one rank holds.
#[derive(Clone, Debug)]
pub struct Experts {
    first_expert: usize,
    /// `[L, 2I, H]`: the gate_proj and up_proj rows of every expert, in `layout`.
    gate_up: Tensor,
    layout: GateUpLayout,
    /// `[L, H, I]`.
    down: Tensor,
    /// With e4m3 weights (fp8 experts on CUDA): their block scales.
    fp8: Option<Fp8Scales>,
    /// Views of the stacked weights, one per expert (none for fp8 experts, which run on the
    /// grouped GEMMs only).
    experts: Vec<Mlp>,
    /// The device grouped GEMMs' state (CUDA, bf16), created on first use.
    #[cfg(feature = "cuda")]
    grouped: std::sync::Arc<crate::grouped::GroupedState>,
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
                .map(|e| crate::mlp::relaid_gate_up(&gate_up.get(e)?, layout, target))
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
    /// `first_expert + l`. Where fp8 grouped GEMMs run (CUDA on sm_90, `H` a multiple of 16,
    /// `I` of 128, at most 1024 local experts) the shard keeps the e4m3 weights and their scales
    /// (gate_up stacked: the gate rows, then the up rows, so that no scale block mixes them);
    /// elsewhere every expert is dequantized to `dtype` ([`Fp8Expert::dequantize`]) and the
    /// shard is a plain one.
    pub fn from_fp8(first_expert: usize, experts: Vec<Fp8Expert>, dtype: DType) -> Result<Self> {
        let Some(first) = experts.first() else {
            return Err(Error::invalid(
                "experts",
                "[]",
                "at least one local expert is needed",
            ));
        };
        let (i, h) = first.gate.dims();
        for (l, e) in experts.iter().enumerate() {
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
        }
        let device = first.gate.q().device().clone();
        if !fp8_eligible(&device, experts.len(), h, i)? {
            let mlps = experts
                .iter()
                .map(|e| e.dequantize(dtype))
                .collect::<Result<Vec<_>>>()?;
            return Self::new(first_expert, mlps);
        }
        let l = experts.len();
        // One expert at a time into the stacks (memory: the stacks plus one expert).
        let gate_up = Tensor::zeros((l, 2 * i, h), DType::F8E4M3, &device)?;
        let down = Tensor::zeros((l, h, i), DType::F8E4M3, &device)?;
        let mut gate_up_scales = Vec::with_capacity(l);
        let mut down_scales = Vec::with_capacity(l);
        for (e, x) in experts.iter().enumerate() {
            let gu = Tensor::cat(&[x.gate.q(), x.up.q()], 0)?;
            gate_up.slice_set(&gu.unsqueeze(0)?, 0, e)?;
            down.slice_set(&x.down.q().unsqueeze(0)?, 0, e)?;
            gate_up_scales.push(Tensor::cat(&[x.gate.scale(), x.up.scale()], 0)?);
            down_scales.push(x.down.scale().clone());
        }
        Ok(Self {
            first_expert,
            gate_up,
            layout: GateUpLayout::Stacked,
            down,
            fp8: Some(Fp8Scales {
                gate_up: Tensor::stack(&gate_up_scales, 0)?.contiguous()?,
                down: Tensor::stack(&down_scales, 0)?.contiguous()?,
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
        cfg.validate()?;
        if num_local == 0 {
            return Err(Error::invalid(
                "num_local",
                0,
                "at least one local expert is needed",
            ));
        }
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
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        if Fp8Expert::load(&vb.pp(first_expert), h, i)?.is_some() {
            let experts = (first_expert..end)
                .map(|e| {
                    Fp8Expert::load(&vb.pp(e), h, i)?.ok_or_else(|| {
                        Error::invalid(
                            "experts",
                            format!("expert {e} without weight_scale_inv"),
                            format!("must be fp8 like expert {first_expert}"),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            return Self::from_fp8(first_expert, experts, vb.dtype());
        }
        let mut stacked: Option<(Tensor, Tensor)> = None;
        let mut layout = GateUpLayout::Stacked;
        for (l, e) in (first_expert..end).enumerate() {
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
        Self::from_parts(first_expert, gate_up, layout, down)
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
            self.is_fp8() || crate::grouped::eligible(self)
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// The device grouped GEMMs' state.
    #[cfg(feature = "cuda")]
    pub(crate) fn grouped_state(&self) -> &crate::grouped::GroupedState {
        &self.grouped
    }

    /// Checks `x: [N, H]`, `topk_idx_local: [N, K]`, `topk_weights: [N, K]`; returns `(N, K)`.
    fn check_routed(&self, x: &Tensor, idx: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
        let h = self.hidden_size();
        let n = match x.dims2() {
            Ok((n, xh)) if xh == h => n,
            _ => {
                return Err(Error::invalid(
                    "x",
                    format!("shape {:?}", x.dims()),
                    format!("must be [tokens, hidden_size = {h}]"),
                ))
            }
        };
        let k = match idx.dims2() {
            Ok((ni, k)) if ni == n => k,
            _ => {
                return Err(Error::invalid(
                    "topk_idx_local",
                    format!("shape {:?}", idx.dims()),
                    format!("must be [{n}, K] like x"),
                ))
            }
        };
        if w.dims() != [n, k] {
            return Err(Error::invalid(
                "topk_weights",
                format!("shape {:?}", w.dims()),
                format!("must be [{n}, {k}] like topk_idx_local"),
            ));
        }
        Ok((n, k))
    }

    /// Normal-mode grouped GEMM. `x` `[N, H]`, `topk_idx_local` `[N, K]` (i64 local expert ids,
    /// `-1` = not here) and `topk_weights` `[N, K]` (f32). Returns `[N, H]` in `x`'s dtype with
    /// row `n = sum_{k: idx>=0} w[n,k] * expert_{idx[n,k]}(x[n])`.
    ///
    /// With grouped GEMMs ([`Experts::uses_grouped_gemm`]) the rows are permuted to expert-major
    /// order, run through the contiguous grouped GEMMs and summed back on the device (an id
    /// outside `-1..L` traps there); otherwise rows are grouped on the host.
    pub fn forward_grouped(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
    ) -> Result<Tensor> {
        self.forward_grouped_rows(x, topk_idx_local, topk_weights, None)
    }

    /// [`Experts::forward_grouped`] when the rows each local expert receives are known on the
    /// host, as a normal-mode dispatch reports them
    /// (`DispatchOutput::num_recv_tokens_per_expert`, DeepEP's `num_recv_tokens_per_expert_list`):
    /// the grouped GEMMs are then sized for those rows instead of every (token, slot) pair
    /// `topk_idx_local` could hold (at EP4 about a third of them), which matters to a grid of
    /// one CTA per tile ([`ep_kernels::gemm::GemmGrid::PerTile`]). `counts` must be the routing's
    /// own counts, one per local expert: too few rows for the routing stop the GEMMs on the
    /// device (a trap naming the group), which a caller must not risk with counts of other
    /// routing.
    pub fn forward_grouped_counted(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        counts: &[usize],
    ) -> Result<Tensor> {
        if counts.len() != self.num_local() {
            return Err(Error::invalid(
                "counts",
                format!("{} counts", counts.len()),
                format!("must hold one per local expert ({})", self.num_local()),
            ));
        }
        self.forward_grouped_rows(x, topk_idx_local, topk_weights, Some(counts.iter().sum()))
    }

    /// [`Experts::forward_grouped`] over `input`: e4m3 rows with their scales (an fp8
    /// dispatch's) go to fp8 experts as they are and are dequantized to `dtype` for float
    /// experts; float rows go to fp8 experts quantized once on the device. `counts`: the rows
    /// each local expert receives when known on the host (as for
    /// [`Experts::forward_grouped_counted`]). Returns `[N, H]` in `dtype`.
    pub fn forward_grouped_input(
        &self,
        input: &ExpertInput,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        counts: Option<&[usize]>,
        dtype: DType,
    ) -> Result<Tensor> {
        if let Some(c) = counts.filter(|c| c.len() != self.num_local()) {
            return Err(Error::invalid(
                "counts",
                format!("{} counts", c.len()),
                format!("must hold one per local expert ({})", self.num_local()),
            ));
        }
        let rows = counts.map(|c| c.iter().sum());
        if !self.is_fp8() {
            let x = input.to_dtype(dtype)?;
            return self.forward_grouped_rows(&x, topk_idx_local, topk_weights, rows);
        }
        self.forward_fp8_routed(input, topk_idx_local, topk_weights, rows, dtype)
    }

    /// The fp8 experts' normal-mode forward (CUDA), `rows` the routing's pairs when known.
    fn forward_fp8_routed(
        &self,
        input: &ExpertInput,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        rows: Option<usize>,
        dtype: DType,
    ) -> Result<Tensor> {
        let (n, k) = self.check_routed(&input.x, topk_idx_local, topk_weights)?;
        let (h, dev) = (self.hidden_size(), input.x.device());
        if n == 0 {
            return Ok(crate::empty::empty((0, h), dtype, dev)?);
        }
        if k == 0 {
            return Ok(Tensor::zeros((n, h), dtype, dev)?);
        }
        #[cfg(feature = "cuda")]
        {
            let y = crate::grouped_fp8::forward_routed(
                self,
                input,
                topk_idx_local,
                topk_weights,
                rows,
            )?;
            Ok(y.to_dtype(dtype)?)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = rows;
            unreachable!("fp8 experts exist on CUDA only")
        }
    }

    /// [`Experts::forward_grouped`] with the rows of the routing when known.
    fn forward_grouped_rows(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        rows: Option<usize>,
    ) -> Result<Tensor> {
        if self.is_fp8() {
            return self.forward_fp8_routed(
                &ExpertInput::plain(x),
                topk_idx_local,
                topk_weights,
                rows,
                x.dtype(),
            );
        }
        let (n, k) = self.check_routed(x, topk_idx_local, topk_weights)?;
        if n == 0 {
            return Ok(crate::empty::empty(
                (0, self.hidden_size()),
                x.dtype(),
                x.device(),
            )?);
        }
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() && k > 0 {
            let y = crate::grouped::forward_routed(self, x, topk_idx_local, topk_weights, rows)?;
            return Ok(y.to_dtype(x.dtype())?);
        }
        let _ = rows; // the host path groups the rows it finds
        let y = self.host_grouped_f32(x, topk_idx_local, topk_weights, n, k)?;
        Ok(y.to_dtype(x.dtype())?)
    }

    /// [`Experts::forward_grouped`] returning f32.
    pub fn forward_grouped_f32(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
    ) -> Result<Tensor> {
        if self.is_fp8() {
            return self.forward_fp8_routed(
                &ExpertInput::plain(x),
                topk_idx_local,
                topk_weights,
                None,
                DType::F32,
            );
        }
        let (n, k) = self.check_routed(x, topk_idx_local, topk_weights)?;
        if n == 0 {
            return Ok(crate::empty::empty(
                (0, self.hidden_size()),
                DType::F32,
                x.device(),
            )?);
        }
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() && k > 0 {
            let y = crate::grouped::forward_routed(self, x, topk_idx_local, topk_weights, None)?;
            return Ok(y.to_dtype(DType::F32)?);
        }
        self.host_grouped_f32(x, topk_idx_local, topk_weights, n, k)
    }

    /// Rows grouped by local expert on the host; each expert runs its SwiGLU once on its rows,
    /// the outputs are scaled by their weights and summed into the result with one `index_add`.
    fn host_grouped_f32(
        &self,
        x: &Tensor,
        topk_idx_local: &Tensor,
        topk_weights: &Tensor,
        n: usize,
        k: usize,
    ) -> Result<Tensor> {
        let (h, dev) = (self.hidden_size(), x.device());
        if k == 0 {
            return Ok(Tensor::zeros((n, h), DType::F32, dev)?);
        }
        let idx: Vec<i64> = topk_idx_local
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1()?;
        let w: Vec<f32> = topk_weights
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let num_local = self.num_local();
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); num_local];
        let mut row_w: Vec<Vec<f32>> = vec![Vec::new(); num_local];
        for (pos, (&e, &wt)) in idx.iter().zip(&w).enumerate() {
            if e == -1 {
                continue;
            }
            if e < 0 || e as usize >= num_local {
                return Err(Error::invalid(
                    "topk_idx_local",
                    format!("topk_idx_local[{}, {}] = {e}", pos / k, pos % k),
                    format!("must be -1 or a local expert id below num_local = {num_local}"),
                ));
            }
            rows[e as usize].push((pos / k) as u32);
            row_w[e as usize].push(wt);
        }
        let mut all_rows = Vec::new();
        let mut outputs = Vec::new();
        for (l, (r, wl)) in rows.into_iter().zip(row_w).enumerate() {
            if r.is_empty() {
                continue;
            }
            let count = r.len();
            let ids = Tensor::from_vec(r, count, dev)?;
            let xs = x.index_select(&ids, 0)?;
            let ys = self.experts[l].forward(&xs)?.to_dtype(DType::F32)?;
            let scale = Tensor::from_vec(wl, (count, 1), dev)?;
            outputs.push(ys.broadcast_mul(&scale)?);
            all_rows.push(ids);
        }
        let acc = Tensor::zeros((n, h), DType::F32, dev)?;
        if outputs.is_empty() {
            return Ok(acc);
        }
        let ids = Tensor::cat(&all_rows, 0)?;
        let ys = Tensor::cat(&outputs, 0)?;
        Ok(acc.index_add(&ids, &ys, 0)?)
    }

    /// Checks `x: [L, M, H]`; returns `M`.
    fn check_blocks(&self, x: &Tensor, what: &'static str) -> Result<usize> {
        match x.dims3() {
            Ok((l, m, h)) if l == self.num_local() && h == self.hidden_size() => Ok(m),
            _ => Err(Error::invalid(
                what,
                format!("shape {:?}", x.dims()),
                format!(
                    "must be [num_local = {}, max_rows, hidden_size = {}]",
                    self.num_local(),
                    self.hidden_size()
                ),
            )),
        }
    }

    /// Low-latency-mode expert GEMM on packed blocks with host counts: `x` `[L, M, H]`,
    /// `counts[l]` valid rows of block `l`. Returns `[L, M, H]` in `x`'s dtype where row
    /// `m < counts[l]` of block `l` is `expert_l(x[l, m])` and the rows past `counts[l]` are
    /// zero.
    pub fn forward_packed(&self, x: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let m = self.check_blocks(x, "x")?;
        let l = self.num_local();
        if counts.len() != l {
            return Err(Error::invalid(
                "counts",
                format!("{} entries", counts.len()),
                format!("must have num_local = {l}"),
            ));
        }
        if let Some((e, &c)) = counts.iter().enumerate().find(|(_, &c)| c > m) {
            return Err(Error::invalid(
                "counts",
                format!("counts[{e}] = {c}"),
                format!("must be <= the block size max_rows = {m}"),
            ));
        }
        let dev = x.device();
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() {
            let c: Vec<i32> = counts.iter().map(|&c| c as i32).collect();
            let counts_dev = Tensor::from_vec(c, l, dev)?;
            let most = counts.iter().copied().max().unwrap_or(0);
            let tiles = crate::grouped::masked_tiles(dev, most)?;
            let y =
                self.forward_masked_input(&ExpertInput::plain(x), &counts_dev, tiles, DType::BF16)?;
            // Rows past the counts: zero, as documented.
            let rows = Tensor::arange(0u32, m as u32, dev)?.reshape((1, m, 1))?;
            let limit = Tensor::from_vec(
                counts.iter().map(|&c| c as u32).collect::<Vec<_>>(),
                (l, 1, 1),
                dev,
            )?;
            let keep = rows.broadcast_lt(&limit)?;
            let zeros = Tensor::zeros(y.dims(), y.dtype(), dev)?;
            return Ok(keep
                .broadcast_as(y.dims())?
                .where_cond(&y, &zeros)?
                .to_dtype(x.dtype())?);
        }
        let h = self.hidden_size();
        let mut blocks = Vec::with_capacity(l);
        for (e, &c) in counts.iter().enumerate() {
            let block = if c == 0 {
                Tensor::zeros((m, h), x.dtype(), dev)?
            } else {
                let y = self.experts[e].forward(&x.get(e)?.narrow(0, 0, c)?)?;
                if c < m {
                    y.pad_with_zeros(D::Minus2, 0, m - c)?
                } else {
                    y
                }
            };
            blocks.push(block);
        }
        Ok(Tensor::stack(&blocks, 0)?)
    }

    /// Low-latency-mode expert GEMM with the counts on the device (the low-latency dispatch's
    /// `recv_count`): `x` `[L, M, H]`, `counts` `[L]` i32 on `x`'s device. Returns `[L, M, H]` (bf16 with grouped
    /// GEMMs, else `x`'s dtype) where row `m < counts[l]` of block `l` is `expert_l(x[l, m])`;
    /// **rows past the counts are not written** (their content is unspecified). Nothing is read
    /// back to the host with grouped GEMMs; otherwise the counts are read first.
    pub fn forward_masked(&self, x: &Tensor, counts: &Tensor) -> Result<Tensor> {
        let m = x.dims().get(1).copied().unwrap_or(0);
        self.forward_masked_expecting(x, counts, m)
    }

    /// [`Experts::forward_masked`] told how many valid rows each block is expected to hold at
    /// most (a low-latency step: the tokens per rank times the ranks). The result is the same
    /// for any counts; the hint picks the kernel
    /// ([`ep_kernels::gemm::GemmTiles::for_masked_rows`]: on GPUs of moderate bandwidth per SM,
    /// up to [`ep_kernels::gemm::GEMV_ROWS_PER_PASS`] rows, the grouped GEMMs stream each
    /// active expert's weights once without tiles).
    pub fn forward_masked_expecting(
        &self,
        x: &Tensor,
        counts: &Tensor,
        expected_rows: usize,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() {
            let tiles = crate::grouped::masked_tiles(x.device(), expected_rows)?;
            return self.forward_masked_tiled(x, counts, tiles);
        }
        let _ = expected_rows;
        self.forward_masked_tiled(x, counts, ep_kernels::gemm::GemmTiles::Auto)
    }

    /// [`Experts::forward_masked`] over `input` (`[L, M, H]`: e4m3 rows with `[L, M, H / 128]`
    /// scales, or float rows; converted as for [`Experts::forward_grouped_input`]) with the
    /// grouped GEMMs' configuration `tiles`. Returns `[L, M, H]` in `dtype` (rows past the
    /// counts unwritten).
    pub fn forward_masked_input(
        &self,
        input: &ExpertInput,
        counts: &Tensor,
        tiles: ep_kernels::gemm::GemmTiles,
        dtype: DType,
    ) -> Result<Tensor> {
        if !self.is_fp8() {
            let x = input.to_dtype(dtype)?;
            return Ok(self
                .forward_masked_tiled(&x, counts, tiles)?
                .to_dtype(dtype)?);
        }
        self.check_blocks(&input.x, "x")?;
        let l = self.num_local();
        if counts.dims() != [l] || counts.dtype() != DType::I32 {
            return Err(Error::invalid(
                "counts",
                format!("a {:?} tensor of shape {:?}", counts.dtype(), counts.dims()),
                format!("must be i32 [num_local = {l}]"),
            ));
        }
        #[cfg(feature = "cuda")]
        {
            let (y, _) = crate::grouped_fp8::forward_masked(self, input, counts, None, tiles)?;
            Ok(y.to_dtype(dtype)?)
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("fp8 experts exist on CUDA only")
    }

    /// [`Experts::forward_masked`] with the grouped GEMMs' configuration `tiles` (used on CUDA
    /// with grouped GEMMs only).
    pub(crate) fn forward_masked_tiled(
        &self,
        x: &Tensor,
        counts: &Tensor,
        tiles: ep_kernels::gemm::GemmTiles,
    ) -> Result<Tensor> {
        if self.is_fp8() {
            return self.forward_masked_input(&ExpertInput::plain(x), counts, tiles, DType::BF16);
        }
        let m = self.check_blocks(x, "x")?;
        let l = self.num_local();
        if counts.dims() != [l] || counts.dtype() != DType::I32 {
            return Err(Error::invalid(
                "counts",
                format!("a {:?} tensor of shape {:?}", counts.dtype(), counts.dims()),
                format!("must be i32 [num_local = {l}]"),
            ));
        }
        #[cfg(feature = "cuda")]
        if self.uses_grouped_gemm() {
            return crate::grouped::forward_masked(self, x, counts, tiles);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = tiles;
        let host: Vec<i32> = counts.to_vec1()?;
        let host = host
            .iter()
            .enumerate()
            .map(|(e, &c)| {
                usize::try_from(c).ok().filter(|&c| c <= m).ok_or_else(|| {
                    Error::invalid(
                        "counts",
                        format!("counts[{e}] = {c}"),
                        format!("must be in 0..={m}"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.forward_packed(x, &host)
    }
}
