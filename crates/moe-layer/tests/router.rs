//! Router and configuration tests: the router against a naive per-token f64 reference on fresh
//! random inputs, group masking, tie-breaking, empty batches and config validation.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use moe_layer::config::{MoeConfig, ScoringFunc, TopkMethod};
use moe_layer::router::{Router, Routing};
use moe_layer::Error;

const H: usize = 64;
const E: usize = 16;

fn make_cfg(
    method: TopkMethod,
    scoring: ScoringFunc,
    n_group: usize,
    topk_group: usize,
) -> MoeConfig {
    MoeConfig {
        hidden_size: H,
        moe_intermediate_size: 32,
        n_routed_experts: E,
        num_experts_per_tok: 4,
        n_shared_experts: Some(1),
        n_group,
        topk_group,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        scoring_func: scoring,
        topk_method: method,
    }
}

fn deepseek_cfg() -> MoeConfig {
    make_cfg(TopkMethod::NoauxTc, ScoringFunc::Sigmoid, 4, 2)
}

/// What the reference decides for one token.
struct RefChoice {
    /// Chosen expert ids (best first).
    ids: Vec<usize>,
    /// Unbiased scores of all experts.
    scores: Vec<f64>,
    /// Smallest gap between a kept and a dropped candidate (group or expert); a tiny gap
    /// means f32 and f64 may legitimately disagree.
    margin: f64,
}

/// Naive scalar reference of the router for one token, in f64.
fn reference(cfg: &MoeConfig, x: &[f32], w: &[Vec<f32>], bias: Option<&[f32]>) -> RefChoice {
    let logits: Vec<f64> = w
        .iter()
        .map(|row| row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum())
        .collect();
    let scores: Vec<f64> = match cfg.scoring_func {
        ScoringFunc::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
        ScoringFunc::Softmax => {
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let ex: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = ex.iter().sum();
            ex.iter().map(|v| v / sum).collect()
        }
    };
    let key: Vec<f64> = match (cfg.topk_method, bias) {
        (TopkMethod::NoauxTc, Some(b)) => {
            scores.iter().zip(b).map(|(s, &b)| s + b as f64).collect()
        }
        _ => scores.clone(),
    };
    let mut margin = f64::INFINITY;
    let mut allowed = vec![true; E];
    if cfg.topk_method != TopkMethod::Greedy && cfg.n_group > 1 {
        let per = E / cfg.n_group;
        let mut groups: Vec<(f64, usize)> = (0..cfg.n_group)
            .map(|g| {
                let mut m: Vec<f64> = key[g * per..(g + 1) * per].to_vec();
                m.sort_by(|a, b| b.partial_cmp(a).unwrap());
                let s = if cfg.topk_method == TopkMethod::NoauxTc {
                    m[0] + m[1]
                } else {
                    m[0]
                };
                (s, g)
            })
            .collect();
        groups.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        if cfg.topk_group < cfg.n_group {
            margin = margin.min(groups[cfg.topk_group - 1].0 - groups[cfg.topk_group].0);
        }
        allowed = vec![false; E];
        for &(_, g) in &groups[..cfg.topk_group] {
            allowed[g * per..(g + 1) * per]
                .iter_mut()
                .for_each(|a| *a = true);
        }
    }
    let mut cand: Vec<usize> = (0..E).filter(|&e| allowed[e]).collect();
    cand.sort_by(|&a, &b| key[b].partial_cmp(&key[a]).unwrap().then(a.cmp(&b)));
    let k = cfg.num_experts_per_tok;
    if cand.len() > k {
        margin = margin.min(key[cand[k - 1]] - key[cand[k]]);
    }
    RefChoice {
        ids: cand[..k].to_vec(),
        scores,
        margin,
    }
}

fn randn(shape: (usize, usize), std: f64) -> Result<Tensor> {
    Tensor::randn(0f32, std as f32, shape, &Device::Cpu)
}

