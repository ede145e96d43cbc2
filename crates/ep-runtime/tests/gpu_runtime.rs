//! GPU test of the CUDA backend of `Buffer` (run on the GPU machine; `harness = false`).
//!
//! The parent re-executes this binary once per visible GPU (one process per GPU, like a
//! launcher, with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ... and a bootstrap store). Each child
//! builds a CUDA buffer and a CPU buffer over the same store and checks, for fresh random
//! routings (with `-1` entries, empty ranks, a hot expert, zero tokens), that the CUDA ops give
//! the host backend's outputs: bit-exact for data movement, rel err <= 1e-2 for combines. A
//! second launch checks that when one rank never calls the op, the others fail naming it.
//! Normal mode also with worst-case outputs (`num_worst_tokens`), and with too few of them.
//! With `nvshmem`, the same over 2 nodes x 2 GPUs and 2 x 1 of this host: the internode
//! normal mode (an empty node in round 4), the low-latency ops, a buffer without the
//! internode path, and a missing rank.
//! Prints `N passed, N failed` and exits 1 on failure, or when no case ran (no GPU) unless
//! `EP_GPU_ALLOW_SKIP=1` (`gpu-test-suite`).

use candle_core::{DType, Device, Tensor};
use ep_runtime::cast::{per_token_cast_back, per_token_cast_to_fp8};
use ep_runtime::transport::ONE_HOST_NODES_ENV;
use ep_runtime::{
    Buffer, BufferConfig, CombineArgs, DispatchArgs, DispatchOutput, LowLatencyCombineArgs,
    LowLatencyDispatchArgs, NvlTransfer, Reduction, Store, StoreConfig, Topology,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD: &str = "EP_GPU_RUNTIME_CHILD";
const HIDDEN: usize = 256;
const TOPK: usize = 4;
const LL_MAX_TOKENS: usize = 32;
const INTERNODE_MAX_TOKENS: usize = 64;

type TestResult = std::result::Result<(), String>;

fn main() {
    if let Ok(case) = std::env::var(CHILD) {
        std::process::exit(child(&case));
    }
    let gpus = cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize;
    if gpus == 0 {
        gpu_test_suite::skip("no CUDA device visible");
    }
    let world = gpus.min(8);
    let (mut passed, mut failed) = (0usize, 0usize);
    // "equal": the copy-engine normal mode; "equal-rings": the SM ring kernels.
    let mut launches = vec![("equal", world), ("equal-rings", world)];
    if world >= 2 {
        launches.push(("missing", world));
    }
    // Across "nodes" of this host (feature `nvshmem`): 2 nodes x 2 GPUs and 2 x 1, the
    // internode normal mode and the low-latency ops over NVSHMEM against the host backend,
    // and a rank that never calls dispatch.
    if cfg!(feature = "nvshmem") {
        if world >= 4 {
            launches.push(("nodes-2", 4));
            launches.push(("nodes-2-missing", 4));
        }
        if world >= 2 {
            launches.push(("nodes-1", 2));
            launches.push(("nodes-1-missing", 2));
        }
    }
    // `EP_GPU_RUNTIME_ONLY=<case>`: that launch alone (e.g. under compute-sanitizer).
    if let Ok(only) = std::env::var("EP_GPU_RUNTIME_ONLY") {
        launches.retain(|(case, _)| *case == only);
    }
    for (case, world) in launches {
        for (rank, (code, text)) in launch(case, world).into_iter().enumerate() {
            println!("===== {case}: rank {rank} (exit {code}) =====\n{text}");
            passed += text.lines().filter(|l| l.starts_with("PASS ")).count();
            let f = text.lines().filter(|l| l.starts_with("FAIL ")).count();
            failed += f;
            if code != 0 && f == 0 {
                failed += 1;
            }
        }
    }
    gpu_test_suite::finish(passed, failed);
}

/// Spawns `world` children running `case`, one per GPU, and returns their exit codes and
/// output.
fn launch(case: &str, world: usize) -> Vec<(i32, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env(CHILD, case)
                .envs(StoreConfig::one_host_env(rank, world, port))
                .envs(ONE_HOST_NODES_ENV)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().expect("child output");
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.code().unwrap_or(-1), text)
        })
        .collect()
}

struct Ctx {
    rank: usize,
    world: usize,
    /// Nodes of the buffers' topology.
    nodes: usize,
    topo: Topology,
    gpu: Device,
    cuda: Buffer,
    cpu: Buffer,
    /// The bootstrap store (`None` for the one-rank buffers of a single process).
    _store: Option<Store>,
}

