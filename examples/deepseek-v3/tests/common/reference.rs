//! The independent reference the example's model is checked against: every tensor of a
//! checkpoint by name (block-scaled fp8 weights dequantized here from their definition,
//! `f32(q) * scale` per 128 x 128 block), computed step by step without any cache: naive
//! attention over the whole sequence, RoPE from its definition, and the dense single-process
//! MoE (`moe_layer::dense::DenseMoe`). Also the helpers that load the example's model and
//! check its greedy steps against it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use deepseek_v3::config::DeepSeekV3Config;
use deepseek_v3::kv_cache::KvCache;
use deepseek_v3::loader::{self, LoadOptions, LoadedModel, MoeBackend};
use deepseek_v3::model::{SeqInput, StepKind};
use deepseek_v3::sampling::argmax;
use moe_layer::dense::DenseMoe;
use moe_layer::ep_runtime::{Buffer, BufferConfig};

/// Every tensor in f32, each block-scaled fp8 weight (`X.weight` e4m3 beside
/// `X.weight_scale_inv`) replaced by `f32(q[i, j]) * scale[i / 128, j / 128]`, its scales
/// dropped.
fn dequantized(mut w: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let scales: Vec<String> = w
        .keys()
        .filter(|k| k.ends_with(".weight_scale_inv"))
        .cloned()
        .collect();
    for name in scales {
        let s = w.remove(&name).unwrap();
        let weight = name.trim_end_matches("_scale_inv").to_string();
        let q = w[&weight].to_dtype(DType::F32).unwrap();
        let (n, k) = q.dims2().unwrap();
        let rows: Vec<u32> = (0..n).map(|i| (i / 128) as u32).collect();
        let cols: Vec<u32> = (0..k).map(|j| (j / 128) as u32).collect();
        let full = s
            .index_select(&Tensor::new(rows.as_slice(), &Device::Cpu).unwrap(), 0)
            .unwrap()
            .index_select(&Tensor::new(cols.as_slice(), &Device::Cpu).unwrap(), 1)
            .unwrap();
        w.insert(weight, (q * full).unwrap());
    }
    w.into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F32).unwrap()))
        .collect()
}

/// The reference model: every tensor by name, computed step by step without any cache.
pub struct Reference {
    pub cfg: DeepSeekV3Config,
    w: HashMap<String, Tensor>,
    moe: HashMap<usize, DenseMoe>,
}

