//! Normal mode across nodes (feature `nvshmem`), in DeepEP's internode configuration: 4096
//! tokens per rank, hidden 7168, top-8 of 256 experts, bf16 and fp8 dispatch, bf16 combine.
//! Run on the GPU machine (`harness = false`): one process per GPU, 4 GPUs of this host as
//! 2 nodes x 2 (NVSHMEM's P2P transport over NVLink standing in for RDMA; there is no NIC),
//! beside the same 4 GPUs as one node (the NVLink normal mode), in the same run; with 2 GPUs,
//! 2 nodes x 1 beside one node of 2.
//!
//! Each op is timed on the host around the whole `Buffer` call (the layer a user calls:
//! barrier, count exchange and host read, transfers, output allocation), synchronised,
//! median of `EP_BENCH_ITERS` (default 10) after 3 warm-ups. Printed per case: the slowest
//! rank's median, and for the two-node case the bytes each rank puts on the "network" (one
//! message per token and remote node) and what they would take at 400 Gb/s (50 GB/s).

use candle_core::{DType, Device, Tensor};
use ep_runtime::cast::per_token_cast_to_fp8;
use ep_runtime::transport::ONE_HOST_NODES_ENV;
use ep_runtime::{Buffer, BufferConfig, CombineArgs, DispatchArgs, Store, StoreConfig, Topology};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD: &str = "EP_BENCH_INTERNODE_CHILD";
const TOKENS: usize = 4096;
const HIDDEN: usize = 7168;
const TOPK: usize = 8;
const EXPERTS: usize = 256;

type BoxError = Box<dyn std::error::Error>;

fn main() {
    if let Ok(case) = std::env::var(CHILD) {
        if let Err(e) = child(&case) {
            println!("ERROR {e}");
            std::process::exit(1);
        }
        return;
    }
    let gpus = cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize;
    let cases: &[(&str, &str)] = match gpus {
        0 | 1 => {
            println!("bench_internode needs 2 or 4 GPUs, {gpus} visible: skipping");
            return;
        }
        2 | 3 => &[
            ("nodes-1", "2 nodes x 1 GPU (internode path, NVSHMEM)"),
            ("nodes-2", "1 node x 2 GPUs (NVLink normal mode)"),
        ],
        _ => &[
            ("nodes-2", "2 nodes x 2 GPUs (internode path, NVSHMEM)"),
            ("nodes-4", "1 node x 4 GPUs (NVLink normal mode)"),
        ],
    };
    let world = if gpus >= 4 { 4 } else { 2 };
    println!(
        "internode normal mode, {TOKENS} tokens per rank, hidden {HIDDEN}, top-{TOPK} of \
         {EXPERTS}; ms per op, slowest rank's median (NVLink standing in for RDMA)"
    );
    for &(case, label) in cases {
        match launch(case, world) {
            Ok(lines) => report(label, &lines),
            Err(e) => println!("{label}: FAILED: {e}"),
        }
    }
}

/// Runs `world` children of `case` and returns every rank's `RESULT` lines.
fn launch(case: &str, world: usize) -> Result<Vec<Vec<(String, f64)>>, BoxError> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env(CHILD, case)
                .envs(StoreConfig::one_host_env(rank, world, port))
                .envs(ONE_HOST_NODES_ENV)
                .env("NVSHMEM_SYMMETRIC_SIZE", "2G")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut all = Vec::new();
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            return Err(format!(
                "rank {rank} exited with {}:\n{text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        all.push(
            text.lines()
                .filter_map(|l| l.strip_prefix("RESULT "))
                .filter_map(|l| {
                    let (name, v) = l.split_once(' ')?;
                    Some((name.to_string(), v.trim().parse().ok()?))
                })
                .collect(),
        );
    }
    Ok(all)
}