/// Checks the router's output for `x` against the reference, token by token.
fn check_against_reference(
    cfg: &MoeConfig,
    router: &Router,
    x: &Tensor,
    routing: &Routing,
) -> Result<()> {
    let t = x.dims()[0];
    let k = cfg.num_experts_per_tok;
    assert_eq!(routing.topk_idx.dims(), [t, k]);
    assert_eq!(routing.topk_weights.dims(), [t, k]);
    assert_eq!(routing.topk_idx.dtype(), DType::I64);
    assert_eq!(routing.topk_weights.dtype(), DType::F32);
    let xs: Vec<Vec<f32>> = x.to_dtype(DType::F32)?.to_vec2()?;
    let w: Vec<Vec<f32>> = router.weight().to_vec2()?;
    let idx: Vec<Vec<i64>> = routing.topk_idx.to_vec2()?;
    let wts: Vec<Vec<f32>> = routing.topk_weights.to_vec2()?;
    let mut compared = 0;
    for tok in 0..t {
        let r = reference(cfg, &xs[tok], &w, router.bias());
        let got: Vec<usize> = idx[tok].iter().map(|&i| i as usize).collect();
        let mut uniq = got.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), k, "token {tok}: duplicate experts {got:?}");
        assert!(got.iter().all(|&e| e < E), "token {tok}: {got:?}");
        if r.margin > 1e-4 {
            assert_eq!(
                got, r.ids,
                "token {tok}: router chose {got:?}, reference {:?}",
                r.ids
            );
            compared += 1;
        }
        // Weights from the reference's unbiased scores of the router's chosen experts.
        let chosen: Vec<f64> = got.iter().map(|&e| r.scores[e]).collect();
        let sum: f64 = chosen.iter().sum();
        for (j, s) in chosen.iter().enumerate() {
            let expect = if cfg.norm_topk_prob { s / sum } else { *s } * cfg.routed_scaling_factor;
            let diff = (wts[tok][j] as f64 - expect).abs();
            assert!(
                diff <= 1e-5 * expect.abs().max(1.0),
                "token {tok} slot {j}: weight {} vs reference {expect}",
                wts[tok][j]
            );
        }
    }
    assert!(
        compared * 2 >= t,
        "only {compared} of {t} tokens were far from a tie"
    );
    Ok(())
}

#[test]
fn noaux_tc_matches_reference() -> Result<()> {
    let cfg = deepseek_cfg();
    let weight = randn((E, H), 0.3)?;
    let bias = randn((E, 1), 0.2)?.flatten_all()?;
    let router = Router::new(weight, Some(bias), &cfg)?;
    let x = randn((57, H), 1.0)?;
    let routing = router.forward(&x)?;
    check_against_reference(&cfg, &router, &x, &routing)?;
    // Every token stays within topk_group groups.
    let per = E / cfg.n_group;
    for row in routing.topk_idx.to_vec2::<i64>()? {
        let mut groups: Vec<usize> = row.iter().map(|&e| e as usize / per).collect();
        groups.sort_unstable();
        groups.dedup();
        assert!(
            groups.len() <= cfg.topk_group,
            "experts {row:?} span groups {groups:?}"
        );
    }
    Ok(())
}

#[test]
fn noaux_tc_without_normalisation_and_bf16_input() -> Result<()> {
    let mut cfg = deepseek_cfg();
    cfg.norm_topk_prob = false;
    cfg.routed_scaling_factor = 1.0;
    let weight = randn((E, H), 0.3)?.to_dtype(DType::BF16)?;
    let bias = randn((E, 1), 0.2)?.flatten_all()?;
    let router = Router::new(weight, Some(bias), &cfg)?;
    let x = randn((33, H), 1.0)?.to_dtype(DType::BF16)?;
    let routing = router.forward(&x)?;
    check_against_reference(&cfg, &router, &x, &routing)
}

