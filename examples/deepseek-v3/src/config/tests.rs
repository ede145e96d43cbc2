//! Unit tests of the configuration reader.

use super::*;

/// The shape of DeepSeek-V3's published `config.json` (values typed in, extra fields kept).
const V3_LIKE: &str = r#"{
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": true,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": false,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
}"#;

#[test]
fn parses_a_v3_config() {
    let cfg: DeepSeekV3Config = serde_json::from_str(V3_LIKE).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.q_head_dim(), 192);
    assert!(!cfg.is_moe_layer(2));
    assert!(cfg.is_moe_layer(3));
    let moe = cfg.moe_config().unwrap();
    assert_eq!(moe.n_routed_experts, 256);
    assert_eq!(moe.num_experts_per_tok, 8);
    assert_eq!(cfg.rope_scaling.as_ref().unwrap().factor, 40.0);
}

#[test]
fn the_shipped_v2_lite_config_is_v2_lite_shaped() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/deepseek-v2-lite.json");
    let cfg = DeepSeekV3Config::from_file(path).unwrap();
    assert_eq!(cfg.q_lora_rank, None);
    assert!(!cfg.is_moe_layer(0) && cfg.is_moe_layer(1) && cfg.is_moe_layer(26));
    let moe = cfg.moe_config().unwrap();
    assert_eq!(
        (
            moe.n_routed_experts,
            moe.num_experts_per_tok,
            moe.n_shared_experts
        ),
        (64, 6, Some(2))
    );
    assert_eq!(moe.scoring_func, moe_layer::config::ScoringFunc::Softmax);
    assert_eq!(moe.topk_method, moe_layer::config::TopkMethod::Greedy);
    assert!(!moe.norm_topk_prob && moe.routed_scaling_factor == 1.0);
    // About 15.7 B weights: 31 GB in bf16.
    let n = cfg.num_parameters() as f64 / 1e9;
    assert!((15.6..15.8).contains(&n), "{n} B parameters");
}

#[test]
fn parameter_count_matches_the_generated_tensors() {
    let tiny = DeepSeekV3Config::tiny();
    let dir = std::env::temp_dir().join(format!("dsv3-params-{}", std::process::id()));
    crate::checkpoint::generate(&dir, &tiny, 1, 1).unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let bytes = index["metadata"]["total_size"].as_u64().unwrap() as usize;
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(tiny.num_parameters() * 4, bytes);
}

#[test]
fn tiny_round_trips_and_bad_values_are_named() {
    let tiny = DeepSeekV3Config::tiny();
    let back: DeepSeekV3Config = serde_json::from_str(&tiny.to_hf_json().unwrap()).unwrap();
    assert_eq!(back, tiny);
    let mut bad = tiny.clone();
    bad.qk_rope_head_dim = 7;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("qk_rope_head_dim"));
    let mut bad = tiny;
    bad.hidden_act = "gelu".into();
    assert!(bad.validate().unwrap_err().to_string().contains("gelu"));
}

/// The tiny preset's `config.json` with `edit` applied, parsed (not validated).
fn tiny_with(edit: impl FnOnce(&mut serde_json::Value)) -> Result<DeepSeekV3Config> {
    let mut v: serde_json::Value = serde_json::from_str(&DeepSeekV3Config::tiny().to_hf_json()?)?;
    edit(&mut v);
    Ok(serde_json::from_value(v)?)
}

fn yarn() -> RopeScaling {
    RopeScaling {
        kind: "yarn".into(),
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 1.0,
    }
}