fn report(label: &str, ranks: &[Vec<(String, f64)>]) {
    println!("{label}:");
    let Some(first) = ranks.first() else {
        return;
    };
    for (name, _) in first {
        let vals: Vec<f64> = ranks
            .iter()
            .filter_map(|r| r.iter().find(|(n, _)| n == name).map(|(_, v)| *v))
            .collect();
        let max = vals.iter().cloned().fold(f64::MIN, f64::max);
        let min = vals.iter().cloned().fold(f64::MAX, f64::min);
        println!("  {name:<28} {max:>10.3}   (ranks {min:.3} .. {max:.3})");
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn child(case: &str) -> Result<(), BoxError> {
    let gpn: usize = case.trim_start_matches("nodes-").parse()?;
    let scfg = StoreConfig::from_env()?.with_timeout(Duration::from_secs(120))?;
    let (rank, world, local) = (scfg.rank, scfg.world_size, scfg.local_rank);
    let topo = Topology::new(rank, world, gpn)?;
    let store = Store::connect(scfg)?;
    let gpu = Device::new_cuda(local)?;
    let mut cfg = BufferConfig::default().with_timeout(Duration::from_secs(60));
    if topo.num_nodes() > 1 {
        cfg = cfg.with_internode(TOKENS, HIDDEN, TOPK);
    }
    let buffer = Buffer::from_store(&store, topo, cfg, &gpu)?;
    let mut rng = StdRng::seed_from_u64(7 + rank as u64);
    let mut idx = Vec::with_capacity(TOKENS * TOPK);
    for _ in 0..TOKENS {
        let mut row: Vec<i64> = Vec::with_capacity(TOPK);
        while row.len() < TOPK {
            let e = rng.random_range(0..EXPERTS) as i64;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        idx.extend(row);
    }
    let w: Vec<f32> = (0..TOKENS * TOPK)
        .map(|_| rng.random_range(0.0..1.0))
        .collect();
    let xv: Vec<f32> = (0..TOKENS * HIDDEN)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let x_cpu = Tensor::from_vec(xv, (TOKENS, HIDDEN), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let (q_cpu, s_cpu) = per_token_cast_to_fp8(&x_cpu, false)?;
    let x = x_cpu.to_device(&gpu)?;
    let (q, s) = (q_cpu.to_device(&gpu)?, s_cpu.to_device(&gpu)?);
    let idx = Tensor::from_vec(idx, (TOKENS, TOPK), &Device::Cpu)?.to_device(&gpu)?;
    let w = Tensor::from_vec(w, (TOKENS, TOPK), &Device::Cpu)?.to_device(&gpu)?;
    let layout = buffer.get_dispatch_layout(&idx, EXPERTS)?;
    let iters: usize = std::env::var("EP_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let timed = |f: &mut dyn FnMut() -> Result<(), BoxError>| -> Result<f64, BoxError> {
        gpu.synchronize()?;
        let t0 = Instant::now();
        f()?;
        gpu.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    let (mut d16, mut d8, mut dc, mut cb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut recv = 0;
    for i in 0..iters + 3 {
        let mut out = None;
        let a = timed(&mut || {
            out = Some(buffer.dispatch(&DispatchArgs::new(&x).topk(&idx, &w).layout(&layout))?);
            Ok(())
        })?;
        let out = out.ok_or("no dispatch output")?;
        recv = out.recv_x.dims2()?.0;
        let b = timed(&mut || {
            buffer.dispatch(
                &DispatchArgs::new(&q)
                    .x_scales(&s)
                    .topk(&idx, &w)
                    .layout(&layout),
            )?;
            Ok(())
        })?;
        let c = timed(&mut || {
            buffer.dispatch(&DispatchArgs::new(&x).cached(&out.handle))?;
            Ok(())
        })?;
        let d = timed(&mut || {
            buffer.combine(&CombineArgs::new(&out.recv_x, &out.handle))?;
            Ok(())
        })?;
        if i >= 3 {
            d16.push(a);
            d8.push(b);
            dc.push(c);
            cb.push(d);
        }
    }
    println!("RESULT dispatch_bf16_ms {:.3}", median(d16.clone()));
    println!("RESULT dispatch_fp8_ms {:.3}", median(d8));
    println!("RESULT dispatch_cached_bf16_ms {:.3}", median(dc));
    println!("RESULT combine_bf16_ms {:.3}", median(cb.clone()));
    println!("RESULT recv_tokens {recv}");
    if topo.num_nodes() > 1 {
        // One message per (token, remote node) leaves this rank; combine returns as many rows.
        let per_node: Vec<i32> = layout
            .num_tokens_per_node
            .as_ref()
            .ok_or("no per-node counts")?
            .to_vec1()?;
        let me = topo.rank / topo.gpus_per_node;
        let remote: usize = per_node
            .iter()
            .enumerate()
            .filter(|&(n, _)| n != me)
            .map(|(_, &c)| c as usize)
            .sum();
        let mb = |row: usize| (remote * row) as f64 / 1e6;
        let (bf16_mb, fp8_mb) = (mb(2 * HIDDEN), mb(HIDDEN + HIDDEN / 128 * 4));
        println!("RESULT network_mb_dispatch_bf16 {bf16_mb:.1}");
        println!("RESULT network_mb_dispatch_fp8 {fp8_mb:.1}");
        println!(
            "RESULT network_gbps_dispatch_bf16 {:.1}",
            bf16_mb / median(d16)
        );
        println!("RESULT network_gbps_combine {:.1}", bf16_mb / median(cb));
        println!("RESULT at_50GBps_dispatch_bf16_ms {:.3}", bf16_mb / 50.0);
        println!("RESULT at_50GBps_dispatch_fp8_ms {:.3}", fp8_mb / 50.0);
    }
    Ok(())
}
