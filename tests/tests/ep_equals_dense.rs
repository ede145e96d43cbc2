//! Expert parallelism over 1, 2, 4 and 8 ranks (threads), in both modes, equals the dense
//! single-process MoE layer; also with the two-batch overlap and the per-expert combine.

use candle_core::{DType, Device, Tensor};
use ep_moe_tests::{config, load_layer, rel_err, var_builder, write_checkpoint};
use moe_layer::dense::DenseMoe;
use moe_layer::ep_kernels::gemm::GemmGrid;
use moe_layer::ep_runtime::{Buffer, BufferConfig, Reduction};
use moe_layer::placement::{place, PlacementShape};
use moe_layer::{Mode, MoeConfig, MoeLayer, MoeLayerOptions, Step};
use std::path::Path;
use std::sync::Arc;

fn run(num_ranks: usize, gpus_per_node: usize, dtype: DType, fp8: bool, tol: f64) {
    run_with(
        num_ranks,
        gpus_per_node,
        dtype,
        fp8,
        tol,
        MoeLayerOptions::default(),
    );
}

/// [`run`] with the layer's other options from `base` (mode, sizes and fp8 set here).
fn run_with(
    num_ranks: usize,
    gpus_per_node: usize,
    dtype: DType,
    fp8: bool,
    tol: f64,
    base: MoeLayerOptions,
) {
    let max_tokens = 24;
    let per_rank = on_ranks(
        num_ranks,
        gpus_per_node,
        (max_tokens, None),
        "dense",
        |buf, cfg, path| {
            let rank = buf.topology().rank;
            let opts = MoeLayerOptions {
                mode: Mode::Auto,
                low_latency_max_tokens: max_tokens,
                fp8_dispatch: fp8,
                expert_alignment: 4,
                ..base
            };
            let layer = MoeLayer::load(var_builder(path, dtype), cfg, Arc::new(buf), opts).unwrap();
            let dense = DenseMoe::load(var_builder(path, dtype), cfg).unwrap();
            // Different token counts per rank, rank 1 with none.
            let t = if rank == 1 {
                0
            } else {
                (5 + 6 * rank).min(max_tokens)
            };
            let x = Tensor::randn(0f32, 1.0, (t, cfg.hidden_size), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = dense.forward(&x).unwrap();
            let mut errs = Vec::new();
            for mode in [Mode::Normal, Mode::LowLatency, Mode::Auto] {
                let got = layer.forward_with_mode(&x, mode).unwrap();
                assert_eq!(got.dims(), x.dims());
                assert_eq!(got.dtype(), dtype);
                errs.push(if t == 0 { 0.0 } else { rel_err(&got, &want) });
            }
            // 3-D input keeps its shape.
            let x3 = x.reshape((1, t, cfg.hidden_size)).unwrap();
            assert_eq!(
                layer.forward_with_mode(&x3, Mode::Normal).unwrap().dims(),
                x3.dims()
            );
            errs
        },
    );
    for (rank, errs) in per_rank.into_iter().enumerate() {
        for (mode, e) in ["normal", "low-latency", "auto"].iter().zip(errs) {
            assert!(
                e <= tol,
                "{num_ranks} ranks, rank {rank}, {mode}, {dtype:?} fp8={fp8}: rel err {e} > {tol}"
            );
        }
    }
}

/// Runs `f(buffer, config, checkpoint)` on `num_ranks` CPU ranks (threads of a local group of
/// `gpus_per_node`-rank nodes whose low-latency buffers hold `max_tokens` tokens per rank, and
/// whose normal mode across nodes takes `internode_max` tokens per op if given) over a fresh
/// checkpoint tagged `tag`; the results by rank.
fn on_ranks<T: Send>(
    num_ranks: usize,
    gpus_per_node: usize,
    (max_tokens, internode_max): (usize, Option<usize>),
    tag: &str,
    f: impl Fn(Buffer, &MoeConfig, &Path) -> T + Sync,
) -> Vec<T> {
    let cfg = config();
    let path = write_checkpoint(&cfg, tag);
    let bcfg =
        BufferConfig::default().with_low_latency(max_tokens, cfg.hidden_size, cfg.n_routed_experts);
    let bcfg = match internode_max {
        Some(m) => bcfg.with_internode(m, cfg.hidden_size, cfg.num_experts_per_tok),
        None => bcfg,
    };
    let buffers = Buffer::local_group(num_ranks, gpus_per_node, bcfg).unwrap();
    let (f, cfg_ref, path_ref) = (&f, &cfg, path.as_path());
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = buffers
            .into_iter()
            .map(|buf| s.spawn(move || f(buf, cfg_ref, path_ref)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
    out
}

#[test]
fn f32_over_1_2_4_8_ranks() {
    for r in [1, 2, 4, 8] {
        run(r, r.min(4), DType::F32, false, 1e-5);
    }
}

#[test]
fn bf16_over_2_and_4_ranks() {
    run(2, 2, DType::BF16, false, 2e-2);
    run(4, 2, DType::BF16, false, 2e-2);
}

#[test]
fn two_batch_overlap_per_expert_combine_and_shared_first() {
    let tbo = MoeLayerOptions {
        two_batch_overlap: true,
        ..Default::default()
    };
    let per_expert = MoeLayerOptions {
        low_latency_reduction: Reduction::PerExpert,
        ..Default::default()
    };
    for r in [1, 2, 4] {
        run_with(r, r, DType::F32, false, 1e-5, tbo);
    }
    run_with(4, 2, DType::BF16, false, 2e-2, tbo);
    run_with(2, 2, DType::F32, true, 8e-2, tbo);
    run_with(4, 4, DType::F32, false, 1e-5, per_expert);
    let shared_first = MoeLayerOptions {
        shared_before_dispatch: true,
        ..Default::default()
    };
    run_with(4, 2, DType::F32, false, 1e-5, shared_first);
}

/// Normal mode pipelined over groups of each rank's experts (`expert_groups`): even and
/// uneven groups, one group per expert, bf16, fp8 rows with the shared experts first; equal to
/// the dense layer (low-latency mode is unchanged by the option and checked again).
#[test]
fn expert_groups_pipeline() {
    let groups = |n| MoeLayerOptions {
        expert_groups: n,
        ..Default::default()
    };
    run_with(2, 2, DType::F32, false, 1e-5, groups(2));
    run_with(2, 1, DType::F32, false, 1e-5, groups(3));
    run_with(4, 4, DType::F32, false, 1e-5, groups(4));
    run_with(4, 2, DType::BF16, false, 2e-2, groups(2));
    run_with(
        4,
        4,
        DType::F32,
        true,
        8e-2,
        MoeLayerOptions {
            shared_before_dispatch: true,
            ..groups(2)
        },
    );
}

/// `expert_groups` outside 1..=experts per rank, or with the two-batch overlap, and a
/// persistent GEMM grid on no SM are refused at load, naming the option.
#[test]
fn expert_groups_out_of_range_is_refused() {
    let errs = on_ranks(2, 2, (8, None), "groups-refused", |buf, cfg, path| {
        let buf = Arc::new(buf);
        let bad = [
            MoeLayerOptions {
                expert_groups: 0,
                ..Default::default()
            },
            MoeLayerOptions {
                expert_groups: 9,
                ..Default::default()
            },
            MoeLayerOptions {
                expert_groups: 2,
                two_batch_overlap: true,
                ..Default::default()
            },
            MoeLayerOptions {
                normal_gemm_grid: Some(GemmGrid::PersistentOn(0)),
                ..Default::default()
            },
        ];
        bad.map(|opts| {
            let opts = MoeLayerOptions {
                low_latency_max_tokens: 8,
                ..opts
            };
            MoeLayer::load(var_builder(path, DType::F32), cfg, buf.clone(), opts)
                .unwrap_err()
                .to_string()
        })
    });
    for e in errs.iter().flat_map(|r| &r[..3]) {
        assert!(e.contains("expert_groups"), "{e}");
    }
    assert!(errs[0][3].contains("normal_gemm_grid"), "{}", errs[0][3]);
    assert!(
        errs[0][1].contains("between 1 and the experts per rank (8)"),
        "{}",
        errs[0][1]
    );
    assert!(errs[0][2].contains("two_batch_overlap"), "{}", errs[0][2]);
}

#[test]
fn fp8_dispatch_over_4_ranks() {
    // fp8 e4m3 carries 3 mantissa bits: error of a few percent on the routed part.
    run(4, 4, DType::F32, true, 8e-2);
}

/// Normal-mode steps run as low-latency chunks (`prefill_in_low_latency_chunks`, what a CUDA
/// buffer across nodes does): 4 ranks as 2 nodes x 2, 8-token chunks, ranks with 0, 8, 17 and
/// 23 tokens (so 3 chunks each, the last ones partial or empty), equal to the dense layer.
#[test]
fn prefill_in_low_latency_chunks() {
    let chunk = 8;
    let per_rank = on_ranks(4, 2, (chunk, None), "chunks", |buf, cfg, path| {
        let rank = buf.topology().rank;
        let opts = MoeLayerOptions {
            low_latency_max_tokens: chunk,
            prefill_in_low_latency_chunks: true,
            ..Default::default()
        };
        let layer =
            MoeLayer::load(var_builder(path, DType::F32), cfg, Arc::new(buf), opts).unwrap();
        assert!(layer.prefill_in_low_latency_chunks());
        // Normal, and Auto (which resolves to normal: more than 8 tokens somewhere).
        normal_and_auto_errs(&layer, cfg, path, [0, 8, 17, 23][rank])
    });
    assert_within(per_rank, 1e-5);
}

/// Across nodes the internode buffer bounds the tokens of one normal op: the layer runs a
/// larger normal-mode step as several normal ops (4 ranks as 2 nodes x 2, 5 tokens per op,
/// ranks with 0, 5, 11 and 14 tokens, so 3 ops each), equal to the dense layer; one node has
/// no such bound.
#[test]
fn normal_steps_in_internode_chunks() {
    let cap = 5;
    let per_rank = on_ranks(4, 2, (4, Some(cap)), "internode", |buf, cfg, path| {
        let rank = buf.topology().rank;
        assert_eq!(buf.normal_mode_max_tokens(), Some(cap));
        let layer = f32_layer(Arc::new(buf), cfg, path, 4);
        assert!(!layer.prefill_in_low_latency_chunks());
        normal_and_auto_errs(&layer, cfg, path, [0, 5, 11, 14][rank])
    });
    assert_within(per_rank, 1e-5);
    let one_node =
        Buffer::local_group(2, 2, BufferConfig::default().with_internode(cap, 8, 2)).unwrap();
    assert!(one_node
        .iter()
        .all(|b| b.normal_mode_max_tokens().is_none()));
}

/// A step that knows the busiest rank's count runs the same ops as one that asks for it, and
/// no host round of its own: over 2 nodes x 2 with 5-token internode ops and 0 / 5 / 11 / 14
/// tokens, `forward_with_mode` adds one all-gather to its ops, `forward_step` (given 14, or
/// planned once) none, and the outputs are the same bits; a rank with more tokens than its
/// step claims is refused before any op.
#[test]
fn known_step_runs_no_host_round_of_its_own() {
    let tokens = [0, 5, 11, 14];
    on_ranks(4, 2, (4, Some(5)), "step", |buf, cfg, path| {
        let rank = buf.topology().rank;
        let buf = Arc::new(buf);
        let layer = f32_layer(buf.clone(), cfg, path, 4);
        let x = Tensor::randn(0f32, 1.0, (tokens[rank], cfg.hidden_size), &Device::Cpu).unwrap();
        let rounds = |f: &dyn Fn() -> Tensor| {
            let before = buf.host_rounds();
            let y = f();
            (buf.host_rounds() - before, y)
        };
        let (asked, want) = rounds(&|| layer.forward_with_mode(&x, Mode::Normal).unwrap());
        let planned = layer.plan_step(tokens[rank], Mode::Auto).unwrap();
        assert_eq!(planned, Step::new(Mode::Auto, 14));
        for step in [Step::new(Mode::Normal, 14), planned] {
            let (known, got) = rounds(&|| layer.forward_step(&x, step).unwrap());
            assert_eq!(asked, known + 1, "rank {rank}: {step:?}");
            assert_eq!(got.dims(), want.dims());
            if tokens[rank] > 0 {
                let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(
                    diff.to_scalar::<f32>().unwrap(),
                    0.0,
                    "rank {rank}: {step:?}"
                );
            }
        }
    });
    let one = on_ranks(1, 1, (4, None), "step-refused", |buf, cfg, path| {
        let layer = f32_layer(Arc::new(buf), cfg, path, 4);
        let x = Tensor::zeros((6, cfg.hidden_size), DType::F32, &Device::Cpu).unwrap();
        layer
            .forward_step(&x, Step::new(Mode::Normal, 5))
            .unwrap_err()
            .to_string()
    });
    assert!(
        one[0].contains("6 tokens") && one[0].contains("most_tokens = 5"),
        "{}",
        one[0]
    );
}

/// The f32 layer of the checkpoint at `path` over `buf`, with `ll_max` low-latency slots.
/// Normal mode with worst-case dispatch outputs (`normal_max_tokens_per_rank`: no host read
/// of the received count), alone, in fp8, with the two-batch overlap and pipelined over expert
/// groups: equal to the dense layer.
#[test]
fn worst_case_dispatch_outputs() {
    let worst = |base: MoeLayerOptions| MoeLayerOptions {
        normal_max_tokens_per_rank: Some(24),
        ..base
    };
    let plain = worst(MoeLayerOptions::default());
    run_with(2, 2, DType::F32, false, 1e-5, plain);
    run_with(4, 4, DType::F32, false, 1e-5, plain);
    run_with(4, 2, DType::BF16, false, 2e-2, plain);
    run_with(4, 4, DType::F32, true, 8e-2, plain);
    run_with(
        4,
        4,
        DType::F32,
        false,
        1e-5,
        worst(MoeLayerOptions {
            two_batch_overlap: true,
            ..Default::default()
        }),
    );
    run_with(
        4,
        4,
        DType::F32,
        false,
        1e-5,
        worst(MoeLayerOptions {
            expert_groups: 2,
            ..Default::default()
        }),
    );
}

/// `normal_max_tokens_per_rank`: 0 and a buffer across nodes are refused at load; a normal step
/// over the bound is refused before any op when the busiest rank is not known (every rank over
/// it: no collective is left waiting), and the layer goes on; with the busiest rank known
/// (`forward_step`, `Mode::Auto`) a step over the bound runs with exact outputs.
#[test]
fn worst_case_bound_is_enforced() {
    let errs = on_ranks(2, 2, (8, None), "worst-refused", |buf, cfg, path| {
        let buf = Arc::new(buf);
        let load = |bound| {
            let opts = MoeLayerOptions {
                low_latency_max_tokens: 8,
                normal_max_tokens_per_rank: Some(bound),
                ..Default::default()
            };
            MoeLayer::load(var_builder(path, DType::F32), cfg, buf.clone(), opts)
        };
        let load_plain = || {
            let opts = MoeLayerOptions {
                low_latency_max_tokens: 8,
                ..Default::default()
            };
            MoeLayer::load(var_builder(path, DType::F32), cfg, buf.clone(), opts).unwrap()
        };
        let zero = load(0).unwrap_err().to_string();
        let layer = load(16).unwrap();
        let x = Tensor::randn(0f32, 1.0, (20, cfg.hidden_size), &Device::Cpu).unwrap();
        let over = layer
            .forward_with_mode(&x, Mode::Normal)
            .unwrap_err()
            .to_string();
        let ok = layer.forward_with_mode(&x.narrow(0, 0, 16).unwrap(), Mode::Normal);
        assert!(ok.is_ok(), "{ok:?}");
        // With the step's busiest rank known, a step over the bound runs with exact outputs on
        // every rank (here rank 0 brings 20 tokens and rank 1 12), one within it with
        // worst-case outputs; both equal the layer without the bound.
        let exact = load_plain();
        let me = buf.topology().rank;
        for t in [if me == 0 { 20 } else { 12 }, 16] {
            let xt = x.narrow(0, 0, t).unwrap();
            let most = if t == 16 { 16 } else { 20 };
            let got = layer
                .forward_step(&xt, Step::new(Mode::Normal, most))
                .unwrap();
            let want = exact
                .forward_step(&xt, Step::new(Mode::Normal, most))
                .unwrap();
            let e = rel_err(&got, &want);
            assert!(e < 1e-6, "rank {me}, {t} tokens (most {most}): rel err {e}");
            let auto = layer.forward_with_mode(&xt, Mode::Auto).unwrap();
            let e = rel_err(&auto, &want);
            assert!(e < 1e-6, "rank {me}, {t} tokens, Mode::Auto: rel err {e}");
        }
        [zero, over]
    });
    for [zero, over] in errs {
        assert!(zero.contains("normal_max_tokens_per_rank"), "{zero}");
        assert!(
            over.contains("normal_max_tokens_per_rank = 16") && over.contains("20 tokens"),
            "{over}"
        );
    }
    let nodes = on_ranks(4, 2, (8, Some(32)), "worst-nodes", |buf, cfg, path| {
        let opts = MoeLayerOptions {
            low_latency_max_tokens: 8,
            normal_max_tokens_per_rank: Some(16),
            ..Default::default()
        };
        MoeLayer::load(var_builder(path, DType::F32), cfg, Arc::new(buf), opts)
            .unwrap_err()
            .to_string()
    });
    for e in nodes {
        assert!(e.contains("one node only"), "{e}");
    }
}

fn f32_layer(buf: Arc<Buffer>, cfg: &MoeConfig, path: &Path, ll_max: usize) -> MoeLayer {
    let opts = MoeLayerOptions {
        low_latency_max_tokens: ll_max,
        ..Default::default()
    };
    MoeLayer::load(var_builder(path, DType::F32), cfg, buf, opts).unwrap()
}

/// The relative errors of `layer`'s Normal and Auto steps on `t` random tokens against the
/// dense layer of the same checkpoint (0 for no tokens).
fn normal_and_auto_errs(layer: &MoeLayer, cfg: &MoeConfig, path: &Path, t: usize) -> [f64; 2] {
    let dense = DenseMoe::load(var_builder(path, DType::F32), cfg).unwrap();
    let x = Tensor::randn(0f32, 1.0, (t, cfg.hidden_size), &Device::Cpu).unwrap();
    let want = dense.forward(&x).unwrap();
    [Mode::Normal, Mode::Auto].map(|mode| {
        let got = layer.forward_with_mode(&x, mode).unwrap();
        assert_eq!(got.dims(), x.dims());
        if t == 0 {
            0.0
        } else {
            rel_err(&got, &want)
        }
    })
}

fn assert_within(per_rank: Vec<[f64; 2]>, tol: f64) {
    for (rank, errs) in per_rank.into_iter().enumerate() {
        for e in errs {
            assert!(e <= tol, "rank {rank}: rel err {e} > {tol}");
        }
    }
}

/// Redundant experts: 16 logical experts in 24 or 32 physical slots placed by the EPLB
/// algorithm from skewed loads (hierarchical over 2 nodes at 4 ranks, global otherwise), over
/// 1, 2 and 4 ranks: the layer equals the dense layer in both modes (every replica holds its
/// expert's weights, the router's logical picks go to slots), and its load statistics count the
/// router's logical picks.
#[test]
fn redundant_experts_equal_dense_and_count_the_load() {
    let cfg = config();
    let e = cfg.n_routed_experts;
    // A few hot experts: expert x draws 1 / (1 + (x * 7) % 16).
    let loads: Vec<f64> = (0..e).map(|x| 1.0 / (1 + (x * 7) % e) as f64).collect();
    for (ranks, nodes, physical) in [(1, 1, 24), (2, 1, 24), (4, 2, 32)] {
        let placement = place(
            &loads,
            PlacementShape {
                num_physical: physical,
                num_groups: cfg.n_group,
                num_nodes: nodes,
                num_gpus: ranks,
            },
        )
        .unwrap();
        assert!(placement.log_to_phy.iter().any(|v| v.len() > 1));
        let path = write_checkpoint(&cfg, "redundant");
        let max_tokens = 24;
        let bcfg = BufferConfig::default().with_low_latency(max_tokens, cfg.hidden_size, physical);
        let buffers = Buffer::local_group(ranks, ranks / nodes, bcfg).unwrap();
        let (cfg_ref, path_ref, pl) = (&cfg, path.as_path(), &placement);
        let errs: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = buffers
                .into_iter()
                .map(|buf| {
                    s.spawn(move || {
                        let rank = buf.topology().rank;
                        let layer = load_layer(path_ref, cfg_ref, buf, max_tokens, Some(pl))
                            .with_load_stats()
                            .unwrap();
                        assert_eq!(layer.experts().num_local(), physical / ranks);
                        let dense =
                            DenseMoe::load(var_builder(path_ref, DType::F32), cfg_ref).unwrap();
                        let t = 7 + 5 * rank;
                        let x = Tensor::randn(0f32, 1.0, (t, cfg_ref.hidden_size), &Device::Cpu)
                            .unwrap();
                        let want = dense.forward(&x).unwrap();
                        let mut errs = Vec::new();
                        for mode in [Mode::Normal, Mode::LowLatency, Mode::Auto] {
                            let got = layer.forward_with_mode(&x, mode).unwrap();
                            errs.push(rel_err(&got, &want));
                        }
                        // Three steps of the same tokens: three times the router's picks.
                        let idx: Vec<Vec<i64>> = layer
                            .router()
                            .forward(&x)
                            .unwrap()
                            .topk_idx
                            .to_dtype(DType::I64)
                            .unwrap()
                            .to_vec2()
                            .unwrap();
                        let mut want_load = vec![0.0; cfg_ref.n_routed_experts];
                        for &x in idx.iter().flatten() {
                            want_load[x as usize] += 3.0;
                        }
                        assert_eq!(layer.take_expert_load().unwrap(), Some(want_load));
                        errs
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
        for (rank, errs) in errs.iter().enumerate() {
            for (mode, err) in ["normal", "low-latency", "auto"].iter().zip(errs) {
                assert!(
                    *err <= 1e-5,
                    "{ranks} ranks, {physical} slots, rank {rank}, {mode}: rel err {err}"
                );
            }
        }
    }
}

/// Re-placement while serving: a layer placed for one skew is re-placed twice (for the
/// opposite skew, then for even loads) between steps, over 1, 2 and 4 ranks; after each, the
/// layer equals the dense layer in both modes (the moved slots hold their new experts'
/// weights, the map sends picks to them), every moved byte sent arrives, and a second call
/// with the same placement moves nothing.
#[test]
fn re_placed_experts_equal_dense() {
    let cfg = config();
    let e = cfg.n_routed_experts;
    let hot_low: Vec<f64> = (0..e).map(|x| 1.0 / (1 + x) as f64).collect();
    let hot_high: Vec<f64> = hot_low.iter().rev().copied().collect();
    for (ranks, physical) in [(1, 20), (2, 24), (4, 32)] {
        let shape = PlacementShape {
            num_physical: physical,
            num_groups: cfg.n_group,
            num_nodes: 1,
            num_gpus: ranks,
        };
        let plans: Vec<_> = [&hot_low, &hot_high, &vec![1.0; e]]
            .iter()
            .map(|l| place(l, shape).unwrap())
            .collect();
        let path = write_checkpoint(&cfg, "re-placed");
        let max_tokens = 24;
        let bcfg = BufferConfig::default().with_low_latency(max_tokens, cfg.hidden_size, physical);
        let buffers = Buffer::local_group(ranks, ranks, bcfg).unwrap();
        let (cfg_ref, path_ref, plans_ref) = (&cfg, path.as_path(), &plans);
        // Per rank: the errors of each step, and (moved slots, bytes sent, bytes received)
        // of each re-placement.
        type Moves = Vec<(usize, usize, usize)>;
        let per_rank: Vec<(Vec<f64>, Moves)> = std::thread::scope(|s| {
            let handles: Vec<_> = buffers
                .into_iter()
                .map(|buf| {
                    s.spawn(move || {
                        let rank = buf.topology().rank;
                        let mut layer =
                            load_layer(path_ref, cfg_ref, buf, max_tokens, Some(&plans_ref[0]));
                        let dense =
                            DenseMoe::load(var_builder(path_ref, DType::F32), cfg_ref).unwrap();
                        let mut errs = Vec::new();
                        let mut moved = Vec::new();
                        for next in &plans_ref[1..] {
                            let r = layer.replace_experts(next.clone()).unwrap();
                            assert_eq!(layer.expert_map().unwrap().placement(), next);
                            moved.push((r.moved_slots, r.bytes_sent, r.bytes_received));
                            let again = layer.replace_experts(next.clone()).unwrap();
                            assert_eq!(again.moved_slots, 0);
                            let t = 6 + 5 * rank;
                            let x =
                                Tensor::randn(0f32, 1.0, (t, cfg_ref.hidden_size), &Device::Cpu)
                                    .unwrap();
                            let want = dense.forward(&x).unwrap();
                            for mode in [Mode::Normal, Mode::LowLatency] {
                                let got = layer.forward_with_mode(&x, mode).unwrap();
                                errs.push(rel_err(&got, &want));
                            }
                        }
                        (errs, moved)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::fs::remove_dir_all(path.parent().unwrap()).ok();
        for (rank, (errs, _)) in per_rank.iter().enumerate() {
            for err in errs {
                assert!(*err <= 1e-5, "{ranks} ranks, rank {rank}: rel err {err}");
            }
        }
        for step in 0..2 {
            let moved = per_rank[0].1[step].0;
            assert!(
                moved > 0,
                "{ranks} ranks: re-placement {step} moved nothing"
            );
            let sent: usize = per_rank.iter().map(|(_, m)| m[step].1).sum();
            let received: usize = per_rank.iter().map(|(_, m)| m[step].2).sum();
            // Each slot's frame adds 16 bytes to what it carries.
            assert!(
                received >= sent && (ranks == 1) == (sent == 0),
                "{sent} / {received}"
            );
        }
    }
    // A layer built without a placement cannot be re-placed.
    let path = write_checkpoint(&cfg, "re-placed-none");
    let bcfg = BufferConfig::default().with_low_latency(8, cfg.hidden_size, e);
    let buf = Buffer::local_group(1, 1, bcfg).unwrap().remove(0);
    let mut layer = f32_layer(Arc::new(buf), &cfg, &path, 8);
    let err = layer
        .replace_experts(moe_layer::placement::Placement::identity(e))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("needs a layer built with a placement"),
        "{err}"
    );
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// A hidden size that is not a whole number of 128-channel groups (200) decodes in low-latency
/// mode as in normal mode, over 1 and 4 ranks, equal to the dense layer.
#[test]
fn hidden_not_a_multiple_of_128_in_both_modes() {
    let mut cfg = config();
    cfg.hidden_size = 200;
    let path = write_checkpoint(&cfg, "h200");
    for ranks in [1, 4] {
        let bcfg =
            BufferConfig::default().with_low_latency(16, cfg.hidden_size, cfg.n_routed_experts);
        let buffers = Buffer::local_group(ranks, ranks, bcfg).unwrap();
        let (cfg_ref, path_ref) = (&cfg, path.as_path());
        std::thread::scope(|s| {
            for buf in buffers {
                s.spawn(move || {
                    let opts = MoeLayerOptions {
                        low_latency_max_tokens: 16,
                        ..Default::default()
                    };
                    let layer = MoeLayer::load(
                        var_builder(path_ref, DType::F32),
                        cfg_ref,
                        Arc::new(buf),
                        opts,
                    )
                    .unwrap();
                    let dense = DenseMoe::load(var_builder(path_ref, DType::F32), cfg_ref).unwrap();
                    let x = Tensor::randn(0f32, 1.0, (9, 200), &Device::Cpu).unwrap();
                    let want = dense.forward(&x).unwrap();
                    for mode in [Mode::Normal, Mode::LowLatency] {
                        let err = rel_err(&layer.forward_with_mode(&x, mode).unwrap(), &want);
                        assert!(err <= 1e-5, "{ranks} ranks, {mode:?}: rel err {err}");
                    }
                });
            }
        });
    }
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}
