//! What the layer's GPU tests share: configurations, random weights under the HF names, and
//! the relative error of an output against its reference.

#![allow(dead_code)]

pub mod fp8;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use moe_layer::config::{MoeConfig, ScoringFunc, TopkMethod};
use moe_layer::ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
use moe_layer::MoeLayer;

pub type R<T> = Result<T, Box<dyn std::error::Error>>;

/// A DeepSeek-V3-style configuration (sigmoid scores, `noaux_tc`, one shared expert).
pub fn cfg(h: usize, i: usize, e: usize, k: usize, groups: (usize, usize)) -> MoeConfig {
    MoeConfig {
        hidden_size: h,
        moe_intermediate_size: i,
        n_routed_experts: e,
        num_experts_per_tok: k,
        n_shared_experts: Some(1),
        n_group: groups.0,
        topk_group: groups.1,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        scoring_func: ScoringFunc::Sigmoid,
        topk_method: TopkMethod::NoauxTc,
    }
}

/// Random layer weights (bf16-rounded f32 on the CPU) under the HF names of `mlp.`.
pub fn weights(c: &MoeConfig, hot: bool) -> R<HashMap<String, Tensor>> {
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let cpu = Device::Cpu;
    let rnd = |shape: &[usize], std: f32| -> R<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, &cpu)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?)
    };
    let mut m = HashMap::new();
    m.insert("gate.weight".to_string(), rnd(&[e, h], 0.05)?);
    let mut bias = Tensor::randn(0f32, 0.1, e, &cpu)?.to_vec1::<f32>()?;
    if hot {
        bias[0] = 10.0;
    }
    m.insert(
        "gate.e_score_correction_bias".to_string(),
        Tensor::from_vec(bias, e, &cpu)?,
    );
    let std_in = 1.0 / (h as f32).sqrt();
    let std_out = 1.0 / (i as f32).sqrt();
    for x in 0..e {
        m.insert(
            format!("experts.{x}.gate_proj.weight"),
            rnd(&[i, h], std_in)?,
        );
        m.insert(format!("experts.{x}.up_proj.weight"), rnd(&[i, h], std_in)?);
        m.insert(
            format!("experts.{x}.down_proj.weight"),
            rnd(&[h, i], std_out)?,
        );
    }
    let si = c.shared_intermediate_size().ok_or("no shared expert")?;
    m.insert(
        "shared_experts.gate_proj.weight".into(),
        rnd(&[si, h], std_in)?,
    );
    m.insert(
        "shared_experts.up_proj.weight".into(),
        rnd(&[si, h], std_in)?,
    );
    m.insert(
        "shared_experts.down_proj.weight".into(),
        rnd(&[h, si], 1.0 / (si as f32).sqrt())?,
    );
    Ok(m)
}

/// `(||got - want|| / ||want||` over the batch, the worst token's)`; non-finite outputs are
/// errors.
pub fn rel(got: &Tensor, want: &Tensor) -> R<(f64, f64)> {
    let g = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let w = want.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let gv = g.to_vec2::<f32>()?;
    let wv = w.to_vec2::<f32>()?;
    let (mut e2, mut r2, mut worst) = (0f64, 0f64, 0f64);
    for (gr, wr) in gv.iter().zip(&wv) {
        let mut te = 0f64;
        let mut tr = 0f64;
        for (a, b) in gr.iter().zip(wr) {
            if !a.is_finite() {
                return Err(format!("non-finite output {a}").into());
            }
            te += f64::from(a - b).powi(2);
            tr += f64::from(*b).powi(2);
        }
        e2 += te;
        r2 += tr;
        worst = worst.max((te / tr.max(1e-30)).sqrt());
    }
    Ok(((e2 / r2.max(1e-30)).sqrt(), worst))
}

/// `w` on `dev` as a checkpoint holds it: bf16, but the router's correction bias in f32 and
/// an fp8 checkpoint's e4m3 weights and f32 scales as they are.
pub fn on_device(w: &HashMap<String, Tensor>, dev: &Device) -> R<HashMap<String, Tensor>> {
    Ok(w.iter()
        .map(|(k, v)| {
            let as_stored = k.ends_with("e_score_correction_bias")
                || k.ends_with("_scale_inv")
                || v.dtype() == DType::F8E4M3;
            let v = if as_stored {
                v.to_device(dev)
            } else {
                v.to_dtype(DType::BF16).and_then(|t| t.to_device(dev))
            };
            v.map(|t| (k.clone(), t))
        })
        .collect::<candle_core::Result<_>>()?)
}

/// The reference output for `gpu`'s input `x`: `cpu`'s experts (f32, all of them) with the
/// routing `gpu`'s router chose, plus its shared experts; with fp8 dispatch, on the tokens as
/// the fp8 round trip leaves them.
pub fn reference(gpu: &MoeLayer, cpu: &MoeLayer, x: &Tensor) -> R<Tensor> {
    let routing = gpu.router().forward(x)?;
    let xc = x.to_device(&Device::Cpu)?;
    let sent = if gpu.options().fp8_dispatch {
        let (q, s) = per_token_cast_to_fp8(&xc, false)?;
        per_token_cast_back(&q, &s, DType::F32)?
    } else {
        xc.to_dtype(DType::F32)?
    };
    let idx = routing.topk_idx.to_device(&Device::Cpu)?;
    let w = routing.topk_weights.to_device(&Device::Cpu)?;
    let y = cpu.experts().forward_grouped_f32(&sent, &idx, &w)?;
    let shared = cpu.shared().ok_or("no shared expert")?;
    Ok((y + shared.forward(&xc.to_dtype(DType::F32)?)?)?)
}
