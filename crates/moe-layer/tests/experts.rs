//! Expert tests: grouped and packed expert GEMMs against naive per-token f64 loops on fresh
//! random inputs, sharded loading from safetensors, shape errors, and the dense reference layer.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use moe_layer::config::{MoeConfig, ScoringFunc, TopkMethod};
use moe_layer::dense::DenseMoe;
use moe_layer::experts::{Experts, Mlp};
use rand::Rng;

const H: usize = 64;
const I: usize = 32;
const E: usize = 16;

fn cfg() -> MoeConfig {
    MoeConfig {
        hidden_size: H,
        moe_intermediate_size: I,
        n_routed_experts: E,
        num_experts_per_tok: 4,
        n_shared_experts: Some(2),
        n_group: 4,
        topk_group: 2,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        scoring_func: ScoringFunc::Sigmoid,
        topk_method: TopkMethod::NoauxTc,
    }
}

fn randn<S: Into<candle_core::Shape>>(shape: S, std: f32) -> Result<Tensor> {
    Tensor::randn(0f32, std, shape, &Device::Cpu)
}

fn random_mlp(i: usize) -> Result<Mlp> {
    Mlp::new(
        randn((i, H), 0.2)?,
        randn((i, H), 0.2)?,
        randn((H, i), 0.2)?,
    )
}

fn random_experts(first: usize, n: usize) -> Result<Experts> {
    Ok(Experts::new(
        first,
        (0..n).map(|_| random_mlp(I)).collect::<Result<Vec<_>>>()?,
    )?)
}

/// Host copy of an MLP's weights for the naive reference.
struct HostMlp {
    gate: Vec<Vec<f32>>,
    up: Vec<Vec<f32>>,
    down: Vec<Vec<f32>>,
}

impl HostMlp {
    fn of(m: &Mlp) -> Result<Self> {
        Ok(Self {
            gate: m.gate_proj()?.to_dtype(DType::F32)?.to_vec2()?,
            up: m.up_proj()?.to_dtype(DType::F32)?.to_vec2()?,
            down: m.down_proj().to_dtype(DType::F32)?.to_vec2()?,
        })
    }

    /// `down(silu(gate x) * up x)` in f64.
    fn apply(&self, x: &[f32]) -> Vec<f64> {
        let dot =
            |w: &[f32], v: &[f64]| -> f64 { w.iter().zip(v).map(|(&a, b)| a as f64 * b).sum() };
        let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let hidden: Vec<f64> = self
            .gate
            .iter()
            .zip(&self.up)
            .map(|(g, u)| {
                let z = dot(g, &xd);
                z / (1.0 + (-z).exp()) * dot(u, &xd)
            })
            .collect();
        self.down.iter().map(|d| dot(d, &hidden)).collect()
    }
}

/// `||got - want|| / ||want||`.
fn rel_err(got: &Tensor, want: &[Vec<f64>]) -> Result<f64> {
    let got: Vec<Vec<f32>> = got.to_dtype(DType::F32)?.to_vec2()?;
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len());
        for (&a, &b) in g.iter().zip(w) {
            num += (a as f64 - b).powi(2);
            den += b * b;
        }
    }
    Ok((num / den.max(1e-30)).sqrt())
}

/// Per-token loop over top-k slots: `sum_k w_k * expert_{idx_k}(x)`.
fn naive_grouped(
    experts: &Experts,
    x: &Tensor,
    idx: &[Vec<i64>],
    w: &[Vec<f32>],
) -> Result<Vec<Vec<f64>>> {
    let host: Vec<HostMlp> = experts
        .experts()
        .iter()
        .map(HostMlp::of)
        .collect::<Result<_>>()?;
    let xs: Vec<Vec<f32>> = x.to_dtype(DType::F32)?.to_vec2()?;
    Ok(xs
        .iter()
        .enumerate()
        .map(|(n, row)| {
            let mut out = vec![0f64; H];
            for (&e, &wt) in idx[n].iter().zip(&w[n]) {
                if e >= 0 {
                    for (o, y) in out.iter_mut().zip(host[e as usize].apply(row)) {
                        *o += wt as f64 * y;
                    }
                }
            }
            out
        })
        .collect())
}

