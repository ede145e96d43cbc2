//! The generator's checkpoint loads, and the model (KV cache, batched sequences, expert-parallel
//! MoE over 1 and 2 ranks) gives the same logits as a plain reference written here from the
//! tensors: naive attention over the whole sequence, no cache, RoPE from its definition, and
//! the dense single-process MoE (`moe_layer::dense::DenseMoe`).

mod common;

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::reference::{buffer_config, check_against_reference, load_ep, max_abs_diff, Reference};
use deepseek_v3::checkpoint;
use deepseek_v3::config::DeepSeekV3Config;
use deepseek_v3::loader::{self, LoadOptions, LoadedModel, MoeBackend};
use deepseek_v3::model::{SeqInput, StepKind};
use deepseek_v3::sampling::argmax;
use moe_layer::ep_runtime::Buffer;

#[test]
fn generated_checkpoint_matches_reference_on_one_rank() {
    let dir = common::scratch("forward-1");
    checkpoint::generate(&dir, &DeepSeekV3Config::tiny(), 7, 2).unwrap();
    let shards = loader::safetensors_files(&dir).unwrap();
    assert!(shards.len() >= 2, "expected >= 2 shards, got {shards:?}");
    let reference = Reference::load(&dir);
    let cfg = reference.cfg.clone();
    let buffer = Buffer::local_group(1, 1, buffer_config(&cfg))
        .unwrap()
        .pop()
        .unwrap();
    let m = load_ep(&dir, buffer);
    let prompts = vec![
        m.tokenizer.encode_prompt("The experts travel").unwrap(),
        m.tokenizer.encode_prompt("Hi").unwrap(),
        vec![5, 17, 200, 3, 9, 42, 301],
    ];
    check_against_reference(&m, &reference, &prompts, 3);
}

