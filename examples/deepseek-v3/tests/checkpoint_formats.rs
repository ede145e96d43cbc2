//! Checkpoints in every format the example reads, written small: f32 and bf16 tensors,
//! DeepSeek-V3's block-scaled FP8 release format (with its multi-token-prediction layer), and
//! configs as DeepSeek, transformers 4.5x and transformers 5 write them. Each loads on the CPU
//! and its greedy steps equal the independent reference's (`common::reference`: the dense
//! model on the dequantized weights) at 1 and 4 ranks; every format the example does not run is
//! refused before any weight is read, naming the tensor or setting, its dtype and what is
//! supported.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::reference::{
    buffer_config, check_against_reference, load_ep, load_ep_placed, Reference,
};
use deepseek_v3::checkpoint;
use deepseek_v3::config::{DeepSeekV3Config, Quantization, ScaleFmt, FP8_BLOCK};
use deepseek_v3::loader::{self, LoadOptions, MoeBackend};
use moe_layer::ep_runtime::Buffer;

/// How `config.json` is written.
#[derive(Clone, Copy, Debug)]
enum ConfigForm {
    /// As DeepSeek's published configs (`rope_theta`, `rope_scaling`, `torch_dtype`).
    DeepSeek,
    /// As transformers 4.5x re-saves them (`rope_interleave`, `head_dim`, `qk_head_dim`, a
    /// `rope_scaling` with both `type` and `rope_type` when there is one).
    Transformers4,
    /// As transformers 5 writes them (`rope_parameters` instead of `rope_theta`, `dtype`).
    Transformers5,
}

