//! The memory plan (`deepseek_v3::memory_plan`): what it computes from the shapes is what a
//! loaded rank holds (every variant of the weights' shapes, f32 and bf16, 1 and 2 ranks, a
//! checkpoint in the fp8 release format on the CPU), and from DeepSeek-V3's published config it
//! shows that the full model (61 layers, 671 B parameters) at FP8 fits a node of 8 H200s at
//! world size 8 with a stated KV budget, and that bf16 does not.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device};
use deepseek_v3::app::buffer_config;
use deepseek_v3::checkpoint;
use deepseek_v3::config::{DeepSeekV3Config, Quantization, ScaleFmt, FP8_BLOCK};
use deepseek_v3::loader::{self, LoadOptions, LoadedModel, MoeBackend};
use deepseek_v3::memory_plan::{MemoryPlan, PlanInput};
use moe_layer::ep_runtime::{Buffer, BufferConfig};

const MAX_BATCH: usize = 8;
const POSITIONS: usize = 96;

fn options(buffer: Buffer, dtype: DType) -> LoadOptions {
    LoadOptions {
        device: Device::Cpu,
        dtype,
        max_positions: POSITIONS,
        moe: MoeBackend::ExpertParallel {
            buffer: Arc::new(buffer),
            options: moe_layer::MoeLayerOptions {
                low_latency_max_tokens: MAX_BATCH,
                ..Default::default()
            },
            placements: None,
        },
        progress: false,
    }
}

fn buffers(cfg: &DeepSeekV3Config, world: usize) -> (BufferConfig, Vec<Buffer>) {
    let bcfg = buffer_config(cfg, world, MAX_BATCH, 512, Duration::from_secs(30)).unwrap();
    let group = Buffer::local_group(world, world, bcfg.clone()).unwrap();
    (bcfg, group)
}

fn plan(
    cfg: &DeepSeekV3Config,
    world: usize,
    dtype: DType,
    fp8_checkpoint: bool,
    buffer: &BufferConfig,
) -> MemoryPlan {
    MemoryPlan::new(&PlanInput {
        config: cfg,
        world_size: world,
        gpus_per_node: world,
        dtype,
        on_gpu: false,
        fp8_checkpoint,
        kv_sequences: MAX_BATCH,
        max_positions: POSITIONS,
        buffer,
        redundant_experts: 0,
    })
    .unwrap()
}

/// Checks every rank's model against the plan.
fn check(name: &str, models: &[LoadedModel], want: &MemoryPlan) {
    for (rank, m) in models.iter().enumerate() {
        assert_eq!(m.model.weight_bytes(), want.weights, "{name} rank {rank}");
        let kv = deepseek_v3::kv_cache::KvCache::bytes(
            m.model.kv_shape(),
            MAX_BATCH,
            m.model.max_positions(),
            m.model.dtype(),
        );
        assert_eq!(kv, want.kv_cache, "{name} rank {rank}: KV cache");
    }
    assert_eq!(want.ep_buffers.total(), 0, "no device buffers on the CPU");
}

#[test]
fn the_plan_is_what_a_loaded_rank_holds() {
    let tiny = DeepSeekV3Config::tiny();
    let variants: Vec<(&str, DeepSeekV3Config)> = vec![
        ("tiny", tiny.clone()),
        (
            "tied-embeddings",
            DeepSeekV3Config {
                tie_word_embeddings: true,
                ..tiny.clone()
            },
        ),
        (
            "attention-bias",
            DeepSeekV3Config {
                attention_bias: true,
                ..tiny.clone()
            },
        ),
        (
            "full-rank-q",
            DeepSeekV3Config {
                q_lora_rank: None,
                ..tiny.clone()
            },
        ),
        (
            "no-shared-experts",
            DeepSeekV3Config {
                n_shared_experts: None,
                ..tiny.clone()
            },
        ),
    ];
    for (name, cfg) in &variants {
        for dtype in [DType::F32, DType::BF16] {
            for world in [1, 2] {
                let (bcfg, group) = buffers(cfg, world);
                let models: Vec<LoadedModel> = group
                    .into_iter()
                    .map(|b| loader::load_random(cfg.clone(), 5, options(b, dtype)).unwrap())
                    .collect();
                let want = plan(cfg, world, dtype, false, &bcfg);
                check(&format!("{name} {dtype:?} world {world}"), &models, &want);
            }
        }
    }
}

