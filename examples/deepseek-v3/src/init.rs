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

/// The random-weights backend of a `VarBuilder` (see the module docs).
#[derive(Clone, Debug)]
pub struct RandomInit {
    seed: u64,
}

impl RandomInit {
    /// Weights drawn with run seed `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
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
        self.tensor(name, &s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        candle_core::bail!("random init cannot make {name} without knowing its shape")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