#[test]
fn group_limited_greedy_matches_reference() -> Result<()> {
    let mut cfg = make_cfg(TopkMethod::GroupLimitedGreedy, ScoringFunc::Softmax, 4, 2);
    cfg.norm_topk_prob = false;
    let router = Router::new(randn((E, H), 0.3)?, None, &cfg)?;
    let x = randn((41, H), 1.0)?;
    let routing = router.forward(&x)?;
    check_against_reference(&cfg, &router, &x, &routing)
}

#[test]
fn softmax_greedy_matches_reference() -> Result<()> {
    for norm in [true, false] {
        let mut cfg = make_cfg(TopkMethod::Greedy, ScoringFunc::Softmax, 1, 1);
        cfg.norm_topk_prob = norm;
        cfg.routed_scaling_factor = 1.0;
        let router = Router::new(randn((E, H), 0.3)?, None, &cfg)?;
        let x = randn((45, H), 1.0)?;
        let routing = router.forward(&x)?;
        check_against_reference(&cfg, &router, &x, &routing)?;
        let sums: Vec<f32> = routing.topk_weights.sum(1)?.to_vec1()?;
        for s in sums {
            if norm {
                assert!((s - 1.0).abs() < 1e-5, "normalised weights sum to {s}");
            } else {
                assert!(s > 0.0 && s < 1.0 + 1e-5, "softmax top-k mass {s}");
            }
        }
    }
    Ok(())
}

#[test]
fn group_masking_excludes_the_best_expert_of_a_dropped_group() -> Result<()> {
    let mut cfg = make_cfg(TopkMethod::NoauxTc, ScoringFunc::Sigmoid, 4, 1);
    cfg.num_experts_per_tok = 2;
    // Expert 0 gets the highest selection score of all (sigmoid + 3 > 3), but its group's
    // second-best is far down (sigmoid - 5), so group 0 scores below group 1 (two experts at +2).
    let mut bias = vec![-5f32; E];
    bias[0] = 3.0;
    for b in &mut bias[4..8] {
        *b = 2.0;
    }
    let weight = randn((E, H), 0.3)?;
    let bias_t = Tensor::new(bias.as_slice(), &Device::Cpu)?;
    let x = randn((25, H), 1.0)?;

    let limited = Router::new(weight.clone(), Some(bias_t.clone()), &cfg)?.forward(&x)?;
    for row in limited.topk_idx.to_vec2::<i64>()? {
        assert!(
            row.iter().all(|e| (4..8).contains(e)),
            "group masking failed: {row:?}"
        );
    }
    // The same gate without group limiting picks expert 0 first for every token.
    let mut ungrouped = cfg.clone();
    ungrouped.n_group = 1;
    ungrouped.topk_group = 1;
    let free = Router::new(weight, Some(bias_t), &ungrouped)?.forward(&x)?;
    for row in free.topk_idx.to_vec2::<i64>()? {
        assert_eq!(row[0], 0, "without groups expert 0 should win: {row:?}");
    }
    // Weights are the unbiased scores, renormalised and scaled.
    let sums: Vec<f32> = limited.topk_weights.sum(1)?.to_vec1()?;
    for s in sums {
        assert!(
            (s - 2.5).abs() < 1e-5,
            "weights sum to {s}, expected routed_scaling_factor"
        );
    }
    Ok(())
}

#[test]
fn ties_go_to_the_lower_expert_id() -> Result<()> {
    let cfg = deepseek_cfg();
    // Identical gate rows: every expert and every group ties.
    let row = randn((1, H), 0.3)?;
    let weight = row.broadcast_as((E, H))?.contiguous()?;
    let bias = Tensor::zeros(E, DType::F32, &Device::Cpu)?;
    let router = Router::new(weight, Some(bias), &cfg)?;
    let routing = router.forward(&randn((9, H), 1.0)?)?;
    for row in routing.topk_idx.to_vec2::<i64>()? {
        assert_eq!(row, vec![0, 1, 2, 3]);
    }
    for row in routing.topk_weights.to_vec2::<f32>()? {
        for w in row {
            assert!((w - 2.5 / 4.0).abs() < 1e-6, "tied weight {w}");
        }
    }
    Ok(())
}