fn tensors(idx: &[Vec<i64>], w: &[Vec<f32>]) -> Result<(Tensor, Tensor)> {
    let (n, k) = (idx.len(), idx.first().map_or(0, Vec::len));
    Ok((
        Tensor::from_vec(idx.concat(), (n, k), &Device::Cpu)?,
        Tensor::from_vec(w.concat(), (n, k), &Device::Cpu)?,
    ))
}

#[test]
fn grouped_matches_naive_with_masked_slots_and_an_empty_expert() -> Result<()> {
    let mut rng = rand::rng();
    let experts = random_experts(8, 8)?;
    let (n, k) = (37, 4);
    let x = randn((n, H), 1.0)?;
    // Local ids 0..8 except 3 (never chosen), about a quarter of slots masked with -1.
    let idx: Vec<Vec<i64>> = (0..n)
        .map(|_| {
            (0..k)
                .map(|_| {
                    if rng.random_bool(0.25) {
                        -1
                    } else {
                        let mut e = rng.random_range(0..7i64);
                        if e >= 3 {
                            e += 1;
                        }
                        e
                    }
                })
                .collect()
        })
        .collect();
    let w: Vec<Vec<f32>> = (0..n)
        .map(|_| (0..k).map(|_| rng.random_range(0.05..1.0)).collect())
        .collect();
    let (idx_t, w_t) = tensors(&idx, &w)?;
    let got = experts.forward_grouped(&x, &idx_t, &w_t)?;
    assert_eq!(got.dims(), [n, H]);
    assert_eq!(got.dtype(), DType::F32);
    let want = naive_grouped(&experts, &x, &idx, &w)?;
    let err = rel_err(&got, &want)?;
    assert!(err < 1e-5, "relative error {err}");

    // bf16 activations come back as bf16 and stay close.
    let xb = x.to_dtype(DType::BF16)?;
    let got = experts.forward_grouped(&xb, &idx_t, &w_t)?;
    assert_eq!(got.dtype(), DType::BF16);
    let want = naive_grouped(&experts, &xb, &idx, &w)?;
    let err = rel_err(&got, &want)?;
    assert!(err < 1e-2, "bf16 relative error {err}");
    Ok(())
}

#[test]
fn grouped_with_one_hot_expert_and_repeated_rows() -> Result<()> {
    let mut rng = rand::rng();
    let experts = random_experts(0, 4)?;
    let n = 23;
    let x = randn((n, H), 1.0)?;
    // Slot 0 always expert 2; slot 1 random; a row whose slots are all -1.
    let mut idx: Vec<Vec<i64>> = (0..n)
        .map(|_| vec![2, rng.random_range(-1..4i64)])
        .collect();
    idx[5] = vec![-1, -1];
    let w: Vec<Vec<f32>> = (0..n)
        .map(|_| vec![rng.random_range(0.1..1.0), rng.random_range(0.1..1.0)])
        .collect();
    let (idx_t, w_t) = tensors(&idx, &w)?;
    let got = experts.forward_grouped(&x, &idx_t, &w_t)?;
    let err = rel_err(&got, &naive_grouped(&experts, &x, &idx, &w)?)?;
    assert!(err < 1e-5, "relative error {err}");
    let row5: Vec<f32> = got.get(5)?.to_vec1()?;
    assert!(row5.iter().all(|&v| v == 0.0), "masked row must be zero");
    Ok(())
}

#[test]
fn grouped_empty_batch_and_bad_ids() -> Result<()> {
    let experts = random_experts(4, 4)?;
    let x = Tensor::zeros((0, H), DType::BF16, &Device::Cpu)?;
    let idx = Tensor::zeros((0, 4), DType::I64, &Device::Cpu)?;
    let w = Tensor::zeros((0, 4), DType::F32, &Device::Cpu)?;
    let y = experts.forward_grouped(&x, &idx, &w)?;
    assert_eq!(y.dims(), [0, H]);
    assert_eq!(y.dtype(), DType::BF16);

    let x = randn((2, H), 1.0)?;
    let w = randn((2, 2), 1.0)?;
    for (bad, needle) in [(4i64, "= 4"), (-2, "= -2")] {
        let idx = Tensor::new(&[[0i64, 1], [bad, 2]], &Device::Cpu)?;
        let err = experts
            .forward_grouped(&x, &idx, &w)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("topk_idx_local[1, 0]") && err.contains(needle),
            "{err}"
        );
    }
    let idx = Tensor::new(&[[0i64, 1, 2]], &Device::Cpu)?;
    assert!(experts.forward_grouped(&x, &idx, &w).is_err());
    Ok(())
}

