//! The `config.json` files the Hugging Face Hub publishes for DeepSeek-style models, and the
//! same files re-saved by transformers 4.5x and 5 (`tests/fixtures/configs/`), parse, validate
//! and give their models' facts; the re-saved forms parse to the same values as the originals.

use deepseek_v3::config::{DeepSeekV3Config, ModelType, Quantization, RopeScaling, ScaleFmt};
use moe_layer::config::{MoeConfig, ScoringFunc, TopkMethod};

/// Every fixture, by file name.
const FIXTURES: &[&str] = &[
    "deepseek-v3.json",
    "deepseek-v3-transformers-4.55.json",
    "deepseek-v3-transformers-5.json",
    "deepseek-r1.json",
    "deepseek-v3.1.json",
    "kimi-k2-instruct.json",
    "kimi-k2-thinking.json",
    "deepseek-v2.json",
    "deepseek-v2-lite.json",
    "deepseek-v2-lite-transformers-5.json",
    "deepseek-v2-lite-bnb-4bit.json",
    "tiny-transformers-5.json",
];

fn path(name: &str) -> String {
    format!(
        "{}/tests/fixtures/configs/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The fixture parsed, not validated.
fn parse(name: &str) -> DeepSeekV3Config {
    let text = std::fs::read_to_string(path(name)).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The fixture read as the model reads it (parsed and validated).
fn load(name: &str) -> DeepSeekV3Config {
    DeepSeekV3Config::from_file(path(name)).unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

fn fp8(scale_fmt: ScaleFmt) -> Option<Quantization> {
    Some(Quantization::Fp8 {
        block: [128, 128],
        scale_fmt,
    })
}

fn yarn(factor: f64, beta_fast: f64, beta_slow: f64, mscale: f64) -> Option<RopeScaling> {
    Some(RopeScaling {
        kind: "yarn".into(),
        factor,
        original_max_position_embeddings: 4096,
        beta_fast,
        beta_slow,
        mscale,
        mscale_all_dim: mscale,
    })
}

/// `(experts, top-k, shared, groups, groups per token, method, scoring, renormalised, scale)`.
fn routing(
    moe: &MoeConfig,
) -> (
    usize,
    usize,
    Option<usize>,
    usize,
    usize,
    TopkMethod,
    ScoringFunc,
    bool,
    f64,
) {
    (
        moe.n_routed_experts,
        moe.num_experts_per_tok,
        moe.n_shared_experts,
        moe.n_group,
        moe.topk_group,
        moe.topk_method,
        moe.scoring_func,
        moe.norm_topk_prob,
        moe.routed_scaling_factor,
    )
}

/// Total weights in billions, as the checkpoint generator counts them (no MTP layers).
fn billions(cfg: &DeepSeekV3Config) -> f64 {
    cfg.num_parameters() as f64 / 1e9
}

#[test]
fn every_fixture_parses_and_round_trips() {
    for name in FIXTURES {
        let cfg = parse(name);
        let back: DeepSeekV3Config = serde_json::from_str(&cfg.to_hf_json().unwrap())
            .unwrap_or_else(|e| panic!("{name} written back: {e}"));
        assert_eq!(back, cfg, "{name}");
    }
}

#[test]
fn the_three_forms_of_deepseek_v3_are_one_config() {
    let v3 = load("deepseek-v3.json");
    assert_eq!(load("deepseek-v3-transformers-4.55.json"), v3);
    assert_eq!(load("deepseek-v3-transformers-5.json"), v3);
    // R1 is V3's architecture with other weights; V3.1 adds UE8M0 scales.
    assert_eq!(load("deepseek-r1.json"), v3);
    let v31 = load("deepseek-v3.1.json");
    assert_eq!(v31.quantization, fp8(ScaleFmt::Ue8m0));
    assert_eq!(
        DeepSeekV3Config {
            quantization: v3.quantization.clone(),
            ..v31
        },
        v3
    );
}

#[test]
fn the_tiny_preset_as_transformers_5_saves_it_is_the_tiny_preset() {
    assert_eq!(load("tiny-transformers-5.json"), DeepSeekV3Config::tiny());
}

#[test]
fn deepseek_v3_facts() {
    let cfg = load("deepseek-v3.json");
    assert_eq!(cfg.model_type, ModelType::DeepseekV3);
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.vocab_size
        ),
        (61, 7168, 128, 129280)
    );
    assert_eq!(
        (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.q_head_dim()),
        (Some(1536), 512, 192)
    );
    assert!(!cfg.is_moe_layer(2) && cfg.is_moe_layer(3) && cfg.is_moe_layer(60));
    assert_eq!(
        routing(&cfg.moe_config().unwrap()),
        (
            256,
            8,
            Some(1),
            8,
            4,
            TopkMethod::NoauxTc,
            ScoringFunc::Sigmoid,
            true,
            2.5
        )
    );
    assert_eq!(cfg.rope_theta, 10000.0);
    assert_eq!(cfg.rope_scaling, yarn(40.0, 32.0, 1.0, 1.0));
    assert!(cfg.rope_interleave);
    assert_eq!(cfg.max_position_embeddings, 163840);
    assert_eq!(cfg.quantization, fp8(ScaleFmt::Float));
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id), (Some(0), Some(1)));
    // "671B total parameters" (the MTP module's 14B are not counted).
    assert!(
        (670.0..673.0).contains(&billions(&cfg)),
        "{}",
        billions(&cfg)
    );
}

