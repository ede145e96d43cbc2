//! Turning timings into rows, the NCCL baselines' figures, the printed summary and the JSON
//! file (`EP_BENCH_OUT`).

use std::fmt::Write as _;

use crate::state::{RankState, EXPERTS, HIDDEN, TOKENS, TOPK};
use crate::timing::{median, Op};
use crate::BoxError;

/// Turns per-rank median milliseconds into a row (and prints it).
pub fn make_row(
    op: Op,
    num_sms: usize,
    chunk: usize,
    ring: usize,
    ms: &[f32],
    states: &[RankState],
    split: String,
) -> Row {
    let per_rank: Vec<f32> = ms
        .iter()
        .zip(states)
        .map(|(&t, s)| (bytes(op, s.num_recv) / 1e9 / (t as f64 / 1e3)) as f32)
        .collect();
    let mut all = ms.to_vec();
    let row = Row {
        op,
        num_sms,
        chunk,
        ring,
        us: median(&mut all) * 1e3,
        gbps: per_rank.iter().sum::<f32>() / per_rank.len() as f32,
        gbps_min_rank: per_rank.iter().copied().fold(f32::INFINITY, f32::min),
        split,
    };
    println!(
        "{:<16} sms {:>3} chunk {:>4} ring {:>4}: {:>8.1} us  {:>7.1} GB/s (NVL, mean of ranks; min {:.1}) {}",
        op.name(), num_sms, chunk, ring, row.us, row.gbps, row.gbps_min_rank, row.split
    );
    row
}

/// One measured configuration.
pub struct Row {
    pub op: Op,
    pub num_sms: usize,
    pub chunk: usize,
    pub ring: usize,
    pub us: f32,
    pub gbps: f32,
    pub gbps_min_rank: f32,
    /// Copy-engine path split: "ce<copy-engine peers>+<pack/reduce SMs>+<SM-copy blocks>".
    pub split: String,
}

/// One NCCL baseline's figures (bf16 dispatch bytes).
#[derive(Debug, Clone, Copy)]
pub struct Baseline {
    /// Median over ranks of the per-rank median device time (CUDA events), microseconds.
    pub us: f32,
    /// Mean over ranks of each rank's received bytes over its median time.
    pub gbps: f32,
    /// Median host wall time per iteration, microseconds (full dispatch: it synchronises).
    pub host_us: Option<f32>,
    /// Median over ranks of the device time before the rows' all-to-all starts (layout, count
    /// exchange, host sync, packing), microseconds (full dispatch).
    pub prep_us: Option<f32>,
}

impl Baseline {
    pub fn json(b: Option<Self>) -> String {
        let opt = |v: Option<f32>| v.map_or("null".to_owned(), |v| format!("{v:.2}"));
        match b {
            Some(b) => format!(
                "{{\"time_us\": {:.2}, \"gbps\": {:.2}, \"host_us\": {}, \"prep_us\": {}}}",
                b.us,
                b.gbps,
                opt(b.host_us),
                opt(b.prep_us)
            ),
            None => "null".into(),
        }
    }
}

/// From per-rank lists of per-iteration milliseconds: (median over ranks of the per-rank
/// medians in microseconds, mean over ranks of the per-rank bf16-dispatch GB/s).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub fn summarize(per_rank_ms: &[Vec<f32>], states: &[RankState]) -> (f32, f32) {
    let mut medians: Vec<f32> = per_rank_ms.iter().map(|v| median(&mut v.clone())).collect();
    let gbps: Vec<f32> = medians
        .iter()
        .zip(states)
        .map(|(&m, st)| (bytes(Op::DispatchBf16, st.num_recv) / 1e9 / (m as f64 / 1e3)) as f32)
        .collect();
    let g = gbps.iter().sum::<f32>() / gbps.len().max(1) as f32;
    (median(&mut medians) * 1e3, g)
}

pub fn bytes(op: Op, n: usize) -> f64 {
    let bf16 = (n * HIDDEN * 2) as f64;
    match op {
        Op::DispatchFp8 | Op::CeDispatchFp8 => bf16 * (1.0 + 4.0 / 128.0) / 2.0,
        _ => bf16,
    }
}

