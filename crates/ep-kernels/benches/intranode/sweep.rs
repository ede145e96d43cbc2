//! The two sweeps: the copy-engine path over (copy-engine peers, SMs, SM-copy blocks, push)
//! splits, chunk sizes and dispatch variants, and the SM rings over SMs, ring sizes and chunks.

use ep_kernels::intranode::{CeConfig, Config, CopyStreams, COMBINE_ROUND_TOKENS};

use crate::common::{BoxError, Node};
use crate::report::{make_row, Row};
use crate::state::{notify_all, RankState};
use crate::timing::{time_op, Op};

/// `$name` as a number; `None` when unset or not a number.
pub fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// `$name` as comma-separated tuples of `:`-separated numbers, each of `arity` numbers; `None`
/// when unset, an error naming the variable when malformed.
pub fn env_tuples(name: &str, arity: usize) -> Result<Option<Vec<Vec<usize>>>, BoxError> {
    let Ok(v) = std::env::var(name) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for item in v.split(',').filter(|s| !s.is_empty()) {
        let nums = item
            .split(':')
            .map(|x| x.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{name}: {item:?}: {e}"))?;
        if nums.len() != arity {
            return Err(format!("{name}: {item:?} needs {arity} numbers separated by ':'").into());
        }
        out.push(nums);
    }
    Ok(Some(out))
}

/// SM counts, chunk and ring sizes of the ring sweep (`quick`: a short sweep;
/// `EP_BENCH_DISPATCH_CHUNKS` / `EP_BENCH_COMBINE_CHUNKS` / `EP_BENCH_RINGS` replace the lists).
pub struct RingPlan {
    /// SM counts.
    pub sms: Vec<usize>,
    /// Dispatch chunks (tokens per send).
    pub dispatch_chunks: Vec<usize>,
    /// Combine chunks.
    pub combine_chunks: Vec<usize>,
    /// Ring sizes (tokens).
    pub rings: Vec<usize>,
}

impl RingPlan {
    /// The full sweep, or a short one when `quick`.
    pub fn new(quick: bool) -> Self {
        let sms: Vec<usize> = if quick {
            vec![24]
        } else {
            vec![16, 20, 24, 32, 48]
        };
        let dispatch_chunks: Vec<usize> = if quick {
            vec![6, 24]
        } else {
            vec![4, 6, 8, 12, 16, 24, 32]
        };
        let combine_chunks: Vec<usize> = if quick {
            vec![9]
        } else {
            vec![4, 6, 9, 12, 16, 24]
        };
        let rings: Vec<usize> = if quick {
            vec![256]
        } else {
            vec![128, 256, 512]
        };
        Self {
            sms,
            dispatch_chunks: list_from_env("EP_BENCH_DISPATCH_CHUNKS").unwrap_or(dispatch_chunks),
            combine_chunks: list_from_env("EP_BENCH_COMBINE_CHUNKS").unwrap_or(combine_chunks),
            rings: list_from_env("EP_BENCH_RINGS").unwrap_or(rings),
        }
    }
}

/// A comma-separated list of sizes from the environment (`None` when unset or empty; entries
/// that do not parse are skipped).
fn list_from_env(name: &str) -> Option<Vec<usize>> {
    let v: Vec<usize> = std::env::var(name)
        .ok()?
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    (!v.is_empty()).then_some(v)
}

/// SM-copy blocks `op` launches with `ce` on `r` ranks: the combine launches them only when
/// some home is not served by copy engines; the dispatch always does (metadata).
fn sm_blocks_used(op: Op, ce: &CeConfig, r: usize) -> usize {
    if op != Op::CeCombine || ce.copy_engine_peers < r - 1 {
        ce.sm_blocks
    } else {
        0
    }
}

/// A copy-engine dispatch variant: `own_rows_last`, `copy_lanes`, `local_copy_out`,
/// `(pack_local_blocks, pack_local_warps)`, `(push_first_chunk_rows, push_max_chunk_rows)`.
type DispatchVariant = (bool, usize, bool, (usize, usize), Option<(usize, usize)>);

/// The copy-engine sweep on `r` ranks (`EP_BENCH_CE_SPLITS`, `EP_BENCH_CE_CHUNKS`,
/// `EP_BENCH_CE_VARIANTS`, `EP_BENCH_CE_LOCAL`, `EP_BENCH_CE_COMBINE_PUSH_WARPS` and
/// `EP_BENCH_CE_TAIL` replace its lists); returns one row per (split, chunks, variant, op).
/// `EP_BENCH_CE_DEFAULTS=1`: one row per op with exactly `CeConfig::dispatch_for`,
/// `dispatch_fp8_for` and `combine_for` at 24 SMs instead.
#[allow(clippy::too_many_arguments)]
pub fn copy_engine(
    node: &Node,
    states: &mut [RankState],
    copies: &[CopyStreams],
    r: usize,
    quick: bool,
    warmup: usize,
    iters: usize,
) -> Result<Vec<Row>, BoxError> {
    let mut rows: Vec<Row> = Vec::new();
    let notify_cfg = Config::new(24, 1, 1)?;
    let mut handles = notify_all(node, states, &notify_cfg)?;
    // Per-rank median milliseconds of `op` with `ce`.
    let time_ce = |states: &mut [RankState], handles: &mut [_], op: Op, ce: &CeConfig| {
        time_op(
            node,
            states,
            handles,
            op,
            &notify_cfg,
            &notify_cfg,
            (copies, ce),
            warmup,
            iters,
        )
    };
    if env_usize("EP_BENCH_CE_DEFAULTS").unwrap_or(0) != 0 {
        // Exactly the defaults a user gets at 24 SMs, one row per op.
        for (op, ce) in [
            (Op::CeDispatchBf16, CeConfig::dispatch_for(r, 24)),
            (Op::CeDispatchFp8, CeConfig::dispatch_fp8_for(r, 24)),
            (Op::CeCombine, CeConfig::combine_for(r, 24)),
        ] {
            let ms = time_ce(states, &mut handles, op, &ce)?;
            let split = format!(
                "defaults ce{}+{}+{} local{}:{} push-chunks{}:{}",
                ce.copy_engine_peers,
                ce.num_sms,
                ce.sm_blocks,
                ce.pack_local_blocks,
                ce.pack_local_warps,
                ce.push_first_chunk_rows,
                ce.push_max_chunk_rows
            );
            let total = ce.num_sms + sm_blocks_used(op, &ce, r);
            let row = make_row(
                op,
                total,
                ce.first_chunk_rows,
                ce.max_chunk_rows,
                &ms,
                states,
                split,
            );
            rows.push(row);
        }
        return Ok(rows);
    }
    // (copy-engine peers, pack/reduce SMs, SM-copy blocks, dispatch push): SMs in all = the
    // middle two.
    let splits: Vec<(usize, usize, usize, bool)> = if quick {
        let mut v = vec![
            (1, 16, 8, true),
            (1, 20, 4, true),
            (1, 22, 2, true),
            (1, 12, 12, true),
            (0, 12, 12, true),
            (r - 1, 20, 4, true),
            (1, 24, 16, true),
        ];
        if r > 2 {
            v.extend([
                (1, 16, 8, false),
                (1, 12, 12, false),
                (0, 12, 12, false),
                (1, 20, 4, false),
            ]);
        }
        v
    } else {
        let mut v = Vec::new();
        for ce_peers in [0, 1, r - 1] {
            for (a, b) in [
                (8, 8),
                (12, 12),
                (16, 8),
                (20, 4),
                (22, 2),
                (24, 8),
                (32, 16),
            ] {
                v.push((ce_peers, a, b, true));
                if r > 2 && ce_peers < r - 1 {
                    v.push((ce_peers, a, b, false));
                }
            }
        }
        v.dedup();
        v
    };
    let splits = match env_tuples("EP_BENCH_CE_SPLITS", 4)? {
        Some(v) => v.iter().map(|t| (t[0], t[1], t[2], t[3] != 0)).collect(),
        None => splits,
    };
    let ce_chunks: Vec<(usize, usize)> = if let Some(v) = env_tuples("EP_BENCH_CE_CHUNKS", 2)? {
        v.iter().map(|t| (t[0], t[1])).collect()
    } else if quick {
        vec![(256, 1024), (512, 2048), (768, 4096), (1024, 4096)]
    } else {
        vec![(128, 512), (256, 1024), (512, 2048), (1024, 4096)]
    };
    // Dispatch variants to compare, "own_rows_last:copy_lanes:local_copy_out" (`CeConfig`):
    // 1:2:x = own rows last, two copy streams per copy-engine peer, pushed rows copied out by
    // the local copy engines (x = 1) or by SMs (x = 0); 0:1:0 = one pack pass, one stream.
    // Default: `CeConfig::dispatch_for`'s choice for this rank count.
    let variants: Vec<(bool, usize, bool)> = match env_tuples("EP_BENCH_CE_VARIANTS", 3)? {
        Some(v) => v.iter().map(|t| (t[0] != 0, t[1], t[2] != 0)).collect(),
        None => {
            let d = CeConfig::dispatch_for(r, 24);
            vec![(d.own_rows_last, d.copy_lanes, d.local_copy_out)]
        }
    };
    // Each variant with every "pack_local_blocks:pack_local_warps" of `EP_BENCH_CE_LOCAL`.
    let local: Vec<(usize, usize)> = match env_tuples("EP_BENCH_CE_LOCAL", 2)? {
        Some(v) => v.iter().map(|t| (t[0], t[1])).collect(),
        None => {
            let d = CeConfig::dispatch_for(r, 24);
            vec![(d.pack_local_blocks, d.pack_local_warps)]
        }
    };
    // ... and with every "first:largest" chunking of the pushed blocks of
    // `EP_BENCH_CE_PUSH_CHUNKS` (0:0 = the general chunking; default: `dispatch_for`'s for
    // bf16 and `dispatch_fp8_for`'s for fp8, marked `None` here).
    let push_chunks: Vec<Option<(usize, usize)>> = match env_tuples("EP_BENCH_CE_PUSH_CHUNKS", 2)? {
        Some(v) => v.iter().map(|t| Some((t[0], t[1]))).collect(),
        None => vec![None],
    };
    let variants: Vec<DispatchVariant> = variants
        .iter()
        .flat_map(|&(a, b, c)| local.iter().map(move |&l| (a, b, c, l)))
        .flat_map(|(a, b, c, l)| push_chunks.iter().map(move |&pc| (a, b, c, l, pc)))
        .collect();
    let push_warps = list_from_env("EP_BENCH_CE_COMBINE_PUSH_WARPS")
        .unwrap_or(vec![CeConfig::combine_for(r, 24).combine_push_warps]);
    let tails = list_from_env("EP_BENCH_CE_TAIL")
        .unwrap_or(vec![CeConfig::combine_for(r, 24).combine_ce_tail_chunks]);
    let combine_variants: Vec<(usize, usize)> = push_warps
        .iter()
        .flat_map(|&w| tails.iter().map(move |&t| (w, t)))
        .collect();
    for &(copy_engine_peers, num_sms, sm_blocks, dispatch_push) in &splits {
        for &(first, max) in &ce_chunks {
            for (
                vi,
                &(
                    own_rows_last,
                    copy_lanes,
                    local_copy_out,
                    (pack_local_blocks, pack_local_warps),
                    push_chunks,
                ),
            ) in variants.iter().enumerate()
            {
                let ce = CeConfig {
                    num_sms,
                    first_chunk_rows: first,
                    max_chunk_rows: max,
                    push_first_chunk_rows: 0,
                    push_max_chunk_rows: 0,
                    copy_engine_peers,
                    sm_blocks,
                    dispatch_push,
                    own_rows_last,
                    pack_local_warps,
                    pack_local_blocks,
                    copy_lanes,
                    local_copy_out,
                    combine_push_warps: 0,
                    combine_ce_tail_chunks: 0,
                };
                // Combine does not depend on the dispatch variant: timed once, with each
                // `combine_push_warps` of `EP_BENCH_CE_COMBINE_PUSH_WARPS` and each
                // `combine_ce_tail_chunks` of `EP_BENCH_CE_TAIL`.
                let mut ops = vec![(Op::CeDispatchBf16, (0, 0)), (Op::CeDispatchFp8, (0, 0))];
                if vi == 0 {
                    ops.extend(combine_variants.iter().map(|&v| (Op::CeCombine, v)));
                }
                for (op, (combine_push_warps, combine_ce_tail_chunks)) in ops {
                    let (push_first_chunk_rows, push_max_chunk_rows) =
                        push_chunks.unwrap_or_else(|| {
                            let d = if op == Op::CeDispatchFp8 {
                                CeConfig::dispatch_fp8_for(r, 24)
                            } else {
                                CeConfig::dispatch_for(r, 24)
                            };
                            (d.push_first_chunk_rows, d.push_max_chunk_rows)
                        });
                    let ce = CeConfig {
                        combine_push_warps,
                        combine_ce_tail_chunks,
                        push_first_chunk_rows,
                        push_max_chunk_rows,
                        ..ce
                    };
                    let ms = time_ce(states, &mut handles, op, &ce)?;
                    let used = sm_blocks_used(op, &ce, r);
                    let total = num_sms + used;
                    let split = format!(
                        "ce{copy_engine_peers}+{num_sms}+{used}{}{}{}{}{}",
                        if dispatch_push || op == Op::CeCombine {
                            ""
                        } else {
                            " pull"
                        },
                        if op == Op::CeCombine {
                            format!(
                                "{}{}",
                                if combine_push_warps > 0 {
                                    format!(" roles{combine_push_warps}")
                                } else {
                                    String::new()
                                },
                                if combine_ce_tail_chunks > 0 {
                                    format!(" tail{combine_ce_tail_chunks}")
                                } else {
                                    String::new()
                                }
                            )
                        } else if own_rows_last {
                            format!(" local{pack_local_blocks}:{pack_local_warps}")
                        } else {
                            " one-pass".to_string()
                        },
                        if op == Op::CeCombine {
                            String::new()
                        } else {
                            format!(" lanes{copy_lanes}")
                        },
                        if local_copy_out && op != Op::CeCombine {
                            " ce-out"
                        } else {
                            ""
                        },
                        if push_first_chunk_rows + push_max_chunk_rows > 0 && op != Op::CeCombine {
                            format!(" push-chunks{push_first_chunk_rows}:{push_max_chunk_rows}")
                        } else {
                            String::new()
                        }
                    );
                    let row = make_row(op, total, first, max, &ms, states, split);
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
}

/// The SM-ring sweep of `plan`; returns one row per (SMs, ring, op, chunk).
pub fn rings(
    node: &Node,
    states: &mut [RankState],
    copies: &[CopyStreams],
    plan: &RingPlan,
    warmup: usize,
    iters: usize,
) -> Result<Vec<Row>, BoxError> {
    let mut rows: Vec<Row> = Vec::new();
    let RingPlan {
        sms,
        dispatch_chunks,
        combine_chunks,
        rings,
    } = plan;
    for &num_sms in sms {
        let notify_cfg = Config::new(num_sms, 1, 1)?;
        let mut handles = notify_all(node, states, &notify_cfg)?;
        for &ring in rings {
            for op in [Op::DispatchBf16, Op::DispatchFp8, Op::Combine] {
                let chunks = if op == Op::Combine {
                    combine_chunks
                } else {
                    dispatch_chunks
                };
                for &chunk in chunks.iter() {
                    if op == Op::Combine && ring < chunk + COMBINE_ROUND_TOKENS || chunk > ring {
                        continue;
                    }
                    let cfg = Config::new(num_sms, chunk, ring)?;
                    let dcfg = Config::new(num_sms, 6.min(ring), ring)?;
                    let ce = CeConfig::default();
                    let ms = time_op(
                        node,
                        states,
                        &mut handles,
                        op,
                        &cfg,
                        &dcfg,
                        (copies, &ce),
                        warmup,
                        iters,
                    )?;
                    rows.push(make_row(
                        op,
                        num_sms,
                        chunk,
                        ring,
                        &ms,
                        states,
                        String::new(),
                    ));
                }
            }
        }
    }
    Ok(rows)
}
