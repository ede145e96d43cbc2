//! Ranks as separate processes joined through the bootstrap store (TCP), like a launcher
//! runs them: this test binary re-executes itself once per rank.
//!
//! The rank bodies (`rank_*`) are `#[ignore]`d: they are not tests of their own but what each
//! child process runs (`--ignored --exact rank_...`), and they refuse to run outside a child.

use candle_core::{DType, Device, Tensor};
use ep_moe_tests::{config, rel_err, var_builder, write_checkpoint};
use moe_layer::dense::DenseMoe;
use moe_layer::ep_runtime::{Buffer, BufferConfig, Store, StoreConfig, Topology};
use moe_layer::{Mode, MoeLayer, MoeLayerOptions};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHILD: &str = "EP_MOE_TEST_CHILD";

/// Spawns `world` copies of this test binary running `entry`, with the launcher's variables.
fn launch(
    entry: &str,
    world: usize,
    local_world: usize,
    extra: &[(&str, String)],
) -> Vec<(i32, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.args([
                "--ignored",
                "--exact",
                entry,
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", (rank % local_world).to_string())
            .env("LOCAL_WORLD_SIZE", local_world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            for (k, v) in extra {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.code().unwrap_or(-1), text)
        })
        .collect()
}

/// Panics unless this process is a child launched by [`launch`]: a rank body run on its own
/// has no peers and must not pass.
fn require_child(entry: &str) {
    assert!(
        std::env::var(CHILD).is_ok(),
        "{entry} is one rank's body, run in a child process by the test that launches it"
    );
}

fn child_buffer(timeout: Duration) -> (Store, Buffer) {
    let cfg = config();
    let scfg = StoreConfig::from_env()
        .unwrap()
        .with_timeout(Duration::from_secs(30))
        .unwrap();
    let topo = Topology::new(scfg.rank, scfg.world_size, scfg.local_world_size).unwrap();
    let store = Store::connect(scfg).unwrap();
    let bcfg = BufferConfig::default()
        .with_low_latency(16, cfg.hidden_size, cfg.n_routed_experts)
        .with_timeout(timeout);
    let buf = Buffer::from_store(&store, topo, bcfg, &Device::Cpu).unwrap();
    (store, buf)
}

/// The body of one rank: EP layer in both modes equals the dense layer on this rank's tokens.
#[test]
#[ignore = "one rank's body: four_processes_equal_dense runs it in each child process"]
fn rank_ep_layer() {
    require_child("rank_ep_layer");
    let cfg = config();
    let path = std::path::PathBuf::from(std::env::var("EP_MOE_TEST_CKPT").unwrap());
    let (_store, buf) = child_buffer(Duration::from_secs(30));
    let rank = buf.topology().rank;
    let opts = MoeLayerOptions {
        low_latency_max_tokens: 16,
        ..Default::default()
    };
    let layer = MoeLayer::load(var_builder(&path, DType::F32), &cfg, Arc::new(buf), opts).unwrap();
    let dense = DenseMoe::load(var_builder(&path, DType::F32), &cfg).unwrap();
    let x = Tensor::randn(0f32, 1.0, (3 + 4 * rank, cfg.hidden_size), &Device::Cpu).unwrap();
    let want = dense.forward(&x).unwrap();
    for mode in [Mode::Normal, Mode::LowLatency, Mode::Auto] {
        let got = layer.forward_with_mode(&x, mode).unwrap();
        let e = rel_err(&got, &want);
        assert!(e < 1e-5, "rank {rank} {mode:?}: {e}");
    }
    println!("rank {rank} ok");
}

#[test]
fn four_processes_equal_dense() {
    let path = write_checkpoint(&config(), "mp");
    for local_world in [4, 2] {
        // one node of 4, then 2 nodes x 2 ranks
        let res = launch(
            "rank_ep_layer",
            4,
            local_world,
            &[("EP_MOE_TEST_CKPT", path.display().to_string())],
        );
        for (rank, (code, text)) in res.iter().enumerate() {
            assert_eq!(*code, 0, "rank {rank} failed:\n{text}");
            assert!(text.contains(&format!("rank {rank} ok")), "{text}");
        }
    }
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// Rank 2 exits (dies) after the first op; the others must fail naming it, not hang.
#[test]
#[ignore = "one rank's body: a_dead_process_is_named runs it in each child process"]
fn rank_dies_midway() {
    require_child("rank_dies_midway");
    let (store, buf) = child_buffer(Duration::from_secs(3));
    let rank = buf.topology().rank;
    let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu).unwrap();
    let idx = Tensor::new(&[[0i64], [1], [2], [3]], &Device::Cpu).unwrap();
    let w = Tensor::ones((4, 1), DType::F32, &Device::Cpu).unwrap();
    let args = moe_layer::ep_runtime::DispatchArgs::new(&x)
        .topk(&idx, &w)
        .num_experts(4);
    buf.dispatch(&args).unwrap();
    if rank == 2 {
        println!("rank 2 exiting");
        std::process::exit(0);
    }
    let started = Instant::now();
    let err = buf.dispatch(&args).unwrap_err();
    println!("rank {rank} error after {:?}: {err}", started.elapsed());
    // Survivors stay up until all three have seen the failure, so none of them is blamed for
    // leaving early.
    // (Rank 0 hosts the store and leaves once the count is 3; a closed store means the same.)
    store.add("survivors-done", 1).unwrap();
    while store.add("survivors-done", 0).unwrap_or(3) < 3
        && started.elapsed() < Duration::from_secs(20)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(err.rank(), Some(2), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_dead_process_is_named() {
    let started = Instant::now();
    let res = launch("rank_dies_midway", 4, 4, &[]);
    assert!(started.elapsed() < Duration::from_secs(60));
    for (rank, (code, text)) in res.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}:\n{text}");
        if rank != 2 {
            assert!(text.contains("rank 2"), "rank {rank}:\n{text}");
        }
    }
}
