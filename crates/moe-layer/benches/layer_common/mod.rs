//! What the layer benchmarks share: DeepSeek-V3's MoE shapes and a rank's layer over random
//! weights.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use moe_layer::config::{MoeConfig, ScoringFunc, TopkMethod};
use moe_layer::ep_runtime::Buffer;
use moe_layer::fp8::Fp8Weight;
use moe_layer::{Experts, Fp8Expert, Mlp, MoeLayer, MoeLayerOptions, Router};

#[allow(dead_code)] // not every benchmark times with it
pub mod timing;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub const H: usize = 7168;
pub const I: usize = 2048;
pub const E: usize = 256;
pub const K: usize = 8;
pub const LL_MAX: usize = 128;

pub fn config() -> MoeConfig {
    MoeConfig {
        hidden_size: H,
        moe_intermediate_size: I,
        n_routed_experts: E,
        num_experts_per_tok: K,
        n_shared_experts: Some(1),
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        scoring_func: ScoringFunc::Sigmoid,
        topk_method: TopkMethod::NoauxTc,
    }
}

/// Random bf16 `[shape]` on `dev`, built in chunks along dim 0.
pub fn randn_bf16(dev: &Device, shape: &[usize], std: f32) -> Result<Tensor, BoxError> {
    let per: usize = shape[1..].iter().product();
    let chunk = ((1usize << 28) / per.max(1)).max(1);
    let mut parts = Vec::new();
    let mut done = 0;
    while done < shape[0] {
        let n = chunk.min(shape[0] - done);
        let mut s = shape.to_vec();
        s[0] = n;
        parts.push(Tensor::randn(0f32, std, s, dev)?.to_dtype(DType::BF16)?);
        done += n;
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// A random `[n, k]` block-scaled fp8 weight on `dev`: `pattern` (a quantized normal weight's e4m3 values,
/// shared by every weight) and random scales.
fn fp8_weight(dev: &Device, pattern: &Tensor, n: usize, k: usize) -> Result<Fp8Weight, BoxError> {
    let q = pattern.narrow(0, 0, n * k)?.reshape((n, k))?;
    let scale = (Tensor::rand(0.5f32, 2.0, (n.div_ceil(128), k.div_ceil(128)), dev)? * 1e-4)?;
    Ok(Fp8Weight::new("bench", q, scale)?)
}

/// [`build_layer`] with block-scaled fp8 routed and shared experts (DeepSeek-V3's release
/// format: e4m3 weights with 128 x 128 scales), the router as in [`build_layer`].
pub fn build_layer_fp8(
    dev: &Device,
    buffer: Arc<Buffer>,
    opts: MoeLayerOptions,
) -> Result<MoeLayer, BoxError> {
    let (router, shared) = router_and_shared(dev)?;
    let topo = buffer.topology();
    let l = E / topo.num_ranks;
    // Values of a quantized normal weight (random bit patterns would draw more power than a
    // real checkpoint's and run slower on a power-capped GPU).
    let normal = Tensor::randn(0f32, 1.0, 2 * I * H, &Device::Cpu)?.to_vec1::<f32>()?;
    let (bytes, _) = ep_kernels::gemm::fp8::quantize_weight(&normal, 2 * I * H / 128, 128, 128)?;
    let pattern = Tensor::from_vec(bytes, 2 * I * H, dev)?;
    let experts = (0..l)
        .map(|_| {
            Ok(Fp8Expert {
                gate: fp8_weight(dev, &pattern, I, H)?,
                up: fp8_weight(dev, &pattern, I, H)?,
                down: fp8_weight(dev, &pattern, H, I)?,
            })
        })
        .collect::<Result<Vec<_>, BoxError>>()?;
    let experts = Experts::from_fp8(topo.rank * l, experts, DType::BF16)?;
    // The shared expert in fp8 as well (its float MLP stays the layer's fallback).
    let shared_fp8 = Fp8Expert {
        gate: fp8_weight(dev, &pattern, I, H)?,
        up: fp8_weight(dev, &pattern, I, H)?,
        down: fp8_weight(dev, &pattern, H, I)?,
    };
    Ok(MoeLayer::new(router, experts, Some(shared), buffer, opts)?.with_fp8_shared(&shared_fp8)?)
}

/// The router and the shared expert of [`build_layer`] (seeded alike on every rank by the
/// caller's order of draws).
fn router_and_shared(dev: &Device) -> Result<(Router, Mlp), BoxError> {
    let cfg = config();
    // Logits of unit scale (a gate of std 1/sqrt(H) on unit-scale tokens): routing spread over
    // the experts as a trained DeepSeek-V3 router's is; larger logits saturate the sigmoid and
    // the bias alone would pick the same experts for every token.
    // bf16 values, as DeepSeek-V3's checkpoints store the gate (the router then computes the
    // logits of many tokens on the tensor cores; an f32 gate takes the f32 GEMM).
    let gate = Tensor::randn(0f32, 1.0 / (H as f32).sqrt(), (E, H), &Device::Cpu)?
        .to_dtype(DType::BF16)?
        .to_device(dev)?;
    let bias = Tensor::randn(0f32, 0.01, E, &Device::Cpu)?.to_device(dev)?;
    let router = Router::new(gate, Some(bias), &cfg)?;
    let std_in = 1.0 / (H as f32).sqrt();
    let std_out = 1.0 / (I as f32).sqrt();
    let shared = Mlp::new(
        randn_bf16(dev, &[I, H], std_in)?,
        randn_bf16(dev, &[I, H], std_in)?,
        randn_bf16(dev, &[H, I], std_out)?,
    )?;
    Ok((router, shared))
}

/// This rank's layer over random weights (router and shared expert seeded alike on every rank).
pub fn build_layer(
    dev: &Device,
    buffer: Arc<Buffer>,
    opts: MoeLayerOptions,
) -> Result<MoeLayer, BoxError> {
    let (router, shared) = router_and_shared(dev)?;
    let topo = buffer.topology();
    let l = E / topo.num_ranks;
    let std_in = 1.0 / (H as f32).sqrt();
    let std_out = 1.0 / (I as f32).sqrt();
    let experts = Experts::from_stacked(
        topo.rank * l,
        randn_bf16(dev, &[l, 2 * I, H], std_in)?,
        randn_bf16(dev, &[l, H, I], std_out)?,
    )?;
    Ok(MoeLayer::new(router, experts, Some(shared), buffer, opts)?)
}
