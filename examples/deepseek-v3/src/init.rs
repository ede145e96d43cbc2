//! Random weights made where the model runs (`--init random`): a `VarBuilder` backend that
//! creates every tensor the loader asks for, so a model of any size can be served or benchmarked
//! without writing a checkpoint first.
//!
//! Each tensor is drawn from its own generator, seeded from the run's seed and the tensor's
//! name, so every rank makes the same shared weights (router, attention) and the same experts
//! whatever the number of ranks. On a GPU the numbers come from the device's generator (curand)
//! and never touch the host; on the CPU from a seeded `StdRng`. The two differ, each is
//! deterministic. The scales are the checkpoint generator's (`checkpoint.rs`), so activations
//! stay finite in bf16: linear weights `U(±gain / sqrt(fan_in))`, norms `1 + U(±0.1)`, router
//! bias `U(0, 0.1)`, and `lm_head` rows of tokens that do not read as plain text zeroed.
//!
//! [`RandomInit::fp8`] makes the weights of a block-scaled fp8 checkpoint instead: every linear
//! projection ([`crate::checkpoint::is_fp8_weight`]) as e4m3 values `U(±448)` (rounded to
//! e4m3) with one f32 scale per 128 x 128 block (`weight_scale_inv`) drawn in
//! `U(0.5, 1) * bound / 448`, `bound = 1 / sqrt(128 * ceil(fan_in / 128))`, so that the
//! dequantized weights span what the float init's do, block by block at different scales; the
//! rest as above. A plain [`RandomInit::new`] has no scales, so every weight loads as a float.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tokenizer::plain_text_tokens;

/// How a tensor is drawn, from its name.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InitKind {
    /// `U(±gain / sqrt(fan_in))`, `fan_in` the last dimension.
    Linear(f32),
    /// `1 + U(±0.1)` (RMSNorm weights).
    Norm,
    /// `U(0, 0.1)` (the router's `e_score_correction_bias`).
    RouterBias,
    /// Zeros (projection biases).
    Zeros,
}

impl InitKind {
    /// The kind of the tensor called `name` (Hugging Face DeepSeek-V3 names).
    pub fn of(name: &str) -> Self {
        if name.ends_with("norm.weight") {
            InitKind::Norm
        } else if name.ends_with("e_score_correction_bias") {
            InitKind::RouterBias
        } else if name.ends_with(".bias") {
            InitKind::Zeros
        } else if name == "lm_head.weight" {
            InitKind::Linear(3.0)
        } else {
            InitKind::Linear(1.0)
        }
    }
}

/// A stable 64-bit seed for tensor `name` under run seed `seed` (FNV-1a, then SplitMix64).
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = (h ^ seed).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `U(lo, hi)` of `shape` in f32 on `device`, from a generator seeded with `seed`.
fn uniform(
    seed: u64,
    shape: &Shape,
    lo: f32,
    hi: f32,
    device: &Device,
) -> candle_core::Result<Tensor> {
    if device.is_cpu() {
        let mut rng = StdRng::seed_from_u64(seed);
        let data: Vec<f32> = (0..shape.elem_count())
            .map(|_| rng.random_range(lo..hi))
            .collect();
        Tensor::from_vec(data, shape, device)
    } else {
        // A fresh device generator per tensor: the same numbers whatever was drawn before.
        device.set_seed(seed)?;
        Tensor::rand(lo, hi, shape, device)
    }
}

/// `n` router biases skewed by Zipf exponent `s` ([`RandomInit::with_router_skew`]), the
/// popularity order drawn from `seed`.
fn skewed_bias(seed: u64, n: usize, s: f32, device: &Device) -> candle_core::Result<Tensor> {
    use rand::seq::SliceRandom;
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut bias = vec![0f32; n];
    for (j, &x) in order.iter().enumerate() {
        bias[x] = 0.1 + 0.1 * s * (1.0 / (j + 1) as f32).ln();
    }
    Tensor::from_vec(bias, n, device)
}

/// `x` (f32) as e4m3 values spread over the whole e4m3 range: every 128 consecutive values
/// scaled so that their largest is 448, by the fp8 dispatch's per-token cast (on a GPU its
/// kernel: candle's own f32 -> e4m3 cast is not in its CUDA kernels for every GPU).
fn e4m3_values(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    if n % 128 != 0 {
        if x.device().is_cpu() {
            return (x * f64::from(E4M3_MAX))?.to_dtype(DType::F8E4M3);
        }
        candle_core::bail!("a random fp8 weight of {n} values needs a multiple of 128 on a GPU");
    }
    let rows = x.to_dtype(DType::BF16)?.reshape((n / 128, 128))?;
    let (q, _) = moe_layer::ep_runtime::cast::per_token_cast_to_fp8(&rows, false)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    q.reshape(x.shape())
}