#[test]
fn packed_matches_per_row_reference() -> Result<()> {
    let experts = random_experts(4, 4)?;
    let m = 9;
    let x = randn((4, m, H), 1.0)?;
    let counts = [3, 0, 9, 5];
    let got = experts.forward_packed(&x, &counts)?;
    assert_eq!(got.dims(), [4, m, H]);
    for (l, &c) in counts.iter().enumerate() {
        let host = HostMlp::of(&experts.experts()[l])?;
        let xs: Vec<Vec<f32>> = x.get(l)?.to_vec2()?;
        let want: Vec<Vec<f64>> = xs
            .iter()
            .enumerate()
            .map(|(r, row)| if r < c { host.apply(row) } else { vec![0.0; H] })
            .collect();
        let block = got.get(l)?;
        if c > 0 {
            let err = rel_err(&block.narrow(0, 0, c)?, &want[..c])?;
            assert!(err < 1e-5, "expert {l}: relative error {err}");
        }
        let rest: Vec<Vec<f32>> = block.narrow(0, c, m - c)?.to_vec2()?;
        assert!(
            rest.iter().flatten().all(|&v| v == 0.0),
            "expert {l}: rows past count not zero"
        );
    }
    let err = experts
        .forward_packed(&x, &[1, 2, 10, 0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("counts[2] = 10") && err.contains("9"), "{err}");
    assert!(experts.forward_packed(&x, &[1, 2]).is_err());
    let y = experts.forward_packed(&x.to_dtype(DType::BF16)?, &counts)?;
    assert_eq!(y.dtype(), DType::BF16);
    Ok(())
}

#[test]
fn mlp_module_matches_reference_on_batched_input() -> Result<()> {
    let mlp = random_mlp(48)?;
    let x = randn((2, 5, H), 1.0)?;
    let y = Module::forward(&mlp, &x)?;
    assert_eq!(y.dims(), [2, 5, H]);
    let host = HostMlp::of(&mlp)?;
    let flat: Vec<Vec<f32>> = x.reshape((10, H))?.to_vec2()?;
    let want: Vec<Vec<f64>> = flat.iter().map(|r| host.apply(r)).collect();
    let err = rel_err(&y.reshape((10, H))?, &want)?;
    assert!(err < 1e-5, "relative error {err}");
    let err = Mlp::new(
        randn((I, H), 1.0)?,
        randn((I, H), 1.0)?,
        randn((H, I + 1), 1.0)?,
    )
    .unwrap_err();
    // The typed error survives candle's error type.
    assert!(
        matches!(
            moe_layer::Error::from_candle(&err),
            Some(moe_layer::Error::InvalidArgument {
                arg: "down_proj",
                ..
            })
        ),
        "{err}"
    );
    Ok(())
}

/// A unique scratch folder for this test process, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let n: u64 = rand::rng().random();
        let p = std::env::temp_dir().join(format!("moe-layer-{tag}-{}-{n:x}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn expert_tensors(prefix: &str, ids: std::ops::Range<usize>) -> Result<HashMap<String, Tensor>> {
    let mut ts = HashMap::new();
    for e in ids {
        ts.insert(
            format!("{prefix}.{e}.gate_proj.weight"),
            randn((I, H), 0.2)?,
        );
        ts.insert(format!("{prefix}.{e}.up_proj.weight"), randn((I, H), 0.2)?);
        ts.insert(
            format!("{prefix}.{e}.down_proj.weight"),
            randn((H, I), 0.2)?,
        );
    }
    Ok(ts)
}

#[test]
fn load_reads_only_the_asked_experts() -> Result<()> {
    let dir = TempDir::new("load");
    let prefix = "model.layers.3.mlp.experts";
    let cfg = cfg();
    // This file holds experts 4..8 only, like one rank's shard of a checkpoint.
    let ts = expert_tensors(prefix, 4..8)?;
    let path = dir.0.join("shard.safetensors");
    candle_core::safetensors::save(&ts, &path)?;
    let bytes = std::fs::read(&path).map_err(candle_core::Error::wrap)?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, &Device::Cpu)?;

    let experts = Experts::load(vb.pp(prefix), &cfg, 4, 4)?;
    assert_eq!((experts.first_expert(), experts.num_local()), (4, 4));
    for (l, m) in experts.experts().iter().enumerate() {
        let want = &ts[&format!("{prefix}.{}.down_proj.weight", l + 4)];
        let diff = (m.down_proj() - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "local expert {l} has the wrong weights");
    }
    // Experts 0..4 are not in the file, so asking for them fails, naming what is missing.
    let err = Experts::load(vb.pp(prefix), &cfg, 2, 4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("experts.2"), "{err}");
    // A shard past the last expert is refused with the limit.
    let err = Experts::load(vb.pp(prefix), &cfg, 14, 4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("18") && err.contains("n_routed_experts = 16"),
        "{err}"
    );

    // Loading in bf16 converts.
    let bytes = std::fs::read(&path).map_err(candle_core::Error::wrap)?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, DType::BF16, &Device::Cpu)?;
    assert_eq!(
        Experts::load(vb.pp(prefix), &cfg, 5, 2)?.dtype(),
        DType::BF16
    );
    Ok(())
}