#[test]
fn empty_batch() -> Result<()> {
    for cfg in [
        deepseek_cfg(),
        make_cfg(TopkMethod::Greedy, ScoringFunc::Softmax, 1, 1),
    ] {
        let bias = (cfg.topk_method == TopkMethod::NoauxTc)
            .then(|| randn((E, 1), 0.1).and_then(|b| b.flatten_all()))
            .transpose()?;
        let router = Router::new(randn((E, H), 0.3)?, bias, &cfg)?;
        let routing = router.forward(&Tensor::zeros((0, H), DType::BF16, &Device::Cpu)?)?;
        assert_eq!(routing.topk_idx.dims(), [0, 4]);
        assert_eq!(routing.topk_idx.dtype(), DType::I64);
        assert_eq!(routing.topk_weights.dims(), [0, 4]);
        assert_eq!(routing.topk_weights.dtype(), DType::F32);
    }
    Ok(())
}

#[test]
fn load_from_var_builder() -> Result<()> {
    let cfg = deepseek_cfg();
    let weight = randn((E, H), 0.3)?;
    let bias = randn((E, 1), 0.2)?.flatten_all()?;
    let mut ts = HashMap::new();
    ts.insert("model.layers.1.mlp.gate.weight".to_string(), weight.clone());
    ts.insert(
        "model.layers.1.mlp.gate.e_score_correction_bias".to_string(),
        bias.clone(),
    );
    let vb = VarBuilder::from_tensors(ts.clone(), DType::F32, &Device::Cpu);
    let loaded = Router::load(vb.pp("model.layers.1.mlp.gate"), &cfg)?;
    let direct = Router::new(weight, Some(bias), &cfg)?;
    let x = randn((13, H), 1.0)?;
    let (a, b) = (loaded.forward(&x)?, direct.forward(&x)?);
    assert_eq!(a.topk_idx.to_vec2::<i64>()?, b.topk_idx.to_vec2::<i64>()?);
    assert_eq!(
        a.topk_weights.to_vec2::<f32>()?,
        b.topk_weights.to_vec2::<f32>()?
    );

    // noaux_tc needs the bias; a mis-shaped gate names the tensor.
    ts.remove("model.layers.1.mlp.gate.e_score_correction_bias");
    let vb = VarBuilder::from_tensors(ts.clone(), DType::F32, &Device::Cpu);
    assert!(Router::load(vb.pp("model.layers.1.mlp.gate"), &cfg).is_err());
    ts.insert(
        "model.layers.1.mlp.gate.weight".to_string(),
        randn((E, H + 1), 0.3)?,
    );
    let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
    let greedy = make_cfg(TopkMethod::Greedy, ScoringFunc::Softmax, 1, 1);
    let err = Router::load(vb.pp("model.layers.1.mlp.gate"), &greedy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.layers.1.mlp.gate.weight"), "{err}");
    assert!(
        err.contains("[16, 64]") && err.contains("[16, 65]"),
        "{err}"
    );
    Ok(())
}

#[test]
fn new_rejects_bad_shapes() -> Result<()> {
    let cfg = deepseek_cfg();
    let err = Router::new(randn((E, H - 1), 0.3)?, None, &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[16, 63]") && err.contains("[16, 64]"),
        "{err}"
    );
    let bias = Tensor::zeros(E + 1, DType::F32, &Device::Cpu)?;
    let err = Router::new(randn((E, H), 0.3)?, Some(bias), &cfg)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[17]") && err.contains("[16]"), "{err}");
    let x = randn((3, H + 2), 1.0)?;
    let err = Router::new(randn((E, H), 0.3)?, None, &cfg)?
        .forward(&x)
        .unwrap_err()
        .to_string();
    assert!(err.contains("66") && err.contains("64"), "{err}");
    Ok(())
}

#[test]
fn config_parses_deepseek_v3_json() -> Result<()> {
    let json = r#"{
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": true,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 3
    }"#;
    let cfg = MoeConfig::from_json_str(json)?;
    assert_eq!(cfg.n_routed_experts, 256);
    assert_eq!(cfg.scoring_func, ScoringFunc::Sigmoid);
    assert_eq!(cfg.topk_method, TopkMethod::NoauxTc);
    assert_eq!(cfg.experts_per_group(), 32);
    assert_eq!(cfg.shared_intermediate_size(), Some(2048));
    // Round trip through serde.
    let back: MoeConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_eq!(back, cfg);

    // A Qwen-style minimal config takes the defaults.
    let minimal = r#"{"hidden_size": 64, "moe_intermediate_size": 32,
                      "n_routed_experts": 16, "num_experts_per_tok": 2}"#;
    let cfg = MoeConfig::from_json_str(minimal)?;
    assert_eq!((cfg.n_group, cfg.topk_group), (1, 1));
    assert_eq!(cfg.n_shared_experts, None);
    assert_eq!(cfg.shared_intermediate_size(), None);
    assert_eq!(cfg.routed_scaling_factor, 1.0);
    assert!(!cfg.norm_topk_prob);
    assert_eq!(cfg.scoring_func, ScoringFunc::Softmax);
    assert_eq!(cfg.topk_method, TopkMethod::Greedy);

    let bad = r#"{"hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 16,
                  "num_experts_per_tok": 2, "scoring_func": "relu"}"#;
    assert!(MoeConfig::from_json_str(bad).is_err());
    Ok(())
}