/// The random-weights backend of a `VarBuilder` (see the module docs).
#[derive(Clone, Debug)]
pub struct RandomInit {
    seed: u64,
    fp8: bool,
    /// Zipf exponent of the routers' skew (0: none; [`RandomInit::with_router_skew`]).
    router_skew: f32,
    /// The fp8 weights made so far (a weight read twice counts once).
    fp8_made: Arc<Mutex<HashSet<String>>>,
}

/// The suffix of a block-scaled weight's scales.
const SCALE_SUFFIX: &str = ".weight_scale_inv";
/// Largest finite e4m3 value.
const E4M3_MAX: f32 = 448.0;

impl RandomInit {
    /// Float weights drawn with run seed `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            fp8: false,
            router_skew: 0.0,
            fp8_made: Arc::default(),
        }
    }

    /// Routers whose correction biases make the expert loads lumpy, as real routing is: in
    /// each MoE layer the expert of popularity rank `j` (a random order per layer) gets a bias
    /// of `0.1 + 0.1 s ln(1 / (j + 1))`, which roughly gives Zipf(`s`) loads (the bias only
    /// selects experts; the scores still weight them). `s = 0` keeps the plain biases.
    pub fn with_router_skew(mut self, s: f32) -> Self {
        self.router_skew = s;
        self
    }

    /// Weights drawn with run seed `seed`, every linear projection block-scaled fp8.
    pub fn fp8(seed: u64) -> Self {
        Self {
            fp8: true,
            ..Self::new(seed)
        }
    }

    /// How many fp8 weights this backend (and its clones) has made.
    pub fn fp8_weights_made(&self) -> usize {
        self.fp8_made.lock().map_or(0, |m| m.len())
    }

    /// Whether tensor `name` is the scales of a block-scaled weight this backend makes.
    fn has_scales(&self, name: &str) -> bool {
        self.fp8
            && name
                .strip_suffix(SCALE_SUFFIX)
                .is_some_and(|p| crate::checkpoint::is_fp8_weight(&format!("{p}.weight")))
    }

    /// Tensor `name` of `shape` in `dtype`: an e4m3 projection or its scales (fp8 mode), or
    /// [`RandomInit::tensor`] converted.
    fn make(
        &self,
        name: &str,
        shape: &Shape,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let seed = tensor_seed(self.seed, name);
        if self.has_scales(name) {
            let cols = shape.dims().last().copied().unwrap_or(1).max(1);
            let bound = 1.0 / ((128 * cols) as f32).sqrt() / E4M3_MAX;
            return uniform(seed, shape, 0.5 * bound, bound, device)?.to_dtype(dtype);
        }
        let scaled = name
            .strip_suffix(".weight")
            .is_some_and(|p| self.has_scales(&format!("{p}{SCALE_SUFFIX}")));
        if scaled && dtype == DType::F8E4M3 {
            if let Ok(mut made) = self.fp8_made.lock() {
                made.insert(name.to_string());
            }
            return e4m3_values(&uniform(seed, shape, -1.0, 1.0, device)?);
        }
        self.tensor(name, shape, device)?.to_dtype(dtype)
    }

    /// Tensor `name` of `shape`, in f32.
    pub fn tensor(
        &self,
        name: &str,
        shape: &Shape,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let seed = tensor_seed(self.seed, name);
        let fan_in = shape.dims().last().copied().unwrap_or(1).max(1) as f32;
        let t = match InitKind::of(name) {
            InitKind::Linear(gain) => {
                let bound = gain / fan_in.sqrt();
                uniform(seed, shape, -bound, bound, device)?
            }
            InitKind::Norm => uniform(seed, shape, 0.9, 1.1, device)?,
            InitKind::RouterBias if self.router_skew > 0.0 => {
                skewed_bias(seed, shape.elem_count(), self.router_skew, device)?
            }
            InitKind::RouterBias => uniform(seed, shape, 0.0, 0.1, device)?,
            InitKind::Zeros => Tensor::zeros(shape, DType::F32, device)?,
        };
        if name == "lm_head.weight" {
            // As the generator does: only tokens that read as plain text get logits.
            let rows = shape.dims()[0];
            let keep: Vec<f32> = plain_text_tokens(rows)
                .into_iter()
                .map(|k| if k { 1.0 } else { 0.0 })
                .collect();
            let keep = Tensor::from_vec(keep, (rows, 1), device)?;
            return t.broadcast_mul(&keep);
        }
        Ok(t)
    }
}