#[test]
fn every_rope_spelling_reads_the_same() {
    let mut want = DeepSeekV3Config::tiny();
    want.rope_scaling = Some(yarn());
    let block = serde_json::json!({"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096});
    let with = |extra: serde_json::Value| {
        let mut b = block.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    // DeepSeek's form, transformers 4.5x's re-save, transformers 5's (with and without the
    // top-level rope_theta).
    let forms = [
        ("rope_scaling", serde_json::json!({"type": "yarn"}), true),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "rope_type": "yarn"}),
            true,
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000}),
            false,
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "type": "yarn"}),
            true,
        ),
    ];
    for (field, kind, keep_theta) in forms {
        let cfg = tiny_with(|v| {
            let o = v.as_object_mut().unwrap();
            o.insert(field.into(), with(kind.clone()));
            if !keep_theta {
                o.remove("rope_theta");
            }
        })
        .unwrap_or_else(|e| panic!("{field} {kind}: {e:#}"));
        assert_eq!(cfg, want, "{field} {kind}");
    }
    // transformers 5 without scaling.
    let plain = tiny_with(|v| {
        let o = v.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 50000.0}),
        );
    })
    .unwrap();
    assert_eq!((plain.rope_theta, plain.rope_scaling), (50000.0, None));
    let halves = tiny_with(|v| v["rope_interleave"] = false.into()).unwrap();
    assert!(!halves.rope_interleave);
    let back: DeepSeekV3Config = serde_json::from_str(&halves.to_hf_json().unwrap()).unwrap();
    assert_eq!(back, halves);
}

#[test]
fn unsupported_or_inconsistent_rope_is_named() {
    let err = |edit: serde_json::Value| {
        tiny_with(|v| {
            v.as_object_mut()
                .unwrap()
                .extend(edit.as_object().unwrap().clone())
        })
        .unwrap_err()
        .to_string()
    };
    for kind in ["linear", "dynamic", "llama3", "longrope"] {
        let e = err(serde_json::json!({"rope_scaling": {"rope_type": kind, "factor": 4.0}}));
        assert!(e.contains(kind) && e.contains("yarn"), "{e}");
        let e = err(serde_json::json!({"rope_parameters": {"rope_type": kind, "factor": 4.0}}));
        assert!(e.contains(kind) && e.contains("rope_parameters"), "{e}");
    }
    let e = err(
        serde_json::json!({"rope_scaling": {"type": "yarn", "rope_type": "linear",
        "factor": 4.0, "original_max_position_embeddings": 4096}}),
    );
    assert!(e.contains("disagree"), "{e}");
    let e =
        err(serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}));
    assert!(
        e.contains("rope_theta 10000 and rope_parameters.rope_theta 1"),
        "{e}"
    );
    let e = err(serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0}}));
    assert!(e.contains("original_max_position_embeddings"), "{e}");
    let e = tiny_with(|v| {
        v.as_object_mut().unwrap().remove("rope_theta");
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("missing rope_theta"), "{e}");
}

#[test]
fn token_ids_may_be_lists() {
    let cfg = tiny_with(|v| {
        v["bos_token_id"] = serde_json::json!([0]);
        v["eos_token_id"] = serde_json::json!([1, 7, 9]);
    })
    .unwrap();
    assert_eq!(
        (
            cfg.bos_token_id,
            cfg.eos_token_id,
            &cfg.extra_eos_token_ids[..]
        ),
        (Some(0), Some(1), &[7, 9][..])
    );
    let json: serde_json::Value = serde_json::from_str(&cfg.to_hf_json().unwrap()).unwrap();
    assert_eq!(json["eos_token_id"], serde_json::json!([1, 7, 9]));
    let back: DeepSeekV3Config = serde_json::from_value(json).unwrap();
    assert_eq!(back, cfg);
    let none = tiny_with(|v| v["eos_token_id"] = serde_json::Value::Null).unwrap();
    assert_eq!(none.eos_token_id, None);
    let e = tiny_with(|v| v["eos_token_id"] = serde_json::json!("</s>")).unwrap_err();
    assert!(e.to_string().contains("eos_token_id"), "{e}");
}