/// `gpus_per_node`: `None` for one node of `WORLD_SIZE` GPUs; across nodes the buffer gets
/// the internode normal mode for up to `INTERNODE_MAX_TOKENS` tokens per rank.
fn setup(
    timeout: Duration,
    transfer: NvlTransfer,
    gpus_per_node: Option<usize>,
) -> std::result::Result<Ctx, String> {
    let scfg = StoreConfig::from_env()
        .and_then(|c| c.with_timeout(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    let (rank, world, local) = (scfg.rank, scfg.world_size, scfg.local_rank);
    let topo =
        Topology::new(rank, world, gpus_per_node.unwrap_or(world)).map_err(|e| e.to_string())?;
    let store = Store::connect(scfg).map_err(|e| e.to_string())?;
    let gpu = Device::new_cuda(local).map_err(|e| e.to_string())?;
    let cfg = BufferConfig::default()
        .with_timeout(timeout)
        .with_low_latency(LL_MAX_TOKENS, HIDDEN, 8 * world)
        .with_nvl_bytes(64 << 20)
        .with_nvl_transfer(transfer);
    let cfg = match gpus_per_node {
        Some(_) => cfg.with_internode(INTERNODE_MAX_TOKENS, HIDDEN, TOPK),
        None => cfg,
    };
    let cuda = Buffer::from_store(&store, topo, cfg.clone(), &gpu).map_err(|e| e.to_string())?;
    let cpu = Buffer::from_store(&store, topo, cfg, &Device::Cpu).map_err(|e| e.to_string())?;
    Ok(Ctx {
        rank,
        world,
        nodes: topo.num_nodes(),
        topo,
        gpu,
        cuda,
        cpu,
        _store: Some(store),
    })
}

fn child(case: &str) -> i32 {
    let missing = case.ends_with("missing");
    let timeout = if missing { 3 } else { 30 };
    let transfer = if case.ends_with("-rings") {
        NvlTransfer::SmRings
    } else {
        NvlTransfer::CopyEngine
    };
    let gpus_per_node = case
        .strip_prefix("nodes-")
        .and_then(|g| g.split('-').next())
        .and_then(|g| g.parse::<usize>().ok());
    let ctx = match setup(Duration::from_secs(timeout), transfer, gpus_per_node) {
        Ok(c) => c,
        Err(e) => {
            println!("FAIL setup: {e}");
            return 1;
        }
    };
    let mut failed = 0;
    let mut run = |name: &str, f: &dyn Fn(&Ctx) -> TestResult| match f(&ctx) {
        Ok(()) => println!("PASS {case}/{name} (rank {})", ctx.rank),
        Err(e) => {
            failed += 1;
            println!("FAIL {case}/{name} (rank {}): {e}", ctx.rank);
        }
    };
    if missing {
        run("missing_rank_named", &missing_rank);
    } else if gpus_per_node.is_some() {
        for round in 0..5 {
            run(&format!("internode_normal_round_{round}"), &|c| {
                normal(c, round)
            });
        }
        run("internode_normal_fp8", &normal_fp8);
        for round in 0..3 {
            run(&format!("low_latency_round_{round}"), &|c| {
                low_latency(c, round)
            });
        }
        run(
            "normal_mode_unsupported_without_internode",
            &normal_unsupported,
        );
    } else {
        run("fp8_casts", &fp8_casts);
        for round in 0..4 {
            run(&format!("normal_round_{round}"), &|c| normal(c, round));
        }
        run("normal_fp8", &normal_fp8);
        for round in 0..3 {
            run(&format!("normal_worst_case_round_{round}"), &|c| {
                normal_worst_case(c, round)
            });
        }
        run("normal_worst_case_overflow", &normal_worst_case_overflow);
        for round in 0..3 {
            run(&format!("low_latency_round_{round}"), &|c| {
                low_latency(c, round)
            });
        }
        run("low_latency_one_rank_poisoned", &low_latency_one_rank);
    }
    i32::from(failed > 0)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Every element's bits, on the host.
fn bits(t: &Tensor) -> std::result::Result<Vec<u64>, String> {
    let t = t
        .to_device(&Device::Cpu)
        .map_err(err)?
        .flatten_all()
        .map_err(err)?;
    Ok(match t.dtype() {
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .map_err(err)?
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F8E4M3 => t
            .to_vec1::<float8::F8E4M3>()
            .map_err(err)?
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F32 => t
            .to_vec1::<f32>()
            .map_err(err)?
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::I64 => t
            .to_vec1::<i64>()
            .map_err(err)?
            .iter()
            .map(|&v| v as u64)
            .collect(),
        DType::I32 => t
            .to_dtype(DType::I64)
            .map_err(err)?
            .to_vec1::<i64>()
            .map_err(err)?
            .iter()
            .map(|&v| v as u64)
            .collect(),
        DType::U8 => t
            .to_vec1::<u8>()
            .map_err(err)?
            .iter()
            .map(|&v| v as u64)
            .collect(),
        other => return Err(format!("unexpected dtype {other:?}")),
    })
}

fn same(what: &str, a: &Tensor, b: &Tensor) -> TestResult {
    if a.dims() != b.dims() {
        return Err(format!(
            "{what}: shape {:?} (cuda) vs {:?} (host)",
            a.dims(),
            b.dims()
        ));
    }
    let (x, y) = (bits(a)?, bits(b)?);
    match x.iter().zip(&y).position(|(p, q)| p != q) {
        Some(i) => Err(format!(
            "{what}: element {i} differs: {:#x} (cuda) vs {:#x} (host)",
            x[i], y[i]
        )),
        None => Ok(()),
    }
}

fn rel_err(a: &Tensor, b: &Tensor) -> std::result::Result<f32, String> {
    let a = a
        .to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .map_err(err)?;
    let b = b
        .to_device(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .map_err(err)?;
    let num = (&a - &b)
        .and_then(|d| d.sqr())
        .and_then(|d| d.sum_all())
        .and_then(|s| s.to_scalar::<f32>())
        .map_err(err)?;
    let den = b
        .sqr()
        .and_then(|d| d.sum_all())
        .and_then(|s| s.to_scalar::<f32>())
        .map_err(err)?;
    Ok((num / den.max(1e-12)).sqrt())
}

fn close(what: &str, a: &Tensor, b: &Tensor) -> TestResult {
    if a.dims() != b.dims() {
        return Err(format!(
            "{what}: shape {:?} (cuda) vs {:?} (host)",
            a.dims(),
            b.dims()
        ));
    }
    let e = rel_err(a, b)?;
    if e > 1e-2 {
        return Err(format!("{what}: rel err {e} > 1e-2"));
    }
    Ok(())
}

/// A random routing of `t` tokens: `-1` entries, an empty last rank (round 1), a hot expert
/// (round 2), distinct experts per token.
fn routing(
    rng: &mut StdRng,
    t: usize,
    e: usize,
    world: usize,
    round: usize,
) -> (Vec<i64>, Vec<f32>) {
    let per_rank = e / world;
    let allowed: Vec<usize> = if round == 1 && world > 1 {
        (0..e - per_rank).collect()
    } else if round == 4 && world > 1 {
        // The experts of the first half of the ranks only (across 2 nodes: node 1 empty).
        (0..e / 2).collect()
    } else {
        (0..e).collect()
    };
    let mut idx = Vec::with_capacity(t * TOPK);
    let mut w = Vec::with_capacity(t * TOPK);
    for _ in 0..t {
        let mut row: Vec<i64> = Vec::new();
        for k in 0..TOPK {
            let pick = if round == 2 && k == 0 {
                0
            } else {
                allowed[rng.random_range(0..allowed.len())] as i64
            };
            if rng.random_range(0..6) == 0 || row.contains(&pick) {
                row.push(-1);
            } else {
                row.push(pick);
            }
        }
        idx.extend(row);
        w.extend((0..TOPK).map(|_| rng.random_range(0.0f32..1.0)));
    }
    (idx, w)
}

fn inputs(
    c: &Ctx,
    t: usize,
    round: usize,
    seed: u64,
) -> std::result::Result<(Tensor, Tensor, Tensor), String> {
    let e = 8 * c.world;
    let mut rng = StdRng::seed_from_u64(seed * 1000 + c.rank as u64 * 17 + round as u64);
    let (idx, w) = routing(&mut rng, t, e, c.world, round);
    let xv: Vec<f32> = (0..t * HIDDEN)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let x = Tensor::from_vec(xv, (t, HIDDEN), &Device::Cpu)
        .and_then(|x| x.to_dtype(DType::BF16))
        .map_err(err)?;
    let idx = Tensor::from_vec(idx, (t, TOPK), &Device::Cpu).map_err(err)?;
    let w = Tensor::from_vec(w, (t, TOPK), &Device::Cpu).map_err(err)?;
    Ok((x, idx, w))
}

/// `t` on the GPU; empty tensors as empty views of a one-row allocation (a zero-byte
/// `cuMemAlloc` is an error).
fn gpu(c: &Ctx, t: &Tensor) -> std::result::Result<Tensor, String> {
    if t.elem_count() == 0 {
        let mut dims = t.dims().to_vec();
        dims[0] = 1;
        return Tensor::zeros(dims, t.dtype(), &c.gpu)
            .and_then(|z| z.narrow(0, 0, 0))
            .map_err(err);
    }
    t.to_device(&c.gpu).map_err(err)
}

fn fp8_casts(c: &Ctx) -> TestResult {
    let (x, _, _) = inputs(c, 37, 0, 7)?;
    for ue8m0 in [false, true] {
        let (qh, sh) = per_token_cast_to_fp8(&x, ue8m0).map_err(err)?;
        let (qd, sd) = per_token_cast_to_fp8(&gpu(c, &x)?, ue8m0).map_err(err)?;
        same("q", &qd, &qh)?;
        same("scales", &sd, &sh)?;
        let bh = per_token_cast_back(&qh, &sh, DType::BF16).map_err(err)?;
        let bd = per_token_cast_back(&qd, &sd, DType::BF16).map_err(err)?;
        same("cast back", &bd, &bh)?;
    }
    Ok(())
}

fn normal(c: &Ctx, round: usize) -> TestResult {
    let e = 8 * c.world;
    // Round 3: rank 0 has no tokens.
    let t = if round == 3 && c.rank == 0 {
        0
    } else {
        5 + 13 * ((c.rank + round) % 4)
    };
    let (x, idx, w) = inputs(c, t, round, 1)?;
    let (xd, idxd, wd) = (gpu(c, &x)?, gpu(c, &idx)?, gpu(c, &w)?);

    let lh = c.cpu.get_dispatch_layout(&idx, e).map_err(err)?;
    let ld = c.cuda.get_dispatch_layout(&idxd, e).map_err(err)?;
    same(
        "num_tokens_per_rank",
        &ld.num_tokens_per_rank,
        &lh.num_tokens_per_rank,
    )?;
    same(
        "num_tokens_per_expert",
        &ld.num_tokens_per_expert,
        &lh.num_tokens_per_expert,
    )?;
    same(
        "is_token_in_rank",
        &ld.is_token_in_rank,
        &lh.is_token_in_rank,
    )?;

    let oh = c
        .cpu
        .dispatch(&DispatchArgs::new(&x).topk(&idx, &w).layout(&lh))
        .map_err(err)?;
    // The CUDA side once with the layout, once computing it.
    let od = if round % 2 == 0 {
        c.cuda
            .dispatch(&DispatchArgs::new(&xd).topk(&idxd, &wd).layout(&ld))
            .map_err(err)?
    } else {
        c.cuda
            .dispatch(
                &DispatchArgs::new(&xd)
                    .topk(&idxd, &wd)
                    .num_experts(e)
                    .async_finish(true),
            )
            .map_err(err)?
    };
    od.event.wait().map_err(err)?;
    same("recv_x", &od.recv_x, &oh.recv_x)?;
    routing_matches(&od, &oh)?;
    if od.num_recv_tokens_per_expert != oh.num_recv_tokens_per_expert {
        return Err(format!(
            "num_recv_tokens_per_expert {:?} (cuda) vs {:?} (host)",
            od.num_recv_tokens_per_expert, oh.num_recv_tokens_per_expert
        ));
    }
    if c.nodes > 1 {
        // Across nodes the handle's send head is the row in the destination's recv_x, as the
        // host backend's (one node: the ring kernels' own index), and there is one channel.
        same("send_head", od.handle.send_head(), oh.handle.send_head())?;
    } else {
        same(
            "channel_prefix_matrix",
            od.handle.channel_prefix_matrix(),
            oh.handle.channel_prefix_matrix(),
        )?;
    }

    // Combine the received rows (with the weights) back.
    combine_matches(c, &x, &oh, &od)?;

    // Cached dispatch of other data along the same routing.
    let (kh, kd) = cached_pair(c, &x, &oh, &od)?;
    same("cached recv_x", &kd.recv_x, &kh.recv_x)?;
    same("cached recv_src_idx", &kd.recv_src_idx, &kh.recv_src_idx)?;
    Ok(())
}

/// An optional output that must be there.
fn pick(o: &Option<Tensor>, what: &str) -> std::result::Result<Tensor, String> {
    o.clone().ok_or_else(|| format!("{what} missing"))
}

/// The received routing of a CUDA dispatch `od` bit-exact to the host backend's `oh`: source
/// indices, local expert ids, weights, and the handle's prefix matrix.
fn routing_matches(od: &DispatchOutput, oh: &DispatchOutput) -> TestResult {
    same("recv_src_idx", &od.recv_src_idx, &oh.recv_src_idx)?;
    same(
        "recv_topk_idx",
        &pick(&od.recv_topk_idx, "idx")?,
        &pick(&oh.recv_topk_idx, "idx")?,
    )?;
    same(
        "recv_topk_weights",
        &pick(&od.recv_topk_weights, "w")?,
        &pick(&oh.recv_topk_weights, "w")?,
    )?;
    same(
        "rank_prefix_matrix",
        od.handle.rank_prefix_matrix(),
        oh.handle.rank_prefix_matrix(),
    )
}

/// A cached dispatch of `x / 2` along each backend's handle: `(host, cuda)`.
fn cached_pair(
    c: &Ctx,
    x: &Tensor,
    oh: &DispatchOutput,
    od: &DispatchOutput,
) -> std::result::Result<(DispatchOutput, DispatchOutput), String> {
    let x2 = (x * 0.5).map_err(err)?;
    let x2d = gpu(c, &x2)?;
    let kh = c
        .cpu
        .dispatch(&DispatchArgs::new(&x2).cached(&oh.handle))
        .map_err(err)?;
    let kd = c
        .cuda
        .dispatch(&DispatchArgs::new(&x2d).cached(&od.handle))
        .map_err(err)?;
    Ok((kh, kd))
}

/// The combine of each backend's received rows, with their weights, along its handle: the
/// CUDA buffer's within 1e-2 of the host backend's; then again with a bias (`-x / 2`, `x`
/// this rank's `[T, H]` tokens), whose sums start from it.
fn combine_matches(c: &Ctx, x: &Tensor, oh: &DispatchOutput, od: &DispatchOutput) -> TestResult {
    let rw_h = pick(&oh.recv_topk_weights, "w")?;
    let rw_d = pick(&od.recv_topk_weights, "w")?;
    let ch = c
        .cpu
        .combine(&CombineArgs::new(&oh.recv_x, &oh.handle).topk_weights(&rw_h))
        .map_err(err)?;
    let cd = c
        .cuda
        .combine(&CombineArgs::new(&od.recv_x, &od.handle).topk_weights(&rw_d))
        .map_err(err)?;
    close("combined_x", &cd.combined_x, &ch.combined_x)?;
    close(
        "combined_topk_weights",
        &pick(&cd.combined_topk_weights, "cw")?,
        &pick(&ch.combined_topk_weights, "cw")?,
    )?;
    // A collective: a rank without tokens combines without a bias (a bias is local).
    let bias = (x * -0.5).map_err(err)?;
    let bias_d = if x.dims()[0] > 0 {
        Some(gpu(c, &bias)?)
    } else {
        None
    };
    let mut args_h = CombineArgs::new(&oh.recv_x, &oh.handle);
    let mut args_d = CombineArgs::new(&od.recv_x, &od.handle);
    if let Some(b) = &bias_d {
        args_h = args_h.bias(&bias);
        args_d = args_d.bias(b);
    }
    let bh = c.cpu.combine(&args_h).map_err(err)?;
    let bd = c.cuda.combine(&args_d).map_err(err)?;
    close("combined_x with a bias", &bd.combined_x, &bh.combined_x)
}

/// Tokens rank `rank` sends in round `round` of the worst-case tests (rank 0 none in round 2).
fn worst_case_tokens(rank: usize, round: usize) -> usize {
    if round == 2 && rank == 0 {
        0
    } else {
        7 + 11 * ((rank + round) % 3)
    }
}

/// A dispatch into worst-case outputs (`num_worst_tokens`: every rank's most tokens x ranks;
/// the pool poisoned first) against the host backend's, bit-exact over all rows: the received
/// rows first (as the exact dispatch's), then rows from nowhere (source -1, routing -1, weight
/// 0; their payload is not compared). No counts per expert. Then the combine of all rows, and
/// a cached dispatch along the handle.
fn normal_worst_case(c: &Ctx, round: usize) -> TestResult {
    let e = 8 * c.world;
    let t = worst_case_tokens(c.rank, round);
    let most = (0..c.world)
        .map(|r| worst_case_tokens(r, round))
        .max()
        .unwrap_or(0);
    // At least a row a rank: `num_worst_tokens(0)` would ask for exact outputs (one rank, whose
    // only rank sends nothing in round 2).
    let worst = most.max(1) * c.world;
    let (x, idx, w) = inputs(c, t, round, 3)?;
    let (xd, idxd, wd) = (gpu(c, &x)?, gpu(c, &idx)?, gpu(c, &w)?);
    let exact = c
        .cpu
        .dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(e))
        .map_err(err)?;
    let n = exact.recv_x.dims()[0];
    let oh = c
        .cpu
        .dispatch(
            &DispatchArgs::new(&x)
                .topk(&idx, &w)
                .num_experts(e)
                .num_worst_tokens(worst),
        )
        .map_err(err)?;
    poison_pool(&c.gpu, 64)?;
    let od = c
        .cuda
        .dispatch(
            &DispatchArgs::new(&xd)
                .topk(&idxd, &wd)
                .num_experts(e)
                .num_worst_tokens(worst)
                .async_finish(true),
        )
        .map_err(err)?;
    od.event.wait().map_err(err)?;
    for (what, o) in [("host", &oh), ("cuda", &od)] {
        if o.recv_x.dims() != [worst, HIDDEN] || o.handle.num_recv_tokens() != worst {
            return Err(format!(
                "{what}: recv_x {:?}, handle rows {}; want [{worst}, {HIDDEN}]",
                o.recv_x.dims(),
                o.handle.num_recv_tokens()
            ));
        }
        if !o.num_recv_tokens_per_expert.is_empty() {
            return Err(format!(
                "{what}: counts per expert returned with worst-case outputs"
            ));
        }
    }
    let head = |t: &Tensor| t.narrow(0, 0, n).map_err(err);
    same("received rows", &head(&od.recv_x)?, &exact.recv_x)?;
    same("host received rows", &head(&oh.recv_x)?, &exact.recv_x)?;
    routing_matches(&od, &oh)?;
    // Combine all rows back: the rows past the received ones are never read (the GPU's are
    // poison).
    combine_matches(c, &x, &oh, &od)?;
    // Cached dispatch along the worst-case handle: the same shape, the same rows.
    let (kh, kd) = cached_pair(c, &x, &oh, &od)?;
    if kd.recv_x.dims() != [worst, HIDDEN] {
        return Err(format!("cached recv_x {:?}", kd.recv_x.dims()));
    }
    same("cached rows", &head(&kd.recv_x)?, &head(&kh.recv_x)?)?;
    same("cached recv_src_idx", &kd.recv_src_idx, &kh.recv_src_idx)?;
    Ok(())
}

/// Worst-case outputs too small for one rank's count: the host backend refuses on every rank
/// before any payload moves; the CUDA dispatch moves nothing, and the next op on every rank
/// reports the same error (rank, count, capacity); the op after it runs as usual.
fn normal_worst_case_overflow(c: &Ctx) -> TestResult {
    let e = 8 * c.world;
    let t = 20;
    let (x, idx, w) = inputs(c, t, 0, 5)?;
    let (xd, idxd, wd) = (gpu(c, &x)?, gpu(c, &idx)?, gpu(c, &w)?);
    let args = |x, i, w| {
        DispatchArgs::new(x)
            .topk(i, w)
            .num_experts(e)
            .num_worst_tokens(3)
    };
    let host = match c.cpu.dispatch(&args(&x, &idx, &w)) {
        Err(e @ ep_runtime::Error::RecvCapacity { .. }) => e.to_string(),
        Err(e) => return Err(format!("host: {e}, want RecvCapacity")),
        Ok(_) => return Err("host: a dispatch over its worst case succeeded".into()),
    };
    let od = c
        .cuda
        .dispatch(&args(&xd, &idxd, &wd).async_finish(true))
        .map_err(err)?;
    // The record is written by the kernel: wait for it before the next op reads it.
    od.event.wait().map_err(err)?;
    drop(od);
    let exact = DispatchArgs::new(&xd).topk(&idxd, &wd).num_experts(e);
    let cuda = match c.cuda.dispatch(&exact) {
        Err(e @ ep_runtime::Error::RecvCapacity { .. }) => e.to_string(),
        Err(e) => return Err(format!("cuda: {e}, want RecvCapacity")),
        Ok(_) => return Err("cuda: the op after an overflowing dispatch succeeded".into()),
    };
    if cuda != host {
        return Err(format!("cuda says `{cuda}`, host `{host}`"));
    }
    let oh = c
        .cpu
        .dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(e))
        .map_err(err)?;
    let od = c.cuda.dispatch(&exact).map_err(err)?;
    same("recv_x after the error", &od.recv_x, &oh.recv_x)?;
    Ok(())
}

fn normal_fp8(c: &Ctx) -> TestResult {
    let e = 8 * c.world;
    let t = 9 + 7 * c.rank;
    let (x, idx, w) = inputs(c, t, 0, 2)?;
    let (q, s) = per_token_cast_to_fp8(&x, false).map_err(err)?;
    let (qd, sd, idxd, wd) = (gpu(c, &q)?, gpu(c, &s)?, gpu(c, &idx)?, gpu(c, &w)?);
    let oh = c
        .cpu
        .dispatch(
            &DispatchArgs::new(&q)
                .x_scales(&s)
                .topk(&idx, &w)
                .num_experts(e),
        )
        .map_err(err)?;
    let od = c
        .cuda
        .dispatch(
            &DispatchArgs::new(&qd)
                .x_scales(&sd)
                .topk(&idxd, &wd)
                .num_experts(e),
        )
        .map_err(err)?;
    same("fp8 recv_x", &od.recv_x, &oh.recv_x)?;
    let pick = |o: &Option<Tensor>| o.clone().ok_or_else(|| "recv_x_scales missing".to_string());
    same(
        "fp8 recv_x_scales",
        &pick(&od.recv_x_scales)?,
        &pick(&oh.recv_x_scales)?,
    )?;
    same("fp8 recv_src_idx", &od.recv_src_idx, &oh.recv_src_idx)?;
    // Cached fp8 dispatch.
    let kh = c
        .cpu
        .dispatch(&DispatchArgs::new(&q).x_scales(&s).cached(&oh.handle))
        .map_err(err)?;
    let kd = c
        .cuda
        .dispatch(&DispatchArgs::new(&qd).x_scales(&sd).cached(&od.handle))
        .map_err(err)?;
    same("cached fp8 recv_x", &kd.recv_x, &kh.recv_x)?;
    Ok(())
}

/// Checks the received rows of each local expert (only rows below its count are defined).
fn same_ll_rows(what: &str, d: &Tensor, h: &Tensor, counts: &[usize]) -> TestResult {
    for (le, &n) in counts.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let a = d.get(le).and_then(|t| t.narrow(0, 0, n)).map_err(err)?;
        let b = h.get(le).and_then(|t| t.narrow(0, 0, n)).map_err(err)?;
        same(&format!("{what}[{le}]"), &a, &b)?;
    }
    Ok(())
}

fn low_latency(c: &Ctx, round: usize) -> TestResult {
    let e = 8 * c.world;
    let t = if round == 1 && c.rank == 0 {
        0
    } else {
        3 + 5 * ((c.rank + round) % 6)
    };
    let (x, idx, w) = inputs(c, t, round, 3)?;
    let (xd, idxd, wd) = (gpu(c, &x)?, gpu(c, &idx)?, gpu(c, &w)?);
    // bf16 and fp8 per expert, and bf16 per rank (the weights dispatched).
    for (fp8, red) in [
        (false, Reduction::PerExpert),
        (true, Reduction::PerExpert),
        (false, Reduction::PerRank),
    ] {
        let mut ah = LowLatencyDispatchArgs::new(&x, &idx, LL_MAX_TOKENS, e);
        let mut ad = LowLatencyDispatchArgs::new(&xd, &idxd, LL_MAX_TOKENS, e);
        if fp8 {
            ah = ah.fp8(round == 2);
            ad = ad.fp8(round == 2);
        }
        if red == Reduction::PerRank {
            ah = ah.weights(&w);
            ad = ad.weights(&wd);
        }
        let oh = c.cpu.low_latency_dispatch(&ah).map_err(err)?;
        // The CUDA side through the send hook.
        let hook = c.cuda.low_latency_dispatch_send(&ad).map_err(err)?;
        let od = hook.recv().map_err(err)?;
        let (count_d, count_h) = (
            od.recv_count_host().map_err(err)?,
            oh.recv_count_host().map_err(err)?,
        );
        if count_d != count_h {
            return Err(format!(
                "recv_count {count_d:?} (cuda) vs {count_h:?} (host)"
            ));
        }
        same("recv_count", &od.recv_count, &oh.recv_count)?;
        same_ll_rows("recv_x", &od.recv_x, &oh.recv_x, &count_h)?;
        if fp8 {
            let pick = |o: &Option<Tensor>| o.clone().ok_or_else(|| "scales missing".to_string());
            same_ll_rows(
                "recv_x_scales",
                &pick(&od.recv_x_scales)?,
                &pick(&oh.recv_x_scales)?,
                &count_h,
            )?;
        }
        same("src_info", od.handle.src_info(), oh.handle.src_info())?;
        same(
            "layout_range",
            &od.handle.layout_range().map_err(err)?,
            &oh.handle.layout_range().map_err(err)?,
        )?;
        if !fp8 {
            // Identity experts: combine the received rows back.
            let ch = c
                .cpu
                .low_latency_combine(
                    &LowLatencyCombineArgs::new(&oh.recv_x, &idx, &w, &oh.handle).reduction(red),
                )
                .map_err(err)?;
            let hook = c
                .cuda
                .low_latency_combine_send(
                    &LowLatencyCombineArgs::new(&od.recv_x, &idxd, &wd, &od.handle).reduction(red),
                )
                .map_err(err)?;
            let cd = hook.recv().map_err(err)?;
            close(
                &format!("low-latency combined_x ({red:?})"),
                &cd.combined_x,
                &ch.combined_x,
            )?;
        }
    }
    if c.cuda.active_ranks().iter().any(|a| !a) {
        return Err(format!(
            "ranks masked after clean ops: {:?}",
            c.cuda.active_ranks()
        ));
    }
    Ok(())
}

/// A CUDA buffer across nodes built without `with_internode` has no normal mode: its dispatch
/// fails with `Unsupported` naming the internode path (and the layout, a local kernel, still
/// works).
fn normal_unsupported(c: &Ctx) -> TestResult {
    let e = 8 * c.world;
    let store = c._store.as_ref().ok_or("no bootstrap store")?;
    let plain = Buffer::from_store(
        store,
        c.topo,
        BufferConfig::default().with_timeout(Duration::from_secs(30)),
        &c.gpu,
    )
    .map_err(err)?;
    if plain.has_normal_mode() {
        return Err(
            "a buffer across nodes without with_internode says it has a normal mode".into(),
        );
    }
    let (x, idx, w) = inputs(c, 7, 0, 1)?;
    let (xd, idxd, wd) = (gpu(c, &x)?, gpu(c, &idx)?, gpu(c, &w)?);
    let lh = c.cpu.get_dispatch_layout(&idx, e).map_err(err)?;
    let ld = plain.get_dispatch_layout(&idxd, e).map_err(err)?;
    same(
        "num_tokens_per_rank",
        &ld.num_tokens_per_rank,
        &lh.num_tokens_per_rank,
    )?;
    match plain.dispatch(&DispatchArgs::new(&xd).topk(&idxd, &wd).layout(&ld)) {
        Err(ep_runtime::Error::Unsupported(msg)) if msg.contains("internode") => Ok(()),
        Err(e) => Err(format!(
            "expected Unsupported naming the internode path, got {e}"
        )),
        Ok(_) => Err("normal dispatch across nodes succeeded on a buffer without it".into()),
    }
}

/// Fills `MiB` of freed pool memory with `0x7f` bytes (bf16 3.4e38, fp8 NaN, i32 0x7f7f7f7f)
/// on candle's stream: the op's next stream-ordered allocations most likely reuse it, so an
/// output element the kernels fail to write shows up as poison.
fn poison_pool(gpu: &Device, mib: usize) -> TestResult {
    let n = mib << 20;
    let t = Tensor::from_vec(vec![0x7fu8; n], n, &Device::Cpu)
        .and_then(|t| t.to_device(gpu))
        .map_err(err)?;
    drop(t);
    Ok(())
}

/// A one-rank buffer of this process's GPU (the single-GPU decode path: send and receive in
/// one launch, nothing zeroed or filled before the kernels) against a one-rank host buffer,
/// bit-exact, with the pool poisoned before every op: 0, 1 and 7 tokens, bf16 and fp8, through
/// the send hook and in one call.
fn low_latency_one_rank(c: &Ctx) -> TestResult {
    let e = 8;
    let cfg = BufferConfig::default()
        .with_timeout(Duration::from_secs(30))
        .with_low_latency(LL_MAX_TOKENS, HIDDEN, e)
        .with_nvl_bytes(64 << 20);
    let cuda = Buffer::single(&c.gpu, cfg.clone()).map_err(err)?;
    let cpu = Buffer::single(&Device::Cpu, cfg).map_err(err)?;
    let one = Ctx {
        rank: 0,
        world: 1,
        nodes: 1,
        topo: Topology::new(0, 1, 1).map_err(err)?,
        gpu: c.gpu.clone(),
        cuda,
        cpu,
        _store: None,
    };
    for (i, t) in [0usize, 1, 7].into_iter().enumerate() {
        let (x, idx, w) = inputs(&one, t, 0, 10 + i as u64)?;
        let (xd, idxd, wd) = (gpu(&one, &x)?, gpu(&one, &idx)?, gpu(&one, &w)?);
        for fp8 in [false, true] {
            for hook in [false, true] {
                let what = format!("t={t} fp8={fp8} hook={hook}");
                let ctx = |e: String| format!("{what}: {e}");
                let mut ah = LowLatencyDispatchArgs::new(&x, &idx, LL_MAX_TOKENS, e);
                let mut ad = LowLatencyDispatchArgs::new(&xd, &idxd, LL_MAX_TOKENS, e);
                if fp8 {
                    ah = ah.fp8(false);
                    ad = ad.fp8(false);
                }
                let oh = one.cpu.low_latency_dispatch(&ah).map_err(err)?;
                poison_pool(&one.gpu, 16)?;
                let od = if hook {
                    let h = one.cuda.low_latency_dispatch_send(&ad).map_err(err)?;
                    h.recv().map_err(err)?
                } else {
                    one.cuda.low_latency_dispatch(&ad).map_err(err)?
                };
                let counts = oh.recv_count_host().map_err(err)?;
                same("recv_count", &od.recv_count, &oh.recv_count).map_err(ctx)?;
                same_ll_rows("recv_x", &od.recv_x, &oh.recv_x, &counts).map_err(ctx)?;
                if fp8 {
                    let pick =
                        |o: &Option<Tensor>| o.clone().ok_or_else(|| "scales missing".to_string());
                    same_ll_rows(
                        "recv_x_scales",
                        &pick(&od.recv_x_scales)?,
                        &pick(&oh.recv_x_scales)?,
                        &counts,
                    )
                    .map_err(ctx)?;
                } else if od.recv_x_scales.is_some() {
                    return Err(ctx("bf16 dispatch returned scales".into()));
                }
                // Every element, also the -1 past the counts.
                same("src_info", od.handle.src_info(), oh.handle.src_info()).map_err(ctx)?;
                same(
                    "layout_range",
                    &od.handle.layout_range().map_err(err)?,
                    &oh.handle.layout_range().map_err(err)?,
                )
                .map_err(ctx)?;
                // Identity experts on the received rows (cast back to bf16 for fp8).
                let back = |o: &ep_runtime::LowLatencyDispatchOutput| match &o.recv_x_scales {
                    Some(sc) => per_token_cast_back(&o.recv_x, sc, DType::BF16).map_err(err),
                    None => Ok(o.recv_x.clone()),
                };
                let (yd, yh) = (back(&od)?, back(&oh)?);
                let ch = one
                    .cpu
                    .low_latency_combine(&LowLatencyCombineArgs::new(&yh, &idx, &w, &oh.handle))
                    .map_err(err)?;
                poison_pool(&one.gpu, 16)?;
                let cargs = LowLatencyCombineArgs::new(&yd, &idxd, &wd, &od.handle);
                let cd = if hook {
                    let h = one.cuda.low_latency_combine_send(&cargs).map_err(err)?;
                    h.recv().map_err(err)?
                } else {
                    one.cuda.low_latency_combine(&cargs).map_err(err)?
                };
                same("combined_x", &cd.combined_x, &ch.combined_x).map_err(ctx)?;
            }
        }
    }
    one.cuda.low_latency_check().map_err(err)?;
    one.cuda.low_latency_poll().map_err(err)?;
    if one.cuda.active_ranks() != vec![true] {
        return Err(format!(
            "masked after clean ops: {:?}",
            one.cuda.active_ranks()
        ));
    }
    Ok(())
}

/// The last rank never calls dispatch: every other rank must fail naming it within the
/// timeout (plus slack), not hang.
fn missing_rank(c: &Ctx) -> TestResult {
    let missing = c.world - 1;
    let e = 8 * c.world;
    let (x, idx, w) = inputs(c, 8, 0, 4)?;
    if c.rank == missing {
        // Stay alive (holding the mapped buffers) while the others time out.
        std::thread::sleep(Duration::from_secs(12));
        return Ok(());
    }
    let (xd, idxd, wd) = (gpu(c, &x)?, gpu(c, &idx)?, gpu(c, &w)?);
    let start = Instant::now();
    let res = c
        .cuda
        .dispatch(&DispatchArgs::new(&xd).topk(&idxd, &wd).num_experts(e));
    let took = start.elapsed();
    match res {
        Ok(_) => {
            Err("dispatch succeeded without rank {missing}"
                .replace("{missing}", &missing.to_string()))
        }
        Err(e) if e.rank() == Some(missing) && took < Duration::from_secs(10) => {
            println!("rank {} got, after {took:?}: {e}", c.rank);
            Ok(())
        }
        Err(e) => Err(format!(
            "after {took:?}: expected an error naming rank {missing}, got: {e}"
        )),
    }
}