/// A tiny checkpoint in `storage` (and fp8 when `fp8`), its config in `form`; with `mtp`, a
/// multi-token-prediction layer `model.layers.4.*` as DeepSeek-V3's checkpoints carry (with a
/// tensor of a dtype the model could not run, to show it is never read).
fn write(name: &str, storage: DType, fp8: bool, form: ConfigForm, mtp: bool) -> PathBuf {
    let dir = common::scratch(name);
    let mut cfg = DeepSeekV3Config::tiny();
    if fp8 {
        cfg.quantization = Some(Quantization::Fp8 {
            block: FP8_BLOCK,
            scale_fmt: ScaleFmt::Float,
        });
    }
    checkpoint::generate_stored(&dir, &cfg, 31, 2, storage, false).unwrap();
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let obj = json.as_object_mut().unwrap();
    match form {
        ConfigForm::DeepSeek => {}
        ConfigForm::Transformers4 => {
            obj.insert("rope_interleave".into(), true.into());
            obj.insert("head_dim".into(), cfg.qk_rope_head_dim.into());
            obj.insert("qk_head_dim".into(), cfg.q_head_dim().into());
            obj.insert("rope_scaling".into(), serde_json::Value::Null);
            obj.insert("transformers_version".into(), "4.55.0".into());
        }
        ConfigForm::Transformers5 => {
            let theta = obj.remove("rope_theta").unwrap();
            obj.remove("rope_scaling");
            obj.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_type": "default", "rope_theta": theta}),
            );
            obj.insert("rope_interleave".into(), true.into());
            let dtype = obj.remove("torch_dtype").unwrap();
            obj.insert("dtype".into(), dtype);
            obj.insert("transformers_version".into(), "5.24.0".into());
        }
    }
    if mtp {
        obj.insert("num_nextn_predict_layers".into(), 1.into());
        let shard = loader::safetensors_files(&dir).unwrap().pop().unwrap();
        let mut t = candle_core::safetensors::load(&shard, &Device::Cpu).unwrap();
        let h = cfg.hidden_size;
        t.insert(
            "model.layers.4.eh_proj.weight".into(),
            Tensor::zeros((h, 2 * h), DType::F8E4M3, &Device::Cpu).unwrap(),
        );
        t.insert(
            "model.layers.4.eh_proj.weight_scale_inv".into(),
            Tensor::ones((1, 2), DType::F32, &Device::Cpu).unwrap(),
        );
        t.insert(
            "model.layers.4.enorm.weight".into(),
            Tensor::zeros(h, DType::I64, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&t, &shard).unwrap();
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    dir
}

/// The checkpoint at `dir` on one rank and on four (threads, uneven prompts): every greedy
/// step's logits equal the reference's (and so its tokens, see `check_against_reference`).
fn check_one_and_four_ranks(dir: &Path) {
    let reference = Arc::new(Reference::load(dir));
    let cfg = reference.cfg.clone();
    let one = Buffer::local_group(1, 1, buffer_config(&cfg))
        .unwrap()
        .pop()
        .unwrap();
    let m = load_ep(dir, one);
    let prompts = vec![
        m.tokenizer.encode_prompt("Block-scaled").unwrap(),
        vec![0, 33, 34, 35, 36, 37],
    ];
    check_against_reference(&m, &reference, &prompts, 4);
    let work = [
        vec![vec![0u32, 40, 50, 60, 70], vec![0, 9]],
        vec![vec![0u32, 100, 101, 102]],
        vec![],
        vec![vec![0u32, 7]],
    ];
    let handles: Vec<_> = Buffer::local_group(4, 4, buffer_config(&cfg))
        .unwrap()
        .into_iter()
        .zip(work)
        .map(|(buffer, prompts)| {
            let (dir, reference) = (dir.to_path_buf(), reference.clone());
            std::thread::spawn(move || {
                let m = load_ep(&dir, buffer);
                check_against_reference(&m, &reference, &prompts, 3)
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn f32_and_bf16_checkpoints_match_the_reference() {
    check_one_and_four_ranks(&write(
        "fmt-f32",
        DType::F32,
        false,
        ConfigForm::DeepSeek,
        false,
    ));
    check_one_and_four_ranks(&write(
        "fmt-bf16",
        DType::BF16,
        false,
        ConfigForm::DeepSeek,
        false,
    ));
}

#[test]
fn fp8_checkpoints_match_the_reference_on_their_dequantized_weights() {
    let dir = write("fmt-fp8", DType::BF16, true, ConfigForm::DeepSeek, true);
    // The release format indeed: every projection e4m3 with its scales.
    let st = candle_core::safetensors::load(
        loader::safetensors_files(&dir).unwrap().pop().unwrap(),
        &Device::Cpu,
    )
    .unwrap();
    let q = &st["model.layers.3.mlp.experts.5.up_proj.weight"];
    assert_eq!(q.dtype(), DType::F8E4M3);
    assert_eq!(
        st["model.layers.3.mlp.experts.5.up_proj.weight_scale_inv"].dims(),
        [1, 1]
    );
    assert_eq!(st["lm_head.weight"].dtype(), DType::BF16);
    check_one_and_four_ranks(&dir);
    // On the CPU every weight is dequantized: the model holds what the f32 one holds.
    let f32_dir = write(
        "fmt-fp8-f32",
        DType::F32,
        false,
        ConfigForm::DeepSeek,
        false,
    );
    let bytes = |d: &Path| {
        let cfg = DeepSeekV3Config::from_file(d.join("config.json")).unwrap();
        let b = Buffer::local_group(1, 1, buffer_config(&cfg))
            .unwrap()
            .pop()
            .unwrap();
        load_ep(d, b).model.weight_bytes()
    };
    let (fp8, plain) = (bytes(&dir), bytes(&f32_dir));
    assert_eq!(fp8, plain);
    assert!(fp8.routed_experts > 0 && fp8.shared_experts > 0 && fp8.other > 0);
}

#[test]
fn transformers_4_and_5_configs_match_the_reference() {
    for (name, form) in [
        ("fmt-fp8-t4", ConfigForm::Transformers4),
        ("fmt-fp8-t5", ConfigForm::Transformers5),
    ] {
        check_one_and_four_ranks(&write(name, DType::F32, true, form, false));
    }
}

/// Loading `dir` on one rank of the CPU: the error's text.
fn load_error(dir: &Path) -> String {
    let cfg = DeepSeekV3Config::from_file(dir.join("config.json"));
    let buffer = Buffer::local_group(
        1,
        1,
        cfg.as_ref()
            .map(buffer_config)
            .unwrap_or_else(|_| buffer_config(&DeepSeekV3Config::tiny())),
    )
    .unwrap()
    .pop()
    .unwrap();
    let opts = LoadOptions {
        device: Device::Cpu,
        dtype: DType::F32,
        max_positions: 64,
        moe: MoeBackend::ExpertParallel {
            buffer: Arc::new(buffer),
            options: moe_layer::MoeLayerOptions {
                low_latency_max_tokens: 8,
                ..Default::default()
            },
            placements: None,
        },
        progress: false,
    };
    format!("{:#}", loader::load(dir, opts).unwrap_err())
}

/// Rewrites the tensors of the checkpoint at `dir` with `edit`.
fn edit_tensors(dir: &Path, edit: impl Fn(&mut HashMap<String, Tensor>)) {
    for shard in loader::safetensors_files(dir).unwrap() {
        let mut t = candle_core::safetensors::load(&shard, &Device::Cpu).unwrap();
        edit(&mut t);
        candle_core::safetensors::save(&t, &shard).unwrap();
    }
}

#[test]
fn formats_the_example_does_not_run_are_refused_naming_what_and_why() {
    // A quantization_config of another method.
    let dir = write("fmt-awq", DType::F32, false, ConfigForm::DeepSeek, false);
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["quantization_config"] =
        serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128});
    std::fs::write(&path, json.to_string()).unwrap();
    let err = load_error(&dir);
    assert!(err.contains("awq") && err.contains("supported"), "{err}");

    // A tensor of a dtype the model does not run (GPTQ's packed weights).
    let dir = write("fmt-int", DType::F32, false, ConfigForm::DeepSeek, false);
    edit_tensors(&dir, |t| {
        if t.contains_key("model.layers.1.self_attn.o_proj.weight") {
            t.insert(
                "model.layers.1.self_attn.o_proj.qweight".into(),
                Tensor::zeros((8, 8), DType::I64, &Device::Cpu).unwrap(),
            );
        }
    });
    let err = load_error(&dir);
    assert!(
        err.contains("model.layers.1.self_attn.o_proj.qweight") && err.contains("I64"),
        "{err}"
    );

    // An fp8 weight without its scales, and scales of the wrong shape.
    let dir = write("fmt-noscale", DType::F32, true, ConfigForm::DeepSeek, false);
    edit_tensors(&dir, |t| {
        t.remove("model.layers.2.mlp.experts.3.down_proj.weight_scale_inv");
    });
    let err = load_error(&dir);
    assert!(
        err.contains("model.layers.2.mlp.experts.3.down_proj.weight_scale_inv")
            && err.contains("missing"),
        "{err}"
    );
    let dir = write(
        "fmt-badscale",
        DType::F32,
        true,
        ConfigForm::DeepSeek,
        false,
    );
    edit_tensors(&dir, |t| {
        if t.contains_key("model.layers.0.self_attn.q_b_proj.weight_scale_inv") {
            t.insert(
                "model.layers.0.self_attn.q_b_proj.weight_scale_inv".into(),
                Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap(),
            );
        }
    });
    let err = load_error(&dir);
    assert!(
        err.contains("q_b_proj.weight_scale_inv") && err.contains("[2, 2]"),
        "{err}"
    );
}

/// Redundant experts (`--num-redundant-experts 4`, placed from a file of skewed loads) on four
/// ranks: every greedy step's logits equal the reference's, as without them.
#[test]
fn redundant_experts_match_the_reference_on_four_ranks() {
    let dir = write(
        "fmt-redundant",
        DType::F32,
        false,
        ConfigForm::DeepSeek,
        false,
    );
    let reference = Arc::new(Reference::load(&dir));
    let cfg = reference.cfg.clone();
    let e = cfg.n_routed_experts.unwrap();
    let loads = dir.join("loads.json");
    let hot: Vec<String> = (0..e)
        .map(|x| format!("{}", 1 + 50 * usize::from(x % 5 == 0)))
        .collect();
    std::fs::write(&loads, format!("[{}]", hot.join(", "))).unwrap();
    let placements = deepseek_v3::placements::ExpertPlacements::plan(&cfg, 4, 4, 4, Some(&loads))
        .unwrap()
        .map(Arc::new);
    let p = placements.as_ref().unwrap();
    assert_eq!(p.num_physical, e + 4);
    let bcfg = buffer_config(&cfg).with_low_latency(8, cfg.hidden_size, e + 4);
    let work = [
        vec![vec![0u32, 40, 50, 60, 70], vec![0, 9]],
        vec![vec![0u32, 100, 101, 102]],
        vec![],
        vec![vec![0u32, 7]],
    ];
    let handles: Vec<_> = Buffer::local_group(4, 4, bcfg)
        .unwrap()
        .into_iter()
        .zip(work)
        .map(|(buffer, prompts)| {
            let (dir, reference, placements) = (dir.clone(), reference.clone(), placements.clone());
            std::thread::spawn(move || {
                let m = load_ep_placed(&dir, buffer, placements);
                check_against_reference(&m, &reference, &prompts, 3)
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}