#[test]
fn model_types_are_recorded_and_unknown_ones_refused() {
    for (name, ty) in [
        ("deepseek_v3", ModelType::DeepseekV3),
        ("deepseek_v2", ModelType::DeepseekV2),
        ("kimi_k2", ModelType::KimiK2),
    ] {
        let cfg = tiny_with(|v| v["model_type"] = name.into()).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.model_type, ty);
        let json: serde_json::Value = serde_json::from_str(&cfg.to_hf_json().unwrap()).unwrap();
        assert_eq!(json["model_type"], name);
    }
    let absent = tiny_with(|v| {
        v.as_object_mut().unwrap().remove("model_type");
    })
    .unwrap();
    assert_eq!(absent.model_type, ModelType::DeepseekV3);
    let cfg = tiny_with(|v| v["model_type"] = "deepseek_v32".into()).unwrap();
    let e = cfg.validate().unwrap_err().to_string();
    assert!(
        e.contains("\"deepseek_v32\"") && e.contains("kimi_k2"),
        "{e}"
    );
}

#[test]
fn null_groups_read_as_one() {
    let cfg = tiny_with(|v| {
        v["topk_method"] = "greedy".into();
        v["n_group"] = serde_json::Value::Null;
        v["topk_group"] = serde_json::Value::Null;
    })
    .unwrap();
    assert_eq!((cfg.n_group, cfg.topk_group), (1, 1));
    cfg.validate().unwrap();
}

#[test]
fn fp8_quantization_is_typed_and_round_trips() {
    let q = |qc: serde_json::Value| tiny_with(|v| v["quantization_config"] = qc).unwrap();
    let v3 = q(
        serde_json::json!({"activation_scheme": "dynamic", "fmt": "e4m3",
        "quant_method": "fp8", "weight_block_size": [128, 128]}),
    );
    let fp8 = |scale_fmt| Quantization::Fp8 {
        block: [128, 128],
        scale_fmt,
    };
    assert_eq!(v3.quantization, Some(fp8(ScaleFmt::Float)));
    let bare = q(serde_json::json!({"quant_method": "fp8"}));
    assert_eq!(bare.quantization, Some(fp8(ScaleFmt::Float)));
    let v31 = q(
        serde_json::json!({"activation_scheme": "dynamic", "fmt": "e4m3",
        "quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}),
    );
    assert_eq!(v31.quantization, Some(fp8(ScaleFmt::Ue8m0)));
    for cfg in [v3, bare, v31] {
        cfg.validate().unwrap();
        let back: DeepSeekV3Config = serde_json::from_str(&cfg.to_hf_json().unwrap()).unwrap();
        assert_eq!(back, cfg);
    }
    let json: serde_json::Value =
        serde_json::from_str(&DeepSeekV3Config::tiny().to_hf_json().unwrap()).unwrap();
    assert!(json.get("quantization_config").is_none());
}

#[test]
fn unsupported_quantization_is_refused_by_name() {
    let cases = [
        (
            serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128}),
            "\"awq\"",
        ),
        (
            serde_json::json!({"quant_method": "gptq", "bits": 4}),
            "\"gptq\"",
        ),
        (
            serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized"}),
            "\"compressed-tensors\"",
        ),
        (serde_json::json!({"quant_method": "mxfp4"}), "\"mxfp4\""),
        (
            serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
            "\"bitsandbytes\"",
        ),
        (
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [64, 64]}),
            "weight_block_size [64, 64]",
        ),
        (
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128]}),
            "weight_block_size [128]",
        ),
        (
            serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"}),
            "activation_scheme \"static\"",
        ),
        (
            serde_json::json!({"quant_method": "fp8", "fmt": "e5m2"}),
            "fmt \"e5m2\"",
        ),
        (
            serde_json::json!({"quant_method": "fp8", "scale_fmt": "e8m0"}),
            "scale_fmt \"e8m0\"",
        ),
        (serde_json::json!({"bits": 4}), "no quant_method"),
    ];
    for (qc, named) in cases {
        let cfg = tiny_with(|v| v["quantization_config"] = qc.clone()).unwrap();
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains(named) && e.contains("supported"), "{qc}: {e}");
        assert!(!e.contains('\n'), "{e}");
        let back: DeepSeekV3Config = serde_json::from_str(&cfg.to_hf_json().unwrap()).unwrap();
        assert_eq!(back, cfg, "{qc}");
    }
}