#[test]
fn random_fp8_weights_are_planned_as_an_fp8_checkpoint() {
    let mut cfg = DeepSeekV3Config::tiny();
    cfg.quantization = Some(Quantization::Fp8 {
        block: FP8_BLOCK,
        scale_fmt: ScaleFmt::Float,
    });
    let (bcfg, group) = buffers(&cfg, 2);
    let models: Vec<LoadedModel> = group
        .into_iter()
        .map(|b| loader::load_random(cfg.clone(), 4, options(b, DType::BF16)).unwrap())
        .collect();
    // Every projection of a rank: 4 layers' attention (5), a dense MLP, 3 MoE layers of 8
    // local experts and the shared one.
    assert_eq!(models[0].report.fp8_weights, 4 * 5 + 3 + 3 * (8 + 1) * 3);
    check(
        "random fp8",
        &models,
        &plan(&cfg, 2, DType::BF16, true, &bcfg),
    );
}

#[test]
fn an_fp8_checkpoint_on_the_cpu_is_planned_dequantized() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memory-plan-fp8-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = DeepSeekV3Config::tiny();
    cfg.quantization = Some(Quantization::Fp8 {
        block: FP8_BLOCK,
        scale_fmt: ScaleFmt::Float,
    });
    checkpoint::generate_stored(&dir, &cfg, 3, 1, DType::BF16, false).unwrap();
    let (bcfg, group) = buffers(&cfg, 2);
    let models: Vec<LoadedModel> = group
        .into_iter()
        .map(|b| loader::load(&dir, options(b, DType::F32)).unwrap())
        .collect();
    check(
        "fp8 checkpoint",
        &models,
        &plan(&cfg, 2, DType::F32, true, &bcfg),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// DeepSeek-V3's published `config.json`.
fn deepseek_v3() -> DeepSeekV3Config {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs/deepseek-v3.json");
    DeepSeekV3Config::from_file(path).unwrap()
}

/// An H200 as `nvidia-smi` counts it (143771 MiB).
const H200_BYTES: usize = 143_771 << 20;
/// What the CUDA context and libraries take before the model (measured on an H200: about
/// 0.6 GiB; 1 GiB stated).
const CONTEXT_BYTES: usize = 1 << 30;

#[test]
fn full_deepseek_v3_fits_eight_h200s_at_fp8_and_not_in_bf16() {
    let cfg = deepseek_v3();
    assert_eq!(cfg.num_hidden_layers, 61);
    let params = cfg.num_parameters() as f64 / 1e9;
    assert!((660.0..675.0).contains(&params), "{params:.1} B parameters");
    // KV budget: 64 sequences of 4096 positions on each rank (262144 tokens of context per
    // rank, 2 Mi on the node), the low-latency mode sized for the same 64 tokens per rank.
    let (world, seqs, positions) = (8, 64, 4096);
    let bcfg = buffer_config(&cfg, world, seqs, 8192, Duration::from_secs(60)).unwrap();
    let on_h200 = |fp8_checkpoint: bool| {
        MemoryPlan::new(&PlanInput {
            config: &cfg,
            world_size: world,
            gpus_per_node: 8,
            dtype: DType::BF16,
            on_gpu: true,
            fp8_checkpoint,
            kv_sequences: seqs,
            max_positions: positions,
            buffer: &bcfg,
            redundant_experts: 0,
        })
        .unwrap()
    };
    let free = H200_BYTES - CONTEXT_BYTES;
    let reserve = MemoryPlan::reserve(H200_BYTES);
    let fp8 = on_h200(true);
    println!("fp8: {}", fp8.summary());
    assert_eq!(fp8.kv_slots, (seqs, positions));
    fp8.check_fits(free, reserve)
        .unwrap_or_else(|e| panic!("fp8 must fit: {e}"));
    // The routed experts are most of it, a byte a weight plus a scale a 128 x 128 block.
    let routed = 58 * 32 * (3 * 7168 * 2048 + 4 * 3 * 16 * 56);
    assert_eq!(fp8.weights.routed_experts, routed);
    let bf16 = on_h200(false);
    println!("bf16: {}", bf16.summary());
    let err = bf16.check_fits(free, reserve).unwrap_err().to_string();
    assert!(
        err.contains("more ranks") && err.contains("GiB free"),
        "{err}"
    );
    // Not even the bf16 routed experts alone fit.
    assert!(bf16.weights.routed_experts > free);
    // The rest (attention, dense MLPs, embedding and lm_head, norms, routers): the attention
    // projections but kv_b_proj and the dense MLPs in fp8 too, the embedding and lm_head as
    // stored (bf16).
    let embed_head = 2 * 129280 * 7168 * 2;
    let ratio = (fp8.weights.other - embed_head) as f64 / (bf16.weights.other - embed_head) as f64;
    println!("other weights but embedding and lm_head: fp8 / bf16 = {ratio:.3}");
    assert!((0.5..0.6).contains(&ratio), "{ratio}");
}

#[test]
fn the_six_layer_v3_shape_serves_on_one_h200_in_fp8_and_in_bf16() {
    // `configs/deepseek-v3-6-layers.json`: DeepSeek-V3's widths (256 experts of 2048, 8 per
    // token, hidden 7168) in 6 layers, 5 of them MoE; served as `serve-run.sh` does (64
    // sequences of 512 + 128 positions).
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/deepseek-v3-6-layers.json"
    );
    let cfg = DeepSeekV3Config::from_file(path).unwrap();
    assert!(!cfg.is_moe_layer(0) && (1..6).all(|l| cfg.is_moe_layer(l)));
    let (seqs, positions) = (64, 640);
    let bcfg = buffer_config(&cfg, 1, seqs, 512, Duration::from_secs(60)).unwrap();
    let plan = |fp8_checkpoint: bool| {
        MemoryPlan::new(&PlanInput {
            config: &cfg,
            world_size: 1,
            gpus_per_node: 1,
            dtype: DType::BF16,
            on_gpu: true,
            fp8_checkpoint,
            kv_sequences: seqs,
            max_positions: positions,
            buffer: &bcfg,
            redundant_experts: 0,
        })
        .unwrap()
    };
    let free = H200_BYTES - CONTEXT_BYTES;
    let reserve = MemoryPlan::reserve(H200_BYTES);
    for fp8 in [true, false] {
        let p = plan(fp8);
        println!("fp8 {fp8}: {}", p.summary());
        p.check_fits(free, reserve)
            .unwrap_or_else(|e| panic!("fp8 {fp8} must fit: {e}"));
    }
    // The routed experts, 5 layers of 256: 0.5x in fp8 (plus the scales).
    assert_eq!(
        plan(false).weights.routed_experts,
        5 * 256 * 3 * 7168 * 2048 * 2
    );
}

#[test]
fn fp8_checkpoints_keep_the_wide_projections_in_fp8_on_a_gpu() {
    use deepseek_v3::attention::fp8_projection;
    use deepseek_v3::model::fp8_dense_mlp;
    // DeepSeek-V3: q_b_proj, o_proj and the dense MLP stay fp8; q_a_proj, kv_a_proj_with_mqa
    // are too narrow.
    assert!(fp8_projection(24576, 1536, true) && fp8_projection(7168, 16384, true));
    assert!(!fp8_projection(1536, 7168, true) && !fp8_projection(576, 7168, true));
    assert!(fp8_dense_mlp(7168, 18432, true));
    // DeepSeek-V2-Lite (hidden 2048): q_proj and o_proj stay bf16; its dense MLP's 10944 is not
    // a multiple of 128.
    assert!(!fp8_projection(3072, 2048, true) && !fp8_projection(2048, 2048, true));
    assert!(!fp8_dense_mlp(2048, 10944, true));
    // The CPU dequantizes every one.
    assert!(!fp8_projection(7168, 16384, false) && !fp8_dense_mlp(7168, 18432, false));
}