#[test]
fn load_names_a_mis_shaped_tensor() -> Result<()> {
    let dir = TempDir::new("shape");
    let prefix = "model.layers.3.mlp.experts";
    let mut ts = expert_tensors(prefix, 4..8)?;
    ts.insert(
        format!("{prefix}.5.up_proj.weight"),
        randn((I, H + 1), 0.2)?,
    );
    let path = dir.0.join("bad.safetensors");
    candle_core::safetensors::save(&ts, &path)?;
    let bytes = std::fs::read(&path).map_err(candle_core::Error::wrap)?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, &Device::Cpu)?;
    let err = Experts::load(vb.pp(prefix), &cfg(), 4, 4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.3.mlp.experts.5.up_proj.weight"),
        "{err}"
    );
    assert!(
        err.contains("[32, 64]") && err.contains("[32, 65]"),
        "{err}"
    );
    // Experts 6..8 do not include the bad tensor.
    assert_eq!(Experts::load(vb.pp(prefix), &cfg(), 6, 2)?.num_local(), 2);
    Ok(())
}

#[test]
fn dense_moe_matches_naive_layer() -> Result<()> {
    let cfg = cfg();
    let mut ts = expert_tensors("mlp.experts", 0..E)?;
    ts.insert("mlp.gate.weight".into(), randn((E, H), 0.3)?);
    ts.insert("mlp.gate.e_score_correction_bias".into(), randn(E, 0.1)?);
    let si = 2 * I;
    ts.insert(
        "mlp.shared_experts.gate_proj.weight".into(),
        randn((si, H), 0.2)?,
    );
    ts.insert(
        "mlp.shared_experts.up_proj.weight".into(),
        randn((si, H), 0.2)?,
    );
    ts.insert(
        "mlp.shared_experts.down_proj.weight".into(),
        randn((H, si), 0.2)?,
    );
    let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
    let layer = DenseMoe::load(vb.pp("mlp"), &cfg)?;
    assert_eq!(layer.shared().map(Mlp::intermediate_size), Some(si));

    let t = 31;
    let x = randn((t, H), 1.0)?;
    let y = Module::forward(&layer, &x)?;
    assert_eq!(y.dims(), [t, H]);

    let routing = layer.router().forward(&x)?;
    let idx: Vec<Vec<i64>> = routing.topk_idx.to_vec2()?;
    let w: Vec<Vec<f32>> = routing.topk_weights.to_vec2()?;
    let mut want = naive_grouped(layer.experts(), &x, &idx, &w)?;
    let shared = HostMlp::of(layer.shared().expect("shared expert"))?;
    for (row, xr) in want.iter_mut().zip(x.to_vec2::<f32>()?) {
        for (o, s) in row.iter_mut().zip(shared.apply(&xr)) {
            *o += s;
        }
    }
    let err = rel_err(&y, &want)?;
    assert!(err < 1e-5, "relative error {err}");

    let empty = layer.forward(&Tensor::zeros((0, H), DType::F32, &Device::Cpu)?)?;
    assert_eq!(empty.dims(), [0, H]);
    Ok(())
}
