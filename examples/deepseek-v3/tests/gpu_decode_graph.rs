//! GPU test: decode steps replayed from whole-step CUDA graphs (`decode_graph`) against the
//! same steps run eagerly, on one GPU, with a random tiny model in bf16, and with one in
//! DeepSeek-V3's block-scaled fp8 format (experts, `o_proj` and the dense MLP on the fp8 GEMMs,
//! captured with the rest): logits of every step
//! within bf16 tolerance and the same greedy tokens, while sequences join and leave (batch
//! buckets 4 -> 8 -> 4) and the longest sequence crosses a key-length bucket (256 -> 512).
//! Prints `N passed, N failed`.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};
use deepseek_v3::config::{DeepSeekV3Config, Quantization, ScaleFmt, FP8_BLOCK};
use deepseek_v3::decode_graph::DecodeGraphs;
use deepseek_v3::kv_cache::KvCache;
use deepseek_v3::loader::{self, LoadOptions, MoeBackend};
use deepseek_v3::model::{DeepSeekV3, SeqInput, StepKind};
use moe_layer::ep_runtime::{Buffer, BufferConfig};

type R<T> = Result<T, Box<dyn std::error::Error>>;
/// A named test case.
type Case = (&'static str, fn() -> R<()>);

/// Redundant expert slots of the re-placement case.
const REDUNDANT: usize = 4;

fn model(dev: &Device, fp8: bool) -> R<DeepSeekV3> {
    model_with(dev, fp8, false)
}

/// The test model; with `placed`, its MoE layers hold [`REDUNDANT`] extra slots (placed for
/// equal loads), ready to be re-placed.
fn model_with(dev: &Device, fp8: bool, placed: bool) -> R<DeepSeekV3> {
    let mut cfg = DeepSeekV3Config::tiny();
    if fp8 {
        // Widths every fp8 GEMM takes (multiples of 128 along k), and a hidden size wide
        // enough for `o_proj` and the dense MLP to stay fp8 (`attention::FP8_MIN_OUTPUTS`).
        cfg.hidden_size = deepseek_v3::attention::FP8_MIN_OUTPUTS;
        cfg.intermediate_size = 256;
        cfg.moe_intermediate_size = 128;
        cfg.q_lora_rank = Some(128);
        cfg.kv_lora_rank = 128;
        cfg.qk_nope_head_dim = 32;
        cfg.qk_rope_head_dim = 32;
        cfg.v_head_dim = 32;
        cfg.quantization = Some(Quantization::Fp8 {
            block: FP8_BLOCK,
            scale_fmt: ScaleFmt::Float,
        });
    }
    let e = cfg.n_routed_experts.ok_or("no experts")?;
    let placements = if placed {
        deepseek_v3::placements::ExpertPlacements::plan(&cfg, 1, 1, REDUNDANT, None)?.map(Arc::new)
    } else {
        None
    };
    let slots = placements.as_ref().map_or(e, |p| p.num_physical);
    let bcfg = BufferConfig::default().with_low_latency(8, cfg.hidden_size, slots);
    let buffer = Arc::new(Buffer::single(dev, bcfg)?);
    let loaded = loader::load_random(
        cfg,
        7,
        LoadOptions {
            device: dev.clone(),
            dtype: DType::BF16,
            max_positions: 1024,
            moe: MoeBackend::ExpertParallel {
                buffer,
                options: moe_layer::MoeLayerOptions {
                    low_latency_max_tokens: 8,
                    ..Default::default()
                },
                placements,
            },
            progress: false,
        },
    )?;
    Ok(loaded.model)
}

/// Prefills `prompts` (sequence keys `keys`) in `cache`.
fn prefill(m: &DeepSeekV3, cache: &mut KvCache, keys: &[u64], prompts: &[Vec<u32>]) -> R<()> {
    for &k in keys {
        cache.insert(k)?;
    }
    let inputs: Vec<SeqInput<'_>> = keys
        .iter()
        .zip(prompts)
        .map(|(&seq, p)| SeqInput { seq, tokens: p })
        .collect();
    m.forward(cache, &inputs, StepKind::Prefill)?;
    Ok(())
}

/// Relative L2 error of `got` against `want` (both `[n, vocab]` f32).
fn rel(got: &Tensor, want: &Tensor) -> R<f64> {
    let e = (got - want)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let w = want.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    Ok((e / w.max(1e-30)).sqrt())
}

/// Re-places every MoE layer of `m` for a skew (expert `x` drawing `1 / (1 + x)`): the slots
/// that change are written in place, so captured steps stay valid. Returns the slots moved.
fn re_place(m: &mut DeepSeekV3) -> R<usize> {
    let mut moved = 0;
    for (_, layer) in m.moe_layers_mut() {
        let current = layer.expert_map().ok_or("a layer without placement")?;
        let (e, p) = (current.num_logical(), current.num_physical());
        let loads: Vec<f64> = (0..e).map(|x| 1.0 / (1 + x) as f64).collect();
        let next = moe_layer::placement::place(
            &loads,
            moe_layer::placement::PlacementShape {
                num_physical: p,
                num_groups: 1,
                num_nodes: 1,
                num_gpus: 1,
            },
        )?;
        moved += layer.replace_experts(next)?.moved_slots;
    }
    if moved == 0 {
        return Err("the re-placement moved no expert".into());
    }
    Ok(moved)
}

fn graphs_match_eager(fp8: bool) -> R<()> {
    graphs_match_eager_with(fp8, false)
}

/// Captured decode steps against eager ones over batch and key-length buckets; with
/// `re_placed`, the experts are re-placed midway, after steps were captured.
fn graphs_match_eager_with(fp8: bool, re_placed: bool) -> R<()> {
    let dev = Device::new_cuda(0)?;
    let mut m = model_with(&dev, fp8, re_placed)?;
    if !DecodeGraphs::supported(&m) {
        return Err("a one-GPU model must support captured decode steps".into());
    }
    if fp8 && (!m.fp8_experts() || m.fp8_dense_weights() != 4 + 3) {
        return Err(format!(
            "fp8 model: experts fp8 {}, {} dense weights on the fp8 GEMMs (want 7)",
            m.fp8_experts(),
            m.fp8_dense_weights()
        )
        .into());
    }
    let mut eager = m.new_kv_cache(8)?;
    let mut captured = m.new_kv_cache(8)?;
    let mut graphs = DecodeGraphs::default();
    let prompt = |len: usize, seed: u32| -> Vec<u32> {
        (0..len as u32).map(|i| 2 + (i * 7 + seed) % 300).collect()
    };
    // Three sequences; the longest (250 tokens) crosses 256 keys after a few steps.
    let mut keys: Vec<u64> = vec![10, 11, 12];
    let prompts = vec![prompt(250, 1), prompt(5, 2), prompt(40, 3)];
    for cache in [&mut eager, &mut captured] {
        prefill(&m, cache, &keys, &prompts)?;
    }
    let mut last: Vec<u32> = vec![5, 6, 7];
    for step in 0..14 {
        if re_placed && step == 6 {
            let moved = re_place(&mut m)?;
            println!("       step {step}: {moved} expert slots re-placed");
        }
        if step == 4 {
            // Two sequences join: batch bucket 4 -> 8.
            let more = vec![prompt(17, 4), prompt(3, 5)];
            for cache in [&mut eager, &mut captured] {
                prefill(&m, cache, &[13, 14], &more)?;
            }
            keys.extend([13, 14]);
            last.extend([8, 9]);
        }
        if step == 9 {
            // Sequence 11 leaves (the last slot's sequence moves into its slot): bucket 4.
            for cache in [&mut eager, &mut captured] {
                cache.remove(11)?;
            }
            let i = keys.iter().position(|&k| k == 11).ok_or("no 11")?;
            keys.remove(i);
            last.remove(i);
        }
        // The caches' slot order (both caches move sequences alike).
        let order: Vec<u64> = eager.keys().to_vec();
        if captured.keys() != order.as_slice() {
            return Err("the two caches disagree on slot order".into());
        }
        let tokens: Vec<u32> = order
            .iter()
            .map(|k| last[keys.iter().position(|x| x == k).unwrap()])
            .collect();
        let one: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
        let inputs: Vec<SeqInput<'_>> = order
            .iter()
            .zip(&one)
            .map(|(&seq, t)| SeqInput { seq, tokens: t })
            .collect();
        let want = m.forward(&mut eager, &inputs, StepKind::Decode)?;
        let got = graphs
            .step(&m, &mut captured, &tokens)?
            .to_dtype(DType::F32)?;
        if got.dims() != want.dims() {
            return Err(format!("step {step}: {:?} vs {:?}", got.dims(), want.dims()).into());
        }
        let r = rel(&got, &want)?;
        let g: Vec<u32> = got.argmax(D::Minus1)?.to_vec1()?;
        let w: Vec<u32> = want.argmax(D::Minus1)?.to_vec1()?;
        if r > 2e-2 {
            return Err(format!("step {step}: relative error {r:.2e} against eager").into());
        }
        let agree = g.iter().zip(&w).filter(|(a, b)| a == b).count();
        if agree + 1 < g.len() {
            return Err(format!("step {step}: greedy tokens {g:?} vs eager {w:?}").into());
        }
        println!("       step {step}: {} seqs, rel {r:.1e}", order.len());
        for (k, t) in order.iter().zip(&w) {
            let i = keys.iter().position(|x| x == k).unwrap();
            last[i] = *t;
        }
        for (a, b) in eager.keys().iter().zip(captured.keys()) {
            if eager.len_of(*a) != captured.len_of(*b) {
                return Err(format!("step {step}: cache lengths differ").into());
            }
        }
    }
    // Shapes used: batch buckets 4 and 8, key buckets 256 and 512.
    if graphs.len() < 3 {
        return Err(format!("only {} captured shapes", graphs.len()).into());
    }
    Ok(())
}

fn bad_step_is_refused() -> R<()> {
    let dev = Device::new_cuda(0)?;
    let m = model(&dev, false)?;
    let mut cache = m.new_kv_cache(4)?;
    prefill(&m, &mut cache, &[1, 2], &[vec![3, 4], vec![5]])?;
    let mut graphs = DecodeGraphs::default();
    match graphs.step(&m, &mut cache, &[7]) {
        Err(e) if e.to_string().contains("2 live sequences") => Ok(()),
        Err(e) => Err(format!("error does not name the live sequences: {e}").into()),
        Ok(_) => Err("a step with one token for two sequences was accepted".into()),
    }
}

fn main() {
    let cases: [Case; 4] = [
        ("captured-steps-match-eager", || graphs_match_eager(false)),
        ("captured-fp8-steps-match-eager", || {
            graphs_match_eager(true)
        }),
        ("bad-step-is-refused", bad_step_is_refused),
        ("captured-steps-match-eager-across-a-re-placement", || {
            graphs_match_eager_with(false, true)
        }),
    ];
    let mut suite = gpu_test_suite::Suite::from_args();
    for (name, f) in cases {
        suite.run(name, f);
    }
    suite.finish();
}
