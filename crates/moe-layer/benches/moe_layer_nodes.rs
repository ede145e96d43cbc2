//! `bench_moe_layer_nodes` (feature `nvshmem`): the prefill step of `MoeLayer` across nodes,
//! at DeepSeek-V3 shapes (hidden 7168, expert inner 2048, 256 routed experts top-8, 1 shared
//! expert, bf16), one process per GPU. With 4 GPUs: 2 nodes x 2 through the internode normal
//! mode, the same through low-latency chunks of 128 tokens (what a buffer across nodes without
//! `BufferConfig::with_internode` runs), and one node of 4 over NVLink; with 2 GPUs the same as
//! 2 nodes x 1 and one node of 2. NVSHMEM's P2P transport over NVLink stands in for RDMA (no
//! NIC here).
//!
//! Each step is `forward_with_mode(x, Mode::Normal)` (`T=..`: the layer asks the ranks for the
//! busiest one's token count, one host all-gather) and `forward_step` with that count known
//! (`T=../step`: no host round), alternating, timed on the host (synchronised), median of
//! `EP_BENCH_ITERS` (default 5) after 2 warm-ups, slowest rank; `EP_BENCH_TOKENS` sets the
//! tokens per rank (comma-separated, default `512,4096`).

mod layer_common;

use layer_common::{build_layer, BoxError, E, H, K, LL_MAX};
use moe_layer::ep_runtime::transport::ONE_HOST_NODES_ENV;
use moe_layer::ep_runtime::{Buffer, BufferConfig, Store, StoreConfig, Topology};
use moe_layer::{Mode, MoeLayerOptions, Step};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

const CHILD: &str = "EP_BENCH_LAYER_NODES_CHILD";
/// Most tokens per rank of one internode normal op (and the largest default step).
const MAX_TOKENS: usize = 4096;

fn tokens() -> Vec<usize> {
    std::env::var("EP_BENCH_TOKENS")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![512, 4096])
}

fn main() -> Result<(), BoxError> {
    if let Ok(case) = std::env::var(CHILD) {
        return child(&case);
    }
    let gpus = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()? as usize;
    let (world, cases): (usize, [(&str, &str); 3]) = match gpus {
        0 | 1 => {
            println!("bench_moe_layer_nodes needs 2 or 4 GPUs, {gpus} visible: skipping");
            return Ok(());
        }
        2 | 3 => (
            2,
            [
                ("1-internode", "2 nodes x 1, internode normal mode"),
                ("1-chunks", "2 nodes x 1, low-latency chunks of 128"),
                ("2-nvlink", "1 node x 2, NVLink normal mode"),
            ],
        ),
        _ => (
            4,
            [
                ("2-internode", "2 nodes x 2, internode normal mode"),
                ("2-chunks", "2 nodes x 2, low-latency chunks of 128"),
                ("4-nvlink", "1 node x 4, NVLink normal mode"),
            ],
        ),
    };
    println!(
        "MoeLayer prefill step across nodes, DeepSeek-V3 shapes, {world} GPUs, one process \
         each; ms per step, slowest rank's median (NVLink standing in for RDMA)"
    );
    for (case, label) in cases {
        match launch(case, world) {
            Ok(per_rank) => {
                let mut line = format!("  {label:<42}");
                for key in tokens()
                    .into_iter()
                    .flat_map(|t| [format!("T={t}"), format!("T={t}/step")])
                {
                    let worst = per_rank
                        .iter()
                        .filter_map(|r| r.iter().find(|(k, _)| *k == key).map(|(_, v)| *v))
                        .fold(f64::NAN, f64::max);
                    line += &format!("  {key}: {worst:>8.3}");
                }
                println!("{line}");
            }
            Err(e) => println!("  {label}: FAILED: {e}"),
        }
    }
    Ok(())
}

/// Runs `world` children of `case` and returns every rank's `(T=..., ms)` results.
fn launch(case: &str, world: usize) -> Result<Vec<Vec<(String, f64)>>, BoxError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let children = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env(CHILD, case)
                .envs(StoreConfig::one_host_env(rank, world, port))
                .envs(ONE_HOST_NODES_ENV)
                .env("NVSHMEM_SYMMETRIC_SIZE", "4G")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut all = Vec::new();
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!("rank {rank} exited with {}:\n{text}{err}", out.status).into());
        }
        all.push(
            text.lines()
                .filter_map(|l| l.strip_prefix("RESULT "))
                .filter_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    Some((k.to_string(), v.trim().parse().ok()?))
                })
                .collect(),
        );
    }
    Ok(all)
}

fn child(case: &str) -> Result<(), BoxError> {
    let (gpn, how) = case
        .split_once('-')
        .ok_or("case is <gpus per node>-<how>")?;
    let gpn: usize = gpn.parse()?;
    let scfg = StoreConfig::from_env()?.with_timeout(Duration::from_secs(300))?;
    let (rank, world, local) = (scfg.rank, scfg.world_size, scfg.local_rank);
    let topo = Topology::new(rank, world, gpn)?;
    let store = Store::connect(scfg)?;
    let dev = Device::new_cuda(local)?;
    let mut bcfg = BufferConfig::default()
        .with_timeout(Duration::from_secs(120))
        .with_low_latency(LL_MAX, H, E);
    if how == "internode" {
        bcfg = bcfg.with_internode(MAX_TOKENS, H, K);
    }
    let buffer = Arc::new(Buffer::from_store(&store, topo, bcfg, &dev)?);
    let opts = MoeLayerOptions {
        mode: Mode::Normal,
        low_latency_max_tokens: LL_MAX,
        prefill_in_low_latency_chunks: how == "chunks",
        ..Default::default()
    };
    let layer = build_layer(&dev, buffer, opts)?;
    let iters: usize = std::env::var("EP_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    for t in tokens() {
        let x = Tensor::randn(0f32, 1.0, (t, H), &dev)?.to_dtype(DType::BF16)?;
        let step = Step::new(Mode::Normal, t);
        let mut times = [Vec::new(), Vec::new()];
        for i in 0..iters + 2 {
            for (known, times) in times.iter_mut().enumerate() {
                dev.synchronize()?;
                let start = Instant::now();
                let y = if known == 1 {
                    layer.forward_step(&x, step)?
                } else {
                    layer.forward_with_mode(&x, Mode::Normal)?
                };
                dev.synchronize()?;
                if i >= 2 {
                    times.push(start.elapsed().as_secs_f64() * 1e3);
                }
                drop(y);
            }
        }
        for (times, suffix) in times.iter_mut().zip(["", "/step"]) {
            times.sort_by(f64::total_cmp);
            println!("RESULT T={t}{suffix} {:.3}", times[times.len() / 2]);
        }
    }
    Ok(())
}