#[test]
fn two_ranks_as_threads_match_reference() {
    let dir = common::scratch("forward-2");
    checkpoint::generate(&dir, &DeepSeekV3Config::tiny(), 11, 3).unwrap();
    let reference = Arc::new(Reference::load(&dir));
    let buffers = Buffer::local_group(2, 2, buffer_config(&reference.cfg)).unwrap();
    // Rank 0 has two sequences, rank 1 one: uneven token counts in every MoE call.
    let work = [
        vec![vec![0u32, 40, 50, 60, 70], vec![0, 9]],
        vec![vec![0u32, 100, 101, 102]],
    ];
    let handles: Vec<_> = buffers
        .into_iter()
        .zip(work)
        .map(|(buffer, prompts)| {
            let dir = dir.clone();
            let reference = reference.clone();
            std::thread::spawn(move || {
                let m = load_ep(&dir, buffer);
                check_against_reference(&m, &reference, &prompts, 2)
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread failed");
    }
}

#[test]
fn a_rank_with_no_tokens_still_takes_part() {
    let dir = common::scratch("forward-empty");
    checkpoint::generate(&dir, &DeepSeekV3Config::tiny(), 5, 2).unwrap();
    let reference = Arc::new(Reference::load(&dir));
    let buffers = Buffer::local_group(2, 2, buffer_config(&reference.cfg)).unwrap();
    let work = [vec![vec![0u32, 33, 44, 55]], vec![]];
    let handles: Vec<_> = buffers
        .into_iter()
        .zip(work)
        .map(|(buffer, prompts)| {
            let dir = dir.clone();
            let reference = reference.clone();
            std::thread::spawn(move || {
                let m = load_ep(&dir, buffer);
                check_against_reference(&m, &reference, &prompts, 2)
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread failed");
    }
}

#[test]
fn generator_is_deterministic_and_tokenizer_round_trips() {
    let a = common::scratch("gen-a");
    let b = common::scratch("gen-b");
    checkpoint::generate(&a, &DeepSeekV3Config::tiny(), 3, 2).unwrap();
    checkpoint::generate(&b, &DeepSeekV3Config::tiny(), 3, 2).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        &checkpoint::shard_file_name(0, 2),
        &checkpoint::shard_file_name(1, 2),
    ] {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs between two runs with the same seed");
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(
        map["model.embed_tokens.weight"],
        checkpoint::shard_file_name(0, 2)
    );
    assert_eq!(map["lm_head.weight"], checkpoint::shard_file_name(1, 2));
    assert!(map.contains_key("model.layers.3.mlp.experts.15.down_proj.weight"));
    assert!(map.contains_key("model.layers.0.mlp.gate_proj.weight"));

    let tok = deepseek_v3::tokenizer::TextTokenizer::from_file(a.join("tokenizer.json")).unwrap();
    assert!(tok.vocab_size() <= DeepSeekV3Config::tiny().vocab_size);
    assert!(tok.vocab_size() > 260, "no merges were learned");
    let text = "The experts, 42 of them — héllo!";
    let ids = tok.encode(text).unwrap();
    assert!(
        ids.len() < text.len(),
        "merges did not shorten {text:?}: {ids:?}"
    );
    assert_eq!(tok.decode(&ids).unwrap(), text);
    let chat = tok
        .apply_chat_template(&[deepseek_v3::tokenizer::ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }])
        .unwrap();
    assert_eq!(chat.first(), tok.bos_id().as_ref());
    assert_eq!(
        chat.last(),
        tok.token_id(deepseek_v3::tokenizer::ASSISTANT).as_ref()
    );
}

fn load_dense(dir: &Path) -> anyhow::Result<LoadedModel> {
    loader::load(
        dir,
        LoadOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            max_positions: 64,
            moe: MoeBackend::Dense,
            progress: false,
        },
    )
}

#[test]
fn missing_or_misshaped_tensors_are_named() {
    let dir = common::scratch("bad-tensors");
    checkpoint::generate(&dir, &DeepSeekV3Config::tiny(), 1, 2).unwrap();
    let shard = dir.join(checkpoint::shard_file_name(0, 2));
    let mut tensors = candle_core::safetensors::load(&shard, &Device::Cpu).unwrap();
    let name = "model.layers.1.self_attn.kv_b_proj.weight";
    let good = tensors[name].dims().to_vec();
    tensors.insert(
        name.into(),
        Tensor::zeros((good[0], good[1] + 1), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &shard).unwrap();
    let err = format!("{:#}", load_dense(&dir).unwrap_err());
    assert!(err.contains(name), "{err}");
    assert!(
        err.contains(&format!("{:?}", good)) || err.contains(&format!("{}, {}", good[0], good[1])),
        "{err}"
    );
    assert!(err.contains(&format!("{}", good[1] + 1)), "{err}");

    tensors.insert(
        name.into(),
        Tensor::zeros((good[0], good[1]), DType::F32, &Device::Cpu).unwrap(),
    );
    tensors.remove("model.layers.0.mlp.up_proj.weight");
    candle_core::safetensors::save(&tensors, &shard).unwrap();
    let err = format!("{:#}", load_dense(&dir).unwrap_err());
    assert!(err.contains("model.layers.0.mlp.up_proj.weight"), "{err}");
}

#[test]
fn each_rank_reads_only_its_experts() {
    let dir = common::scratch("expert-shards");
    let cfg = DeepSeekV3Config::tiny();
    checkpoint::generate(&dir, &cfg, 2, 2).unwrap();
    // Remove rank 0's experts (0..8 of 16 with 2 ranks) from every shard.
    let half = cfg.n_routed_experts.unwrap() / 2;
    for shard in loader::safetensors_files(&dir).unwrap() {
        let mut tensors = candle_core::safetensors::load(&shard, &Device::Cpu).unwrap();
        tensors.retain(|name, _| !(0..half).any(|e| name.contains(&format!(".mlp.experts.{e}."))));
        candle_core::safetensors::save(&tensors, &shard).unwrap();
    }
    let mut buffers = Buffer::local_group(2, 2, buffer_config(&cfg)).unwrap();
    let rank1 = buffers.pop().unwrap();
    let rank0 = buffers.pop().unwrap();
    let m = load_ep(&dir, rank1);
    assert_eq!(m.model.num_layers(), cfg.num_hidden_layers);
    let err = loader::load(
        &dir,
        LoadOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            max_positions: 64,
            moe: MoeBackend::ExpertParallel {
                buffer: Arc::new(rank0),
                options: moe_layer::MoeLayerOptions {
                    low_latency_max_tokens: 8,
                    ..Default::default()
                },
                placements: None,
            },
            progress: false,
        },
    )
    .unwrap_err();
    let err = format!("{err:#}");
    assert!(err.contains("model.layers.1.mlp.experts.0."), "{err}");
}

/// The cache's harder paths against the reference: a prompt fed in two chunks (a multi-token
/// step over a non-empty cache), a batch given out of slot order, sequences added while others
/// are live (a prefill of the last slots only), and a sequence removed from the middle (the
/// last one moves into its slot) before decoding goes on.
#[test]
fn chunked_prefill_reordered_batches_and_removal_match_reference() {
    let dir = common::scratch("forward-cache");
    checkpoint::generate(&dir, &DeepSeekV3Config::tiny(), 13, 2).unwrap();
    let reference = Reference::load(&dir);
    let buffer = Buffer::local_group(1, 1, buffer_config(&reference.cfg))
        .unwrap()
        .pop()
        .unwrap();
    let m = load_ep(&dir, buffer);
    let model = &m.model;
    let mut cache = model.new_kv_cache(4).unwrap();
    let mut seqs: Vec<Vec<u32>> = vec![
        vec![0, 40, 41, 42, 43, 44, 45],
        vec![0, 7, 8],
        vec![0, 90, 91, 92, 93],
        vec![0, 150],
    ];
    let check = |rows: &[Vec<f32>], ids: &[usize], seqs: &[Vec<u32>], what: &str| {
        for (row, &s) in rows.iter().zip(ids) {
            let diff = max_abs_diff(row, &reference.last_logits(&seqs[s]));
            assert!(diff < 2e-3, "{what}: sequence {s} differs by {diff}");
        }
    };
    // Sequences 0 and 1: the first chunk of each prompt, given in reverse order.
    cache.insert(0).unwrap();
    cache.insert(1).unwrap();
    let rows = model
        .forward(
            &mut cache,
            &[
                SeqInput {
                    seq: 1,
                    tokens: &seqs[1][..2],
                },
                SeqInput {
                    seq: 0,
                    tokens: &seqs[0][..3],
                },
            ],
            StepKind::Prefill,
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let partial = vec![seqs[0][..3].to_vec(), seqs[1][..2].to_vec()];
    check(&rows, &[1, 0], &partial, "first chunk");
    // Their second chunks (over a non-empty cache), then sequences 2 and 3 join.
    let rows = model
        .forward(
            &mut cache,
            &[
                SeqInput {
                    seq: 0,
                    tokens: &seqs[0][3..],
                },
                SeqInput {
                    seq: 1,
                    tokens: &seqs[1][2..],
                },
            ],
            StepKind::Prefill,
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    check(&rows, &[0, 1], &seqs, "second chunk");
    cache.insert(2).unwrap();
    cache.insert(3).unwrap();
    let rows = model
        .forward(
            &mut cache,
            &[
                SeqInput {
                    seq: 2,
                    tokens: &seqs[2],
                },
                SeqInput {
                    seq: 3,
                    tokens: &seqs[3],
                },
            ],
            StepKind::Prefill,
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    check(&rows, &[2, 3], &seqs, "joining prefill");
    // Decode all four once, drop sequence 1 (sequence 3 moves into its slot), decode twice more.
    let mut live = vec![0usize, 1, 2, 3];
    for step in 0..3 {
        if step == 1 {
            assert!(cache.remove(1).unwrap());
            live.retain(|&s| s != 1);
            assert_eq!(cache.keys(), &[0, 3, 2]);
        }
        let next: Vec<u32> = live
            .iter()
            .map(|&s| argmax(&reference.last_logits(&seqs[s])))
            .collect();
        for (&s, &t) in live.iter().zip(&next) {
            seqs[s].push(t);
        }
        let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch: Vec<SeqInput<'_>> = live
            .iter()
            .zip(&inputs)
            .map(|(&s, t)| SeqInput {
                seq: s as u64,
                tokens: t,
            })
            .collect();
        let rows = model
            .forward(&mut cache, &batch, StepKind::Decode)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        check(&rows, &live, &seqs, &format!("decode step {step}"));
    }
    // A batch that is not a contiguous run of slots is refused with a clear error.
    let err = model
        .forward(
            &mut cache,
            &[
                SeqInput {
                    seq: 0,
                    tokens: &[5],
                },
                SeqInput {
                    seq: 2,
                    tokens: &[5],
                },
            ],
            StepKind::Decode,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("contiguous run of cache slots"), "{err}");
}