#[test]
fn config_validation_names_the_broken_limit() {
    let base = deepseek_cfg();
    assert!(base.validate().is_ok());
    type Edit = Box<dyn Fn(&mut MoeConfig)>;
    // (edit, the argument and value the error names, words its limit must contain)
    let cases: Vec<(Edit, &str, &str, &[&str])> = vec![
        (
            Box::new(|c| c.n_group = 3),
            "n_routed_experts",
            "16",
            &["n_group = 3"],
        ),
        (
            Box::new(|c| c.topk_group = 5),
            "topk_group",
            "5",
            &["n_group = 4"],
        ),
        (
            Box::new(|c| c.num_experts_per_tok = 17),
            "num_experts_per_tok",
            "17",
            &["n_routed_experts = 16"],
        ),
        (
            Box::new(|c| {
                c.topk_group = 1;
                c.num_experts_per_tok = 5
            }),
            "num_experts_per_tok",
            "5",
            &["topk_group = 1", "4 experts per group"],
        ),
        (Box::new(|c| c.hidden_size = 0), "hidden_size", "0", &[]),
        (
            Box::new(|c| c.routed_scaling_factor = f64::NAN),
            "routed_scaling_factor",
            "NaN",
            &["finite"],
        ),
    ];
    for (edit, want_arg, want_value, needles) in cases {
        let mut c = base.clone();
        edit(&mut c);
        match c.validate().unwrap_err() {
            Error::InvalidArgument { arg, value, limit } => {
                assert_eq!((arg, value.as_str()), (want_arg, want_value), "{limit}");
                for n in needles {
                    assert!(limit.contains(n), "limit {limit:?} lacks {n:?}");
                }
            }
            other => panic!("expected an invalid argument, got {other}"),
        }
    }
    // Without group limiting the per-group cap does not apply.
    let mut greedy = base.clone();
    greedy.topk_method = TopkMethod::Greedy;
    greedy.topk_group = 1;
    greedy.num_experts_per_tok = 8;
    assert!(greedy.validate().is_ok());
}