#[test]
fn kimi_k2_facts() {
    let cfg = load("kimi-k2-instruct.json");
    assert_eq!(cfg.model_type, ModelType::KimiK2);
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.vocab_size,
            cfg.first_k_dense_replace
        ),
        (61, 64, 163840, 1)
    );
    assert!(!cfg.is_moe_layer(0) && cfg.is_moe_layer(1));
    assert_eq!(
        routing(&cfg.moe_config().unwrap()),
        (
            384,
            8,
            Some(1),
            1,
            1,
            TopkMethod::NoauxTc,
            ScoringFunc::Sigmoid,
            true,
            2.827
        )
    );
    assert_eq!(cfg.rope_theta, 50000.0);
    assert_eq!(cfg.rope_scaling, yarn(32.0, 1.0, 1.0, 1.0));
    assert_eq!(cfg.max_position_embeddings, 131072);
    assert_eq!(cfg.quantization, fp8(ScaleFmt::Float));
    assert_eq!(
        (cfg.bos_token_id, cfg.eos_token_id),
        (Some(163584), Some(163585))
    );
    // "1 trillion total parameters".
    assert!(
        (1020.0..1035.0).contains(&billions(&cfg)),
        "{}",
        billions(&cfg)
    );
}

#[test]
fn deepseek_v2_routing_maps_onto_the_moe_layer() {
    let v2 = load("deepseek-v2.json");
    assert_eq!(v2.model_type, ModelType::DeepseekV2);
    assert_eq!((v2.num_hidden_layers, v2.q_lora_rank), (60, Some(1536)));
    assert_eq!(
        routing(&v2.moe_config().unwrap()),
        (
            160,
            6,
            Some(2),
            8,
            3,
            TopkMethod::GroupLimitedGreedy,
            ScoringFunc::Softmax,
            false,
            16.0
        )
    );
    assert_eq!(v2.rope_scaling, yarn(40.0, 32.0, 1.0, 0.707));
    assert_eq!(v2.quantization, None);
    // "236B total parameters".
    assert!((235.0..237.0).contains(&billions(&v2)), "{}", billions(&v2));

    let lite = load("deepseek-v2-lite.json");
    assert_eq!(lite.model_type, ModelType::DeepseekV2);
    assert_eq!(lite.q_lora_rank, None);
    assert!(!lite.is_moe_layer(0) && lite.is_moe_layer(1) && lite.is_moe_layer(26));
    assert_eq!(
        routing(&lite.moe_config().unwrap()),
        (
            64,
            6,
            Some(2),
            1,
            1,
            TopkMethod::Greedy,
            ScoringFunc::Softmax,
            false,
            1.0
        )
    );
    assert_eq!(lite.rope_scaling, yarn(40.0, 32.0, 1.0, 0.707));
    // "15.7B total parameters".
    assert!(
        (15.6..15.8).contains(&billions(&lite)),
        "{}",
        billions(&lite)
    );
    assert_eq!(load("deepseek-v2-lite-transformers-5.json"), lite);
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/deepseek-v2-lite.json");
    assert_eq!(DeepSeekV3Config::from_file(shipped).unwrap(), lite);
}

#[test]
fn published_quantizations_the_model_cannot_run_are_refused() {
    for (name, method) in [
        ("kimi-k2-thinking.json", "\"compressed-tensors\""),
        ("deepseek-v2-lite-bnb-4bit.json", "\"bitsandbytes\""),
    ] {
        let cfg = parse(name);
        assert!(matches!(
            cfg.quantization,
            Some(Quantization::Unsupported { .. })
        ));
        let e = DeepSeekV3Config::from_file(path(name)).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains(method) && msg.contains("supported: fp8"),
            "{msg}"
        );
    }
}