impl SimpleBackend for RandomInit {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _hints: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.make(name, &s, dtype, dev)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        candle_core::bail!("random init cannot make {name} without knowing its shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        !name.ends_with(SCALE_SUFFIX) || self.has_scales(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skewed_router_bias_ranks_the_experts_by_a_zipf_law() {
        let name = "model.layers.2.mlp.gate.e_score_correction_bias";
        let shape = Shape::from(64);
        let init = RandomInit::new(3).with_router_skew(1.0);
        let b: Vec<f32> = init
            .tensor(name, &shape, &Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut sorted = b.clone();
        sorted.sort_by(|x, y| y.total_cmp(x));
        // Popularity rank j gets 0.1 + 0.1 ln(1 / (j + 1)).
        for (j, v) in sorted.iter().enumerate() {
            let want = 0.1 + 0.1 * (1.0 / (j + 1) as f32).ln();
            assert!((v - want).abs() < 1e-6, "rank {j}: {v} vs {want}");
        }
        // The same seed gives the same order; another layer another.
        let again: Vec<f32> = init
            .tensor(name, &shape, &Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(b, again);
        let other: Vec<f32> = init
            .tensor(
                "model.layers.3.mlp.gate.e_score_correction_bias",
                &shape,
                &Device::Cpu,
            )
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_ne!(b, other);
    }

    #[test]
    fn kinds_follow_the_names() {
        assert_eq!(
            InitKind::of("model.layers.0.input_layernorm.weight"),
            InitKind::Norm
        );
        assert_eq!(InitKind::of("model.norm.weight"), InitKind::Norm);
        assert_eq!(
            InitKind::of("model.layers.3.mlp.gate.e_score_correction_bias"),
            InitKind::RouterBias
        );
        assert_eq!(InitKind::of("lm_head.weight"), InitKind::Linear(3.0));
        assert_eq!(
            InitKind::of("model.layers.1.mlp.experts.5.up_proj.weight"),
            InitKind::Linear(1.0)
        );
        assert_eq!(
            InitKind::of("model.layers.1.self_attn.o_proj.bias"),
            InitKind::Zeros
        );
    }

    #[test]
    fn tensors_depend_on_seed_and_name_only() {
        let init = RandomInit::new(7);
        let shape = Shape::from((16, 64));
        let name = "model.layers.2.mlp.experts.3.gate_proj.weight";
        let a = init.tensor(name, &shape, &Device::Cpu).unwrap();
        // Another tensor drawn in between does not change it.
        init.tensor("model.embed_tokens.weight", &shape, &Device::Cpu)
            .unwrap();
        let b = init.tensor(name, &shape, &Device::Cpu).unwrap();
        let (a, b) = (a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        assert_eq!(a, b);
        let bound = 1.0 / 8.0;
        assert!(
            a.iter().flatten().all(|x| x.abs() <= bound),
            "out of ±{bound}"
        );
        let other = RandomInit::new(8)
            .tensor(name, &shape, &Device::Cpu)
            .unwrap();
        assert_ne!(other.to_vec2::<f32>().unwrap(), a);
        assert_ne!(tensor_seed(7, "a"), tensor_seed(7, "b"));
    }

    #[test]
    fn only_fp8_mode_makes_scales_and_only_for_projections() {
        let plain = RandomInit::new(3);
        let fp8 = RandomInit::fp8(3);
        let proj = "model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv";
        let attn = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv";
        assert!(!plain.contains_tensor(proj), "a float init has no scales");
        assert!(fp8.contains_tensor(proj) && fp8.contains_tensor(attn));
        for other in [
            "model.layers.1.mlp.gate.weight_scale_inv",
            "lm_head.weight_scale_inv",
            "model.embed_tokens.weight_scale_inv",
        ] {
            assert!(!fp8.contains_tensor(other), "{other}");
        }
        assert!(fp8.contains_tensor("model.layers.1.mlp.gate.weight"));
    }

    #[test]
    fn fp8_weights_dequantize_within_the_float_bound() {
        use moe_layer::fp8::Fp8Weight;
        let init = RandomInit::fp8(9);
        let vb =
            candle_nn::VarBuilder::from_backend(Box::new(init.clone()), DType::F32, Device::Cpu);
        let (n, k) = (200, 300);
        let w = Fp8Weight::load(&vb.pp("model.layers.0.mlp.down_proj"), n, k)
            .unwrap()
            .expect("fp8 mode makes scales");
        assert_eq!(w.q().dtype(), DType::F8E4M3);
        assert_eq!(init.fp8_weights_made(), 1);
        let deq = w.dequantize(DType::F32).unwrap().flatten_all().unwrap();
        let deq = deq.to_vec1::<f32>().unwrap();
        // bound = 1 / sqrt(128 * ceil(300 / 128)) = 1 / sqrt(384).
        let bound = 1.0 / 384f32.sqrt();
        let amax = deq.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            amax <= bound && amax > 0.3 * bound,
            "amax {amax}, bound {bound}"
        );
        // The float init reads the same weight as a float without scales.
        let plain = candle_nn::VarBuilder::from_backend(
            Box::new(RandomInit::new(9)),
            DType::F32,
            Device::Cpu,
        );
        assert!(
            Fp8Weight::load(&plain.pp("model.layers.0.mlp.down_proj"), n, k)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn lm_head_rows_of_control_bytes_are_zero() {
        let init = RandomInit::new(1);
        let t = init
            .tensor("lm_head.weight", &Shape::from((320, 8)), &Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let plain = plain_text_tokens(320);
        for (row, keep) in t.iter().zip(plain) {
            assert_eq!(row.iter().any(|&x| x != 0.0), keep);
        }
    }
}
