//! The fp8 layer's reference, shared by the GPU tests of fp8 experts: a block-scaled fp8
//! checkpoint made from random weights, and the CPU computation of what the fp8 path computes.
//!
//! The reference: the CPU layer loaded from the same checkpoint (its experts dequantized
//! exactly, DeepSeek's `weight_dequant`), run with the routing the GPU router chose, and with
//! the activations quantized where the fp8 experts quantize them: each token's row 1 x 128
//! (the per-token cast's host twin, bit for bit the device's), the gate_up product rounded to
//! bf16 (the GEMM's output), and `act = silu(gate) * up` quantized 1 x 128 (the host twin of
//! the SwiGLU pass); products in f32. The shared experts (fp8 too, on the GPU as blocks of the
//! routed experts' width) are emulated the same way, with weight 1.
//!
//! Tolerances ([`TOLERANCE`]): what is left is the fp8 tensor cores' own accumulation (about
//! 14 bits of mantissa between two promotions to f32, every 128 channels) and summation order,
//! which move the gate_up products by a bf16 step here and there, and an `act` value that then
//! rounds to the neighbouring e4m3 value moves by up to 1/8 of itself (3 mantissa bits).
//! DeepGEMM's accuracy measure `1 - 2<x, y> / (<x, x> + <y, y>)` of these bounds is below
//! 3.2e-4, under its 1e-3.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use ep_kernels::gemm::fp8::{quantize_weight, swiglu_quantize};
use half::bf16;
use moe_layer::ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
use moe_layer::MoeLayer;

use super::R;

/// `||got - ref|| / ||ref||` over the batch and per token; the batch bound holds from
/// [`BATCH_BOUND_FROM`] tokens on (a batch of a few tokens is as noisy as one token).
pub const TOLERANCE: (f64, f64) = (2.5e-2, 5e-2);

/// Tokens from which a step's error is held to the batch bound of [`TOLERANCE`].
pub const BATCH_BOUND_FROM: usize = 8;

/// Whether an fp8 step of `t` tokens with these relative errors is within [`TOLERANCE`].
pub fn within(t: usize, all: f64, worst: f64) -> bool {
    (t < BATCH_BOUND_FROM || all <= TOLERANCE.0) && worst <= TOLERANCE.1
}

/// `w` as a block-scaled fp8 checkpoint holds it: every projection e4m3 with its 128 x 128
/// scales (quantized from the random weights), the router as stored.
pub fn checkpoint(w: &HashMap<String, Tensor>) -> R<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (name, t) in w {
        if name.ends_with("_proj.weight") {
            let (n, k) = t.dims2()?;
            let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
            let (q, s) = quantize_weight(&v, n, k, 128)?;
            out.insert(name.clone(), Tensor::from_vec(q, (n, k), &Device::Cpu)?);
            out.insert(
                format!("{name}_scale_inv"),
                Tensor::from_vec(s, (n.div_ceil(128), k.div_ceil(128)), &Device::Cpu)?,
            );
        } else {
            out.insert(name.clone(), t.clone());
        }
    }
    Ok(out)
}

/// The reference for `gpu`'s output on input `x` (see the module docs): `cpu` holds every
/// expert, dequantized from the same checkpoint.
pub fn reference(gpu: &MoeLayer, cpu: &MoeLayer, x: &Tensor) -> R<Tensor> {
    let routing = gpu.router().forward(x)?;
    let idx: Vec<Vec<i64>> = routing
        .topk_idx
        .to_device(&Device::Cpu)?
        .to_dtype(DType::I64)?
        .to_vec2()?;
    let wts: Vec<Vec<f32>> = routing.topk_weights.to_device(&Device::Cpu)?.to_vec2()?;
    let xc = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let (q, s) = per_token_cast_to_fp8(&xc.to_dtype(DType::BF16)?, false)?;
    let xq = per_token_cast_back(&q, &s, DType::F32)?;
    let (t, h) = xq.dims2()?;
    let experts = cpu.experts();
    let i = experts.intermediate_size();
    // Rows `ids` of the quantized tokens through `mlp` as the fp8 path computes them, scaled by
    // `weights`.
    let emulate = |mlp: &moe_layer::Mlp, ids: &Tensor, weights: Vec<f32>| -> R<Tensor> {
        let n = weights.len();
        let width = mlp.intermediate_size();
        let xs = xq.index_select(ids, 0)?;
        // The gate_up GEMM's bf16 output, then SwiGLU quantized as the device pass does.
        let hu: Vec<bf16> = xs
            .matmul(&mlp.gate_up().t()?)?
            .to_dtype(DType::BF16)?
            .flatten_all()?
            .to_vec1()?;
        let mut aq = vec![float8::F8E4M3::ZERO; n * width];
        let mut asc = vec![0f32; n * width / 128];
        swiglu_quantize(&hu, n, width, width, None, &mut aq, &mut asc)?;
        let act = per_token_cast_back(
            &Tensor::from_vec(aq, (n, width), &Device::Cpu)?,
            &Tensor::from_vec(asc, (n, width / 128), &Device::Cpu)?,
            DType::F32,
        )?;
        let y = act.matmul(&mlp.down_proj().t()?)?;
        Ok(y.broadcast_mul(&Tensor::from_vec(weights, (n, 1), &Device::Cpu)?)?)
    };
    let mut out = Tensor::zeros((t, h), DType::F32, &Device::Cpu)?;
    for (e, mlp) in experts.experts().iter().enumerate() {
        let mut rows = Vec::new();
        let mut weights = Vec::new();
        for (tok, (ids, ws)) in idx.iter().zip(&wts).enumerate() {
            for (&id, &w) in ids.iter().zip(ws) {
                if id == e as i64 {
                    rows.push(tok as u32);
                    weights.push(w);
                }
            }
        }
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        let ids = Tensor::from_vec(rows, n, &Device::Cpu)?;
        out = out.index_add(&ids, &emulate(mlp, &ids, weights)?, 0)?;
    }
    // The shared experts, each block of the routed experts' width on its own (the blocks'
    // outputs add up to the MLP's; each block's act is quantized on its own 128 columns).
    let shared = cpu.shared().ok_or("no shared expert")?;
    let si = shared.intermediate_size();
    let all = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
    for j in 0..si / i {
        let gate = shared.gate_up().narrow(0, j * i, i)?;
        let up = shared.gate_up().narrow(0, si + j * i, i)?;
        let down = shared.down_proj().narrow(1, j * i, i)?.contiguous()?;
        let block = moe_layer::Mlp::new(gate, up, down)?;
        out = (out + emulate(&block, &all, vec![1.0; t])?)?;
    }
    Ok(out)
}
