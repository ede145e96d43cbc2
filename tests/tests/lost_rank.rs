//! A layer with redundant experts serves on when a rank is lost: the survivors' first step
//! fails naming the lost rank, [`MoeLayer::exclude_ranks`] routes every expert to its replicas
//! on the other ranks, and the next steps equal the dense layer (CPU, ranks as threads).

use candle_core::{DType, Device, Tensor};
use ep_moe_tests::{config, load_layer, rel_err, var_builder, write_checkpoint};
use moe_layer::dense::DenseMoe;
use moe_layer::ep_runtime::{Buffer, BufferConfig};
use moe_layer::placement::Placement;
use moe_layer::{Mode, MoeLayer, MoeLayerOptions};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Every logical expert twice, its replicas `ranks / 2` ranks apart: expert `x` in slots `x`
/// and `x + e`.
fn mirrored(e: usize) -> Placement {
    Placement {
        phy_to_log: (0..2 * e).map(|s| s % e).collect(),
        replica: (0..2 * e).map(|s| s / e).collect(),
        log_to_phy: (0..e).map(|x| vec![x, x + e]).collect(),
    }
}

#[test]
fn a_lost_rank_is_routed_around_and_the_layer_equals_dense() {
    let cfg = config();
    let e = cfg.n_routed_experts;
    let (ranks, lost_rank) = (4usize, 2usize);
    let placement = mirrored(e);
    let path = write_checkpoint(&cfg, "lost-rank");
    let max_tokens = 24;
    let timeout = Duration::from_secs(2);
    let bcfg = BufferConfig::default()
        .with_low_latency(max_tokens, cfg.hidden_size, 2 * e)
        .with_timeout(timeout);
    let buffers = Buffer::local_group(ranks, ranks, bcfg).unwrap();
    let loaded = Barrier::new(ranks);
    let (cfg_ref, path_ref, placement_ref, loaded_ref) =
        (&cfg, path.as_path(), &placement, &loaded);
    let results: Vec<Option<(String, Duration, Vec<f64>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = buffers
            .into_iter()
            .map(|buf| {
                s.spawn(move || {
                    let rank = buf.topology().rank;
                    let mut layer =
                        load_layer(path_ref, cfg_ref, buf, max_tokens, Some(placement_ref));
                    loaded_ref.wait();
                    if rank == lost_rank {
                        // Gone: its buffer is dropped and never answers again.
                        return None;
                    }
                    let dense = DenseMoe::load(var_builder(path_ref, DType::F32), cfg_ref).unwrap();
                    let x =
                        Tensor::randn(0f32, 1.0, (5 + 3 * rank, cfg_ref.hidden_size), &Device::Cpu)
                            .unwrap();
                    // The first step waits for the lost rank and fails naming it.
                    let start = Instant::now();
                    let err = layer.forward_with_mode(&x, Mode::Normal).unwrap_err();
                    let waited = start.elapsed();
                    // Both ranks holding one expert's replicas lost: refused, nothing changed.
                    let mut both = vec![false; ranks];
                    both[lost_rank] = true;
                    both[(lost_rank + ranks / 2) % ranks] = true;
                    if !both[rank] {
                        let refused = layer.exclude_ranks(&both).unwrap_err().to_string();
                        assert!(refused.contains("no replica"), "{refused}");
                    }
                    let mut lost = vec![false; ranks];
                    lost[lost_rank] = true;
                    layer.exclude_ranks(&lost).unwrap();
                    let want = dense.forward(&x).unwrap();
                    let errs = [Mode::Normal, Mode::LowLatency, Mode::Auto]
                        .into_iter()
                        .map(|mode| rel_err(&layer.forward_with_mode(&x, mode).unwrap(), &want))
                        .collect();
                    Some((err.to_string(), waited, errs))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
    for (rank, r) in results.into_iter().enumerate() {
        let Some((err, waited, errs)) = r else {
            assert_eq!(rank, lost_rank);
            continue;
        };
        assert!(
            err.contains(&format!("rank {lost_rank}")),
            "rank {rank}: {err}"
        );
        assert!(
            waited < timeout + Duration::from_secs(2),
            "rank {rank} waited {waited:?}"
        );
        for (mode, e) in ["normal", "low latency", "auto"].iter().zip(errs) {
            assert!(e < 1e-5, "rank {rank}, {mode}: relative error {e}");
        }
    }
}

#[test]
fn a_layer_without_redundant_experts_cannot_exclude_a_rank() {
    let cfg = config();
    let path = write_checkpoint(&cfg, "lost-rank-fixed");
    let buffers = Buffer::local_group(2, 2, BufferConfig::default()).unwrap();
    let (cfg_ref, path_ref) = (&cfg, path.as_path());
    let errs: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = buffers
            .into_iter()
            .map(|buf| {
                s.spawn(move || {
                    let rank = buf.topology().rank;
                    let mut layer = MoeLayer::load_placed(
                        var_builder(path_ref, DType::F32),
                        cfg_ref,
                        Arc::new(buf),
                        MoeLayerOptions {
                            mode: Mode::Normal,
                            ..Default::default()
                        },
                        None,
                    )
                    .unwrap();
                    let mut lost = vec![false; 2];
                    lost[1 - rank] = true;
                    // Excluding no rank is fine; excluding itself or the other is not.
                    layer.exclude_ranks(&[false, false]).unwrap();
                    let own = layer.exclude_ranks(&[rank == 0, rank == 1]).unwrap_err();
                    assert!(own.to_string().contains("itself"), "{own}");
                    layer.exclude_ranks(&lost).unwrap_err().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
    for e in errs {
        assert!(e.contains("no redundant experts"), "{e}");
    }
}