/// Prints the best row per op (at any SM count and at <= 24 SMs, the figure DeepEP reports)
/// and the NCCL baselines of `r` ranks.
pub fn print_summary(
    r: usize,
    rows: &[Row],
    nccl_rows: Option<Baseline>,
    nccl_full: Option<Baseline>,
) {
    // Summary: best per op, and the 24-SM numbers DeepEP reports.
    println!("\n== summary (EP{r}) ==");
    println!(
        "{:<16} {:>5} {:>6} {:>5} {:>10} {:>10}",
        "op", "sms", "chunk", "ring", "time_us", "GB/s"
    );
    for op in [
        Op::DispatchBf16,
        Op::DispatchFp8,
        Op::Combine,
        Op::CeDispatchBf16,
        Op::CeDispatchFp8,
        Op::CeCombine,
    ] {
        if let Some(b) = rows
            .iter()
            .filter(|x| x.op == op)
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "{:<16} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (best) {}",
                op.name(),
                b.num_sms,
                b.chunk,
                b.ring,
                b.us,
                b.gbps,
                b.split
            );
        }
        if let Some(b) = rows
            .iter()
            .filter(|x| x.op == op && x.num_sms <= 24)
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "{:<16} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (best at <= 24 SMs) {}",
                op.name(),
                b.num_sms,
                b.chunk,
                b.ring,
                b.us,
                b.gbps,
                b.split
            );
        }
    }
    if let Some(b) = nccl_rows {
        println!(
            "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (NCCL send/recv of the packed rows only)",
            "nccl-rows-bf16", "-", "-", "-", b.us, b.gbps
        );
    }
    if let Some(b) = nccl_full {
        println!(
        "{:<14} {:>5} {:>6} {:>5} {:>10.1} {:>10.1}  (NCCL full dispatch: layout, counts, sync, gather, send/recv; host {:.1} us)",
        "nccl-full-bf16",
        "-",
        "-",
        "-",
        b.us,
        b.gbps,
        b.host_us.unwrap_or(f32::NAN)
    );
        if let Some(best) = rows
            .iter()
            .filter(|x| matches!(x.op, Op::DispatchBf16 | Op::CeDispatchBf16))
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
        {
            println!(
                "dispatch-bf16 best vs NCCL full dispatch: {:.2}x the bandwidth",
                best.gbps / b.gbps
            );
        }
    }
}

/// Writes every row and the NCCL baselines of `r` ranks as JSON to `path`.
pub fn write_json(
    path: &str,
    r: usize,
    rows: &[Row],
    nccl_rows: Option<Baseline>,
    nccl_full: Option<Baseline>,
) -> Result<(), BoxError> {
    let mut json = String::from("{\n  \"bench\": \"intranode\",\n");
    let _ = writeln!(json, "  \"num_ranks\": {r}, \"tokens\": {TOKENS}, \"hidden\": {HIDDEN}, \"topk\": {TOPK}, \"experts\": {EXPERTS},");
    let _ = writeln!(json, "  \"nccl_rows_only\": {},", Baseline::json(nccl_rows));
    let _ = writeln!(
        json,
        "  \"nccl_full_dispatch\": {},",
        Baseline::json(nccl_full)
    );
    json.push_str("  \"rows\": [\n");
    for (i, x) in rows.iter().enumerate() {
        let _ = writeln!(
            json,
            "    {{\"op\": \"{}\", \"num_sms\": {}, \"chunk\": {}, \"ring\": {}, \"split\": \"{}\", \"time_us\": {:.2}, \"gbps\": {:.2}, \"gbps_min_rank\": {:.2}}}{}",
            x.op.name(), x.num_sms, x.chunk, x.ring, x.split, x.us, x.gbps, x.gbps_min_rank,
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    json.push_str("  ]\n}\n");
    std::fs::write(path, json)?;
    println!("wrote {path}");
    Ok(())
}
