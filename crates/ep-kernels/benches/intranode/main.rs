//! Intranode (NVLink) dispatch / combine benchmark in DeepEP's configuration: 4096 tokens per
//! rank, hidden 7168, top-8 of 256 experts (random scores, top-k), on all visible GPUs (2 or 4;
//! `EP_BENCH_RANKS` overrides). Reports bf16 and fp8 dispatch and bf16 combine, timed with CUDA
//! events per iteration (median across iterations and ranks), and GB/s counted as DeepEP
//! does: bytes of all received rows (local ones included) over time; fp8 bytes = bf16 bytes x
//! (1 + 4/128) / 2. Sweeps SM counts and chunk sizes. Every timed iteration starts with the
//! L2 cache flushed (a 256 MiB write queued before the start event) after warm-up iterations.
//!
//! With the `nccl` feature, two NCCL baselines of the bf16 dispatch, counted the same way:
//! - "rows only": a grouped send/recv all-to-all of exactly the dispatched rows, already packed
//!   (a lower bound for any NCCL dispatch);
//! - "full dispatch": what a user writes with NCCL: layout kernel -> all-gather of the per-rank
//!   counts -> host synchronisation (receive sizes) -> index list and row gather into a packed
//!   send buffer -> grouped send/recv of the rows; timed end to end (CUDA events and host time).
//!
//! Both transfer paths are measured: SM rings (`dispatch_cuda` / `combine_cuda`, swept over
//! SMs, chunks and ring sizes) and the copy-engine path (`ce_dispatch_cuda` /
//! `ce_combine_cuda`, swept over SMs and chunk sizes; `chunk` = first chunk rows, `ring` =
//! largest chunk rows in its rows). `EP_BENCH_PATH=ring|ce` limits the run to one of them.
//! `EP_BENCH_CE_SPLITS="ce:sms:blocks:push,..."` (e.g. `1:22:2:1`) and
//! `EP_BENCH_CE_CHUNKS="first:largest,..."` replace the copy-engine sweep's lists;
//! `EP_BENCH_CE_LOCAL="0:4,4:0"` times each dispatch with those
//! `pack_local_blocks:pack_local_warps`; `EP_BENCH_CE_COMBINE_PUSH_WARPS="0,16"` times each
//! combine with those `combine_push_warps`; `EP_BENCH_CE_TAIL="0,1"` with those
//! `combine_ce_tail_chunks`; `EP_BENCH_CE_PUSH_CHUNKS="0:0,256:256"` each dispatch with those
//! `push_first_chunk_rows:push_max_chunk_rows`. `EP_BENCH_CE_DEFAULTS=1` times only the
//! copy-engine defaults a user gets at 24 SMs (`CeConfig::dispatch_for`, `dispatch_fp8_for`,
//! `combine_for`), one row per op.
//!
//! Writes JSON to `$EP_BENCH_OUT` if set. `EP_BENCH_QUICK=1` runs a short sweep;
//! `EP_BENCH_ITERS` sets the timed iterations of every op (10 quick, else 20);
//! `EP_BENCH_DISPATCH_CHUNKS` / `EP_BENCH_COMBINE_CHUNKS` / `EP_BENCH_RINGS` (comma lists) set the
//! rings' chunks and sizes.
//! Run (GPU machine): `bench_intranode` (built by `scripts/gpu/package.sh`), or here
//! `cargo bench -p ep-kernels --features nccl --bench bench_intranode`.
//!
//! Modules: `state` (shape, inputs, handles), `timing` (launches and CUDA-event timing),
//! `sweep` (the copy-engine and ring sweeps), `nccl` (the baselines), `report` (rows, summary,
//! JSON).

#[path = "../common/mod.rs"]
mod common;
mod nccl;
mod report;
mod state;
mod sweep;
mod timing;

use common::{BoxError, Node};
use ep_kernels::intranode::{buffer_size_hint, ce_buffer_size_hint, Config, CopyStreams};
use rand::rngs::StdRng;
use rand::SeedableRng;
use report::Row;
use state::{setup, EXPERTS, HIDDEN, TOKENS, TOPK};
use sweep::{env_usize, RingPlan};

fn main() -> Result<(), BoxError> {
    let gpus = common::device_count();
    let r = env_usize("EP_BENCH_RANKS").unwrap_or(if gpus >= 4 { 4 } else { gpus.min(2) });
    if r < 1 || gpus < r {
        println!("intranode bench: needs {r} GPU(s), found {gpus}; nothing to run");
        return Ok(());
    }
    let quick = std::env::var("EP_BENCH_QUICK").is_ok_and(|v| v == "1");
    let plan = RingPlan::new(quick);
    let max_cfg = Config::new(
        *plan.sms.iter().max().unwrap_or(&48),
        32,
        *plan.rings.iter().max().unwrap_or(&256),
    )?;
    let node = Node::new(
        r,
        buffer_size_hint(HIDDEN, TOPK, r, &max_cfg)
            .max(ce_buffer_size_hint(TOKENS, HIDDEN, TOPK, r)),
    )?;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut states = setup(&node, &mut rng)?;
    let warmup = 3;
    let iters = env_usize("EP_BENCH_ITERS").unwrap_or(if quick { 10 } else { 20 });
    println!(
        "intranode bench: EP{r}, {TOKENS} tokens/rank, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}; recv tokens per rank {:?}",
        states.iter().map(|s| s.num_recv).collect::<Vec<_>>()
    );
    let path = std::env::var("EP_BENCH_PATH").unwrap_or_default();
    let copies: Vec<CopyStreams> = node
        .ctxs
        .iter()
        .map(|c| CopyStreams::new(c, r))
        .collect::<Result<_, _>>()?;
    let mut rows: Vec<Row> = Vec::new();
    if path != "ring" {
        rows.extend(sweep::copy_engine(
            &node,
            &mut states,
            &copies,
            r,
            quick,
            warmup,
            iters,
        )?);
    }
    if path != "ce" {
        rows.extend(sweep::rings(
            &node,
            &mut states,
            &copies,
            &plan,
            warmup,
            iters,
        )?);
    }
    let (nccl_rows, nccl_full) = nccl::baselines(&node, &mut states, warmup, iters)?;
    report::print_summary(r, &rows, nccl_rows, nccl_full);
    if let Ok(path) = std::env::var("EP_BENCH_OUT") {
        report::write_json(&path, r, &rows, nccl_rows, nccl_full)?;
    }
    Ok(())
}