impl Reference {
    pub fn load(dir: &Path) -> Reference {
        let cfg = DeepSeekV3Config::from_file(dir.join("config.json")).unwrap();
        let mut w = HashMap::new();
        for f in std::fs::read_dir(dir).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|e| e == "safetensors") {
                w.extend(candle_core::safetensors::load(&p, &Device::Cpu).unwrap());
            }
        }
        let w = dequantized(w);
        let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
        let moe_cfg = cfg.moe_config().unwrap();
        let moe = (0..cfg.num_hidden_layers)
            .filter(|&i| cfg.is_moe_layer(i))
            .map(|i| {
                let m = DenseMoe::load(vb.pp(format!("model.layers.{i}.mlp")), &moe_cfg).unwrap();
                (i, m)
            })
            .collect();
        Reference { cfg, w, moe }
    }

    fn t(&self, name: &str) -> &Tensor {
        self.w
            .get(name)
            .unwrap_or_else(|| panic!("reference: no tensor {name}"))
    }

    fn lin(&self, x: &Tensor, name: &str) -> Tensor {
        x.matmul(&self.t(name).t().unwrap()).unwrap()
    }

    fn rms(&self, x: &Tensor, name: &str) -> Tensor {
        let eps = self.cfg.rms_norm_eps;
        let inv = ((x.sqr().unwrap().mean_keepdim(1).unwrap() + eps).unwrap())
            .sqrt()
            .unwrap()
            .recip()
            .unwrap();
        x.broadcast_mul(&inv)
            .unwrap()
            .broadcast_mul(self.t(name))
            .unwrap()
    }

    /// Rotates consecutive pairs `(x[2i], x[2i+1])` of each row (row `r` = position `r`) by
    /// `r * theta^(-2i/d)`.
    fn rope(&self, x: &Tensor) -> Tensor {
        let (t, d) = x.dims2().unwrap();
        let v = x.to_vec2::<f32>().unwrap();
        let mut out = Vec::with_capacity(t * d);
        for (pos, row) in v.iter().enumerate() {
            for i in 0..d / 2 {
                let angle = pos as f64 * self.cfg.rope_theta.powf(-2.0 * i as f64 / d as f64);
                let (s, c) = (angle.sin() as f32, angle.cos() as f32);
                out.push(row[2 * i] * c - row[2 * i + 1] * s);
                out.push(row[2 * i] * s + row[2 * i + 1] * c);
            }
        }
        Tensor::from_vec(out, (t, d), &Device::Cpu).unwrap()
    }

    fn softmax_rows(x: &Tensor) -> Tensor {
        let max = x.max_keepdim(1).unwrap();
        let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
        e.broadcast_div(&e.sum_keepdim(1).unwrap()).unwrap()
    }

    fn attention(&self, x: &Tensor, p: &str) -> Tensor {
        let c = &self.cfg;
        let t = x.dim(0).unwrap();
        let (nope, rope, vd) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
        let qd = nope + rope;
        let q = match c.q_lora_rank {
            Some(_) => {
                let a = self.lin(x, &format!("{p}.q_a_proj.weight"));
                let a = self.rms(&a, &format!("{p}.q_a_layernorm.weight"));
                self.lin(&a, &format!("{p}.q_b_proj.weight"))
            }
            None => self.lin(x, &format!("{p}.q_proj.weight")),
        };
        let ckv = self.lin(x, &format!("{p}.kv_a_proj_with_mqa.weight"));
        let latent = ckv.narrow(1, 0, c.kv_lora_rank).unwrap();
        let k_pe = self.rope(&ckv.narrow(1, c.kv_lora_rank, rope).unwrap());
        let latent = self.rms(&latent, &format!("{p}.kv_a_layernorm.weight"));
        let kv = self.lin(&latent, &format!("{p}.kv_b_proj.weight"));
        let scale = 1.0 / (qd as f64).sqrt();
        let mut mask = vec![0f32; t * t];
        for i in 0..t {
            for j in i + 1..t {
                mask[i * t + j] = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
        let mut heads = Vec::new();
        for h in 0..c.num_attention_heads {
            let qh = q.narrow(1, h * qd, qd).unwrap();
            let q_nope = qh.narrow(1, 0, nope).unwrap();
            let q_pe = self.rope(&qh.narrow(1, nope, rope).unwrap());
            let qh = Tensor::cat(&[&q_nope, &q_pe], 1).unwrap();
            let kvh = kv.narrow(1, h * (nope + vd), nope + vd).unwrap();
            let kh = Tensor::cat(&[&kvh.narrow(1, 0, nope).unwrap(), &k_pe], 1).unwrap();
            let vh = kvh.narrow(1, nope, vd).unwrap();
            let scores = ((qh.matmul(&kh.t().unwrap()).unwrap() * scale).unwrap() + &mask).unwrap();
            heads.push(Self::softmax_rows(&scores).matmul(&vh).unwrap());
        }
        let o = Tensor::cat(&heads, 1).unwrap();
        self.lin(&o, &format!("{p}.o_proj.weight"))
    }

    fn mlp(&self, x: &Tensor, p: &str) -> Tensor {
        let g = self.lin(x, &format!("{p}.gate_proj.weight"));
        let silu = (&g / (g.neg().unwrap().exp().unwrap() + 1.0).unwrap()).unwrap();
        let u = self.lin(x, &format!("{p}.up_proj.weight"));
        self.lin(&(silu * u).unwrap(), &format!("{p}.down_proj.weight"))
    }

    /// Logits of every position of `tokens`, `[t, vocab]`.
    fn logits(&self, tokens: &[u32]) -> Tensor {
        let emb = self.t("model.embed_tokens.weight");
        let ids = Tensor::new(tokens, &Device::Cpu).unwrap();
        let mut x = emb.index_select(&ids, 0).unwrap();
        for i in 0..self.cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let h = self.rms(&x, &format!("{p}.input_layernorm.weight"));
            x = (x + self.attention(&h, &format!("{p}.self_attn"))).unwrap();
            let h = self.rms(&x, &format!("{p}.post_attention_layernorm.weight"));
            let f = match self.moe.get(&i) {
                Some(m) => m.forward(&h).unwrap(),
                None => self.mlp(&h, &format!("{p}.mlp")),
            };
            x = (x + f).unwrap();
        }
        let x = self.rms(&x, "model.norm.weight");
        self.lin(&x, "lm_head.weight")
    }

    pub fn last_logits(&self, tokens: &[u32]) -> Vec<f32> {
        let l = self.logits(tokens);
        l.get(tokens.len() - 1).unwrap().to_vec1().unwrap()
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn load_ep(dir: &Path, buffer: Buffer) -> LoadedModel {
    load_ep_placed(dir, buffer, None)
}

/// [`load_ep`] with redundant experts placed by `placements`.
pub fn load_ep_placed(
    dir: &Path,
    buffer: Buffer,
    placements: Option<Arc<deepseek_v3::placements::ExpertPlacements>>,
) -> LoadedModel {
    loader::load(
        dir,
        LoadOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            max_positions: 64,
            moe: MoeBackend::ExpertParallel {
                buffer: Arc::new(buffer),
                options: moe_layer::MoeLayerOptions {
                    low_latency_max_tokens: 8,
                    ..Default::default()
                },
                placements,
            },
            progress: false,
        },
    )
    .unwrap()
}

pub fn buffer_config(cfg: &DeepSeekV3Config) -> BufferConfig {
    BufferConfig::default().with_low_latency(8, cfg.hidden_size, cfg.n_routed_experts.unwrap())
}

/// Prefill `prompts` together, then decode `steps` greedy tokens one at a time; check every
/// step's logits against the reference over the whole sequence. Returns the generated tokens.
/// One step of the model over sequences `0..inputs.len()` of `cache`: the prompts at step 0
/// (prefill), one new token each after (decode); the last position's logits, `[seqs, vocab]`
/// in f32 on the CPU.
pub fn forward_step(
    m: &LoadedModel,
    cache: &mut KvCache,
    inputs: &[Vec<u32>],
    step: usize,
) -> candle_core::Result<Tensor> {
    let kind = if step == 0 {
        StepKind::Prefill
    } else {
        StepKind::Decode
    };
    let batch: Vec<SeqInput<'_>> = inputs
        .iter()
        .enumerate()
        .map(|(s, t)| SeqInput {
            seq: s as u64,
            tokens: t,
        })
        .collect();
    m.model
        .forward(cache, &batch, kind)?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)
}

pub fn check_against_reference(
    m: &LoadedModel,
    reference: &Reference,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<Vec<u32>> {
    let model = &m.model;
    let mut cache = model.new_kv_cache(prompts.len().max(1)).unwrap();
    for s in 0..prompts.len() {
        cache.insert(s as u64).unwrap();
    }
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    for step in 0..=steps {
        let logits = forward_step(m, &mut cache, &inputs, step).unwrap();
        let rows = logits.to_vec2::<f32>().unwrap();
        for (s, row) in rows.iter().enumerate() {
            let want = reference.last_logits(&seqs[s]);
            let diff = max_abs_diff(row, &want);
            assert!(
                diff < 2e-3,
                "sequence {s} step {step}: logits differ from the reference by {diff}"
            );
            let next = argmax(row);
            // The greedy token is the reference's wherever its top two are told apart.
            let best = argmax(&want);
            let second = want
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != best as usize)
                .map(|(_, v)| *v)
                .fold(f32::NEG_INFINITY, f32::max);
            if want[best as usize] - second > 4e-3 {
                assert_eq!(next, best, "sequence {s} step {step}: greedy token");
            }
            seqs[s].push(next);
            inputs[s] = vec![next];
        }
    }
    seqs
}
