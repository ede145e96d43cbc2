//! Normal-mode dispatch and combine on the host backend, against a naive reference.
#![allow(clippy::needless_range_loop)] // reference code indexes ranks, tokens and channels

mod common;

use candle_core::DType;
use common::{routing, run_ranks, tagged_tokens, tensor, test_seed, Style};
use ep_runtime::{BufferConfig, CombineArgs, DispatchArgs, Error};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

struct Inputs {
    x: Vec<Vec<f32>>,
    idx: Vec<Vec<i64>>,
    w: Vec<Vec<f32>>,
}

fn inputs(
    seed: u64,
    r: usize,
    tokens: &[usize],
    k: usize,
    e: usize,
    h: usize,
    style: Style,
) -> Inputs {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut x = Vec::new();
    let mut idx = Vec::new();
    let mut w = Vec::new();
    for (rank, &t) in tokens.iter().enumerate().take(r) {
        x.push(tagged_tokens(rank, t, h));
        idx.push(routing(&mut rng, t, k, e, r, style));
        w.push((0..t * k).map(|_| rng.random_range(0.01f32..1.0)).collect());
    }
    Inputs { x, idx, w }
}

/// Checks one rank's dispatch outputs against a naive walk over every source's tokens.
fn check_dispatch(
    n_ranks: usize,
    tokens: Vec<usize>,
    k: usize,
    e: usize,
    style: Style,
    alignment: usize,
    seed: u64,
) {
    let h = 16;
    let inp = Arc::new(inputs(seed, n_ranks, &tokens, k, e, h, style));
    let tok = tokens.clone();
    run_ranks(n_ranks, n_ranks, BufferConfig::default(), move |buf| {
        let me = buf.topology().rank;
        let t = tok[me];
        let x = tensor(inp.x[me].clone(), &[t, h]);
        let idx = tensor(inp.idx[me].clone(), &[t, k]);
        let w = tensor(inp.w[me].clone(), &[t, k]);
        let layout = buf.get_dispatch_layout(&idx, e).unwrap();
        let out = buf
            .dispatch(
                &DispatchArgs::new(&x)
                    .topk(&idx, &w)
                    .layout(&layout)
                    .expert_alignment(alignment),
            )
            .unwrap();
        let l = e / n_ranks;
        // Naive expectation: sources in rank order, tokens in order, a token once per rank.
        let mut ex_x = Vec::new();
        let mut ex_src = Vec::new();
        let mut ex_idx = Vec::new();
        let mut ex_w = Vec::new();
        let mut per_expert = vec![0usize; l];
        for s in 0..n_ranks {
            for ti in 0..tok[s] {
                let row = &inp.idx[s][ti * k..(ti + 1) * k];
                let mine: Vec<bool> = row
                    .iter()
                    .map(|&v| v >= 0 && v as usize / l == me)
                    .collect();
                if !mine.iter().any(|&m| m) {
                    continue;
                }
                ex_x.extend_from_slice(&inp.x[s][ti * h..(ti + 1) * h]);
                ex_src.push(ti as i32);
                for kk in 0..k {
                    if mine[kk] {
                        ex_idx.push(row[kk] - (me * l) as i64);
                        ex_w.push(inp.w[s][ti * k + kk]);
                        per_expert[row[kk] as usize % l] += 1;
                    } else {
                        ex_idx.push(-1);
                        ex_w.push(0.0);
                    }
                }
            }
        }
        let n = ex_src.len();
        assert_eq!(out.recv_x.dims(), &[n, h]);
        assert_eq!(
            out.recv_x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            ex_x
        );
        assert_eq!(out.recv_src_idx.to_vec1::<i32>().unwrap(), ex_src);
        let ri = out.recv_topk_idx.as_ref().unwrap();
        assert_eq!(ri.flatten_all().unwrap().to_vec1::<i64>().unwrap(), ex_idx);
        let rw = out.recv_topk_weights.as_ref().unwrap();
        assert_eq!(rw.flatten_all().unwrap().to_vec1::<f32>().unwrap(), ex_w);
        let aligned: Vec<usize> = per_expert
            .iter()
            .map(|c| c.div_ceil(alignment) * alignment)
            .collect();
        assert_eq!(out.num_recv_tokens_per_expert, aligned);
        assert_eq!(out.handle.num_recv_tokens(), n);

        // Cached dispatch of other data along the same routing: same rows, same order.
        let x2 = (&x * 2.0).unwrap();
        let again = buf
            .dispatch(&DispatchArgs::new(&x2).cached(&out.handle))
            .unwrap();
        let doubled: Vec<f32> = ex_x.iter().map(|v| v * 2.0).collect();
        assert_eq!(
            again
                .recv_x
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            doubled
        );

        // Combine of the received rows: each token comes back once per rank it went to.
        let back = buf
            .combine(&CombineArgs::new(&out.recv_x, &out.handle).topk_weights(rw))
            .unwrap();
        let got = back
            .combined_x
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let gw = back
            .combined_topk_weights
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for ti in 0..t {
            let row = &inp.idx[me][ti * k..(ti + 1) * k];
            let ranks: std::collections::BTreeSet<usize> = row
                .iter()
                .filter(|&&v| v >= 0)
                .map(|&v| v as usize / l)
                .collect();
            for c in 0..h {
                let v = inp.x[me][ti * h + c];
                assert_eq!(
                    got[ti * h + c],
                    v * ranks.len() as f32,
                    "token {ti} channel {c}"
                );
            }
            for kk in 0..k {
                let ew = if row[kk] >= 0 {
                    inp.w[me][ti * k + kk]
                } else {
                    0.0
                };
                assert_eq!(gw[ti * k + kk], ew);
            }
        }
    });
}

#[test]
fn dispatch_matches_naive_reference_over_rank_counts() {
    let seed = test_seed("dispatch_matches_naive_reference_over_rank_counts");
    for (i, r) in [1usize, 2, 4, 8].into_iter().enumerate() {
        let e = 16 * r.max(2) / 2;
        let tokens: Vec<usize> = (0..r).map(|i| 20 + 7 * i).collect();
        for style in [Style::Random, Style::HotExpert, Style::EmptyRanks] {
            check_dispatch(r, tokens.clone(), 4, e, style, 1 + i, seed ^ i as u64);
        }
    }
}

#[test]
fn dispatch_with_zero_tokens_on_some_ranks() {
    let seed = test_seed("dispatch_with_zero_tokens_on_some_ranks");
    check_dispatch(4, vec![0, 13, 0, 5], 3, 8, Style::Random, 4, seed);
    check_dispatch(2, vec![0, 0], 2, 4, Style::Random, 1, seed ^ 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn dispatch_property(r in prop::sample::select(vec![1usize, 2, 3, 4]), lpr in 1usize..4,
                         t0 in 0usize..24, t1 in 0usize..24, k in 1usize..5, align in 1usize..5,
                         style in prop::sample::select(vec![0u8, 1, 2]), seed in any::<u64>()) {
        let e = lpr * r;
        let k = k.min(e);
        let tokens: Vec<usize> = (0..r).map(|i| if i % 2 == 0 { t0 } else { t1 }).collect();
        let style = [Style::Random, Style::HotExpert, Style::EmptyRanks][style as usize];
        check_dispatch(r, tokens, k, e, style, align, seed);
    }
}

/// Identity experts: every rank returns each received token scaled by the sum of its local
/// weights; combine must give back `x * sum(weights)` exactly in bf16. Values are chosen so
/// every product and partial sum is exactly representable (small integers, weights 1/4 and
/// 1/2, K = 4).
#[test]
fn identity_experts_round_trip_exactly_in_bf16() {
    let seed = test_seed("identity_experts_round_trip_exactly_in_bf16");
    for r in [1usize, 2, 4, 8] {
        let (t, k, e, h) = (33usize, 4usize, 2 * r.max(2), 128usize);
        run_ranks(r, 2.min(r), BufferConfig::default(), move |buf| {
            let me = buf.topology().rank;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ me as u64 ^ (r as u64) << 8);
            let xs: Vec<f32> = (0..t * h)
                .map(|_| rng.random_range(-15i32..=15) as f32)
                .collect();
            let idx = routing(&mut rng, t, k.min(e), e, r, Style::Random);
            let ws: Vec<f32> = (0..t * k)
                .map(|_| if rng.random_bool(0.5) { 0.25 } else { 0.5 })
                .collect();
            let x = tensor(xs.clone(), &[t, h]).to_dtype(DType::BF16).unwrap();
            let idx_t = tensor(idx.clone(), &[t, k]);
            let w_t = tensor(ws.clone(), &[t, k]);
            let out = buf
                .dispatch(&DispatchArgs::new(&x).topk(&idx_t, &w_t).num_experts(e))
                .unwrap();
            // identity expert per received token: x * (sum of local weights), in f32 -> bf16
            let wsum = out
                .recv_topk_weights
                .as_ref()
                .unwrap()
                .sum_keepdim(1)
                .unwrap();
            let y = out
                .recv_x
                .to_dtype(DType::F32)
                .unwrap()
                .broadcast_mul(&wsum)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let back = buf.combine(&CombineArgs::new(&y, &out.handle)).unwrap();
            let got: Vec<bf16> = back.combined_x.flatten_all().unwrap().to_vec1().unwrap();
            // With the tokens themselves as the bias, the sums start from them.
            let biased = buf
                .combine(&CombineArgs::new(&y, &out.handle).bias(&x))
                .unwrap();
            let got_b: Vec<bf16> = biased.combined_x.flatten_all().unwrap().to_vec1().unwrap();
            // A bias of another shape or dtype is refused before anything moves, naming it.
            let wrong_shape = tensor(vec![0f32; (t + 1) * h], &[t + 1, h])
                .to_dtype(DType::BF16)
                .unwrap();
            let wrong_dtype = tensor(xs.clone(), &[t, h]);
            for bad in [&wrong_shape, &wrong_dtype] {
                let e = buf
                    .combine(&CombineArgs::new(&y, &out.handle).bias(bad))
                    .unwrap_err();
                assert!(e.to_string().contains("bias"), "{e}");
            }
            for ti in 0..t {
                let sw: f32 = (0..k)
                    .filter(|&kk| idx[ti * k + kk] >= 0)
                    .map(|kk| ws[ti * k + kk])
                    .sum();
                for c in 0..h {
                    let want = bf16::from_f32(xs[ti * h + c] * sw);
                    assert_eq!(got[ti * h + c], want, "rank {me} token {ti} channel {c}");
                    let want_b = bf16::from_f32(xs[ti * h + c] * (sw + 1.0));
                    assert_eq!(
                        got_b[ti * h + c],
                        want_b,
                        "bias: rank {me} token {ti} channel {c}"
                    );
                }
            }
        });
    }
}

/// fp8 payloads arrive bit-exact (data movement), and dequantise within fp8 error.
#[test]
fn fp8_dispatch_moves_bytes_and_scales_exactly() {
    let (r, t, k, e, h) = (4usize, 19usize, 3usize, 8usize, 256usize);
    run_ranks(r, 2, BufferConfig::default(), move |buf| {
        let me = buf.topology().rank;
        let mut rng = rand::rng();
        let xs: Vec<bf16> = (0..t * h)
            .map(|_| bf16::from_f32(rng.random_range(-4.0f32..4.0)))
            .collect();
        let (q, s) =
            ep_kernels::fp8::quantize(&xs, t, h, ep_kernels::fp8::ScaleFormat::Float).unwrap();
        let xq = tensor(q.clone(), &[t, h]);
        let xs_t = tensor(s.clone(), &[t, h / 128]);
        let idx = routing(&mut rng, t, k, e, r, Style::Random);
        let idx_t = tensor(idx, &[t, k]);
        let out = buf
            .dispatch(
                &DispatchArgs::new(&xq)
                    .x_scales(&xs_t)
                    .topk(&idx_t, &tensor(vec![1f32; t * k], &[t, k]))
                    .num_experts(e),
            )
            .unwrap();
        assert_eq!(out.recv_x.dtype(), DType::F8E4M3);
        // Send our own q/scales through a cached dispatch of the src indices to check bytes:
        // every received row must equal the sender's row with that src index; rows from this
        // rank itself are checked directly.
        let src = out.recv_src_idx.to_vec1::<i32>().unwrap();
        let rq: Vec<float8::F8E4M3> = out.recv_x.flatten_all().unwrap().to_vec1().unwrap();
        let rs: Vec<f32> = out
            .recv_x_scales
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let counts = {
            let p = out.handle.rank_prefix_matrix().to_vec2::<i32>().unwrap();
            (0..r)
                .map(|s| p[s][me] - if s == 0 { 0 } else { p[s - 1][me] })
                .collect::<Vec<_>>()
        };
        let own_start: i32 = counts[..me].iter().sum();
        for j in 0..counts[me] as usize {
            let row = own_start as usize + j;
            let ti = src[row] as usize;
            assert_eq!(&rq[row * h..(row + 1) * h], &q[ti * h..(ti + 1) * h]);
            assert_eq!(&rs[row * 2..row * 2 + 2], &s[ti * 2..ti * 2 + 2]);
        }
        // Dequantised rows are within fp8 error of *some* bf16 row: check the own rows.
        let deq = ep_kernels::fp8::dequantize(&rq, &rs, src.len(), h).unwrap();
        for j in 0..counts[me] as usize {
            let row = own_start as usize + j;
            let ti = src[row] as usize;
            for c in 0..h {
                let (a, b) = (xs[ti * h + c].to_f32(), deq[row * h + c].to_f32());
                assert!((a - b).abs() <= a.abs() / 16.0 + 4.0 / 448.0, "{a} vs {b}");
            }
        }
    });
}

#[test]
fn bad_inputs_are_rejected_before_anything_moves() {
    let errs = run_ranks(2, 2, BufferConfig::default(), |buf| {
        let x = tensor(vec![1f32; 4 * 8], &[4, 8]);
        let w = tensor(vec![1f32; 4 * 2], &[4, 2]);
        let mut msgs = Vec::new();
        let bad_idx = tensor(vec![0i64, 1, 2, 9, -1, -1, 0, 0], &[4, 2]);
        msgs.push(
            buf.dispatch(&DispatchArgs::new(&x).topk(&bad_idx, &w).num_experts(8))
                .unwrap_err()
                .to_string(),
        );
        let neg = tensor(vec![0i64, -2, 0, 0, 0, 0, 0, 0], &[4, 2]);
        msgs.push(buf.get_dispatch_layout(&neg, 8).unwrap_err().to_string());
        let idx = tensor(vec![0i64, 1, 2, 3, -1, -1, 0, 5], &[4, 2]);
        msgs.push(
            buf.dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(7))
                .unwrap_err()
                .to_string(),
        );
        let short_w = tensor(vec![1f32; 3 * 2], &[3, 2]);
        msgs.push(
            buf.dispatch(&DispatchArgs::new(&x).topk(&idx, &short_w).num_experts(8))
                .unwrap_err()
                .to_string(),
        );
        let xi = tensor(vec![1i64; 4 * 8], &[4, 8]);
        msgs.push(
            buf.dispatch(&DispatchArgs::new(&xi).topk(&idx, &w).num_experts(8))
                .unwrap_err()
                .to_string(),
        );
        let xq = x.to_dtype(DType::F8E4M3).unwrap();
        let sc = tensor(vec![1f32; 4], &[4, 1]);
        msgs.push(
            buf.dispatch(
                &DispatchArgs::new(&xq)
                    .x_scales(&sc)
                    .topk(&idx, &w)
                    .num_experts(8),
            )
            .unwrap_err()
            .to_string(),
        );
        let wi = tensor(vec![1i64; 4 * 2], &[4, 2]);
        msgs.push(
            buf.dispatch(&DispatchArgs::new(&x).topk(&idx, &wi).num_experts(8))
                .unwrap_err()
                .to_string(),
        );
        msgs
    });
    for msgs in errs {
        assert!(
            msgs[0].contains("topk_idx") && msgs[0].contains('9') && msgs[0].contains("[-1, 8)"),
            "{}",
            msgs[0]
        );
        assert!(msgs[1].contains("-2"), "{}", msgs[1]);
        assert!(
            msgs[2].contains("num_experts")
                && msgs[2].contains('7')
                && msgs[2].contains("multiple"),
            "{}",
            msgs[2]
        );
        assert!(
            msgs[3].contains("topk_weights")
                && msgs[3].contains("[4, 2]")
                && msgs[3].contains("[3, 2]"),
            "{}",
            msgs[3]
        );
        assert!(
            msgs[4].contains("`x`") && msgs[4].contains("I64"),
            "{}",
            msgs[4]
        );
        assert!(
            msgs[5].contains("hidden") && msgs[5].contains('8') && msgs[5].contains("128"),
            "{}",
            msgs[5]
        );
        assert!(
            msgs[6].contains("topk_weights") && msgs[6].contains("f32"),
            "{}",
            msgs[6]
        );
    }
}

#[test]
fn handles_from_other_buffers_or_layouts_are_rejected() {
    // Two groups; a handle of group A used on group B's buffer of the same rank.
    let a = ep_runtime::Buffer::local_group(1, 1, BufferConfig::default()).unwrap();
    let b = ep_runtime::Buffer::local_group(1, 1, BufferConfig::default()).unwrap();
    let x = tensor(vec![1f32; 3 * 4], &[3, 4]);
    let idx = tensor(vec![0i64, 1, 1], &[3, 1]);
    let w = tensor(vec![1f32; 3], &[3, 1]);
    let out = a[0]
        .dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(2))
        .unwrap();
    let e = b[0]
        .combine(&CombineArgs::new(&out.recv_x, &out.handle))
        .unwrap_err();
    assert!(matches!(e, Error::HandleMismatch(_)), "{e}");
    let e = b[0]
        .dispatch(&DispatchArgs::new(&x).cached(&out.handle))
        .unwrap_err();
    assert!(matches!(e, Error::HandleMismatch(_)), "{e}");
    // Right buffer, wrong shape of x for the handle.
    let x5 = tensor(vec![1f32; 5 * 4], &[5, 4]);
    let e = a[0]
        .dispatch(&DispatchArgs::new(&x5).cached(&out.handle))
        .unwrap_err();
    assert!(e.to_string().contains("5 tokens"), "{e}");
    let e = a[0]
        .combine(&CombineArgs::new(&x5, &out.handle))
        .unwrap_err();
    assert!(e.to_string().contains("[3, _]"), "{e}");
}

#[test]
fn a_dead_rank_is_named_within_the_timeout() {
    let cfg = BufferConfig::default().with_timeout(std::time::Duration::from_millis(800));
    let started = std::time::Instant::now();
    let res = run_ranks(3, 3, cfg, |buf| {
        let me = buf.topology().rank;
        let x = tensor(vec![1f32; 4 * 8], &[4, 8]);
        let idx = tensor(vec![0i64, 1, 2, 0], &[4, 1]);
        let w = tensor(vec![1f32; 4], &[4, 1]);
        let first = buf
            .dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(3))
            .map(|_| ());
        if me == 2 {
            // Rank 2 "dies": it drops its buffer (its transport) before the second op.
            drop(buf);
            return (first, Ok(()), None);
        }
        let second = buf
            .dispatch(&DispatchArgs::new(&x).topk(&idx, &w).num_experts(3))
            .map(|_| ());
        // Keep the survivors' buffers alive until every rank is done.
        (first, second, Some(buf))
    });
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    for (rank, (first, second, _buf)) in res.into_iter().enumerate() {
        first.unwrap();
        if rank < 2 {
            let e = second.unwrap_err();
            assert_eq!(e.rank(), Some(2), "rank {rank}: {e}");
            assert!(e.to_string().contains("rank 2"), "{e}");
        }
    }
}

#[test]
fn a_stuck_rank_times_out_naming_it() {
    let cfg = BufferConfig::default().with_timeout(std::time::Duration::from_millis(300));
    let res = run_ranks(2, 2, cfg, |buf| {
        let me = buf.topology().rank;
        if me == 1 {
            std::thread::sleep(std::time::Duration::from_millis(1500));
            return Ok(());
        }
        let x = tensor(vec![1f32; 2 * 4], &[2, 4]);
        let idx = tensor(vec![0i64, 1], &[2, 1]);
        buf.dispatch(
            &DispatchArgs::new(&x)
                .topk(&idx, &tensor(vec![1f32; 2], &[2, 1]))
                .num_experts(2),
        )
        .map(|_| ())
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(matches!(e, Error::Timeout { rank: 1, .. }), "{e}");
}

/// A rank that stalls is masked by every survivor at the op that waited for it (the error names
/// it); the next normal ops and all-gathers run without it: no token goes to its experts (they
/// contribute zero, as in low-latency mode), nothing is awaited from it, and the other ranks'
/// rows move exactly. A handle made before the masking that exchanged rows with it is refused.
#[test]
fn a_stalled_rank_is_masked_and_the_others_go_on() {
    let timeout = std::time::Duration::from_millis(400);
    let cfg = BufferConfig::default().with_timeout(timeout);
    let (r, h) = (3usize, 8usize);
    let res = run_ranks(r, r, cfg, move |buf| {
        let me = buf.topology().rank;
        // Token i of every rank goes to expert i (one per rank) with weight 1.
        let x = tensor((0..3 * h).map(|v| (me * 100 + v) as f32).collect(), &[3, h]);
        let idx = tensor(vec![0i64, 1, 2], &[3, 1]);
        let w = tensor(vec![1f32; 3], &[3, 1]);
        let args = DispatchArgs::new(&x).topk(&idx, &w).num_experts(3);
        let before = buf.dispatch(&args).unwrap();
        if me == 2 {
            // Stalls past every survivor's timeout, its buffer alive (not a disconnect).
            std::thread::sleep(timeout * 4);
            return None;
        }
        let err = buf.dispatch(&args).map(|_| ()).unwrap_err();
        let active = buf.active_ranks();
        // The same routing again: rank 2's expert takes nothing now.
        let out = buf.dispatch(&args).unwrap();
        let back = buf
            .combine(&CombineArgs::new(&out.recv_x, &out.handle))
            .unwrap()
            .combined_x;
        let gathered = buf.host_all_gather(&[me as u8]).unwrap();
        let stale = buf
            .combine(&CombineArgs::new(&before.recv_x, &before.handle))
            .map(|_| ())
            .unwrap_err();
        Some((err, active, out.recv_x.dims()[0], back, x, gathered, stale))
    });
    for (me, got) in res.into_iter().enumerate() {
        let Some((err, active, received, back, x, gathered, stale)) = got else {
            assert_eq!(me, 2);
            continue;
        };
        assert_eq!(err.rank(), Some(2), "rank {me}: {err}");
        assert_eq!(active, vec![true, true, false], "rank {me}");
        // Ranks 0 and 1 each send their token `me` to rank `me`: two rows.
        assert_eq!(received, 2, "rank {me}");
        // Tokens 0 and 1 come back as sent; token 2 (rank 2's expert) as zeros.
        let back: Vec<f32> = back.flatten_all().unwrap().to_vec1().unwrap();
        let x: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&back[..2 * h], &x[..2 * h], "rank {me}");
        assert!(back[2 * h..].iter().all(|&v| v == 0.0), "rank {me}");
        assert_eq!(gathered, vec![vec![0u8], vec![1u8], vec![]], "rank {me}");
        assert!(
            matches!(&stale, Error::RanksMasked { ranks } if ranks == &vec![2]),
            "rank {me}: {stale}"
        );
    }
}

/// Worst-case outputs (`num_worst_tokens`): the exact dispatch's rows first, then rows from
/// nowhere (zeros, source -1, routing -1, weight 0), no counts per expert; combine and a cached
/// dispatch along the handle give what the exact ones give. Too small a worst case fails on
/// every rank, naming the same rank, and the buffer goes on.
#[test]
fn worst_case_outputs_pad_the_exact_ones() {
    let seed = test_seed("worst_case_outputs_pad_the_exact_ones");
    let (r, k, e, h) = (4usize, 3usize, 8usize, 16usize);
    let tokens = vec![9usize, 0, 17, 4];
    let worst = 17 * r;
    for style in [Style::Random, Style::HotExpert, Style::EmptyRanks] {
        let inp = Arc::new(inputs(seed, r, &tokens, k, e, h, style));
        let tok = tokens.clone();
        let errors = run_ranks(r, r, BufferConfig::default(), move |buf| {
            let me = buf.topology().rank;
            let t = tok[me];
            let x = tensor(inp.x[me].clone(), &[t, h]);
            let idx = tensor(inp.idx[me].clone(), &[t, k]);
            let w = tensor(inp.w[me].clone(), &[t, k]);
            let args = || DispatchArgs::new(&x).topk(&idx, &w).num_experts(e);
            let exact = buf.dispatch(&args()).unwrap();
            let out = buf.dispatch(&args().num_worst_tokens(worst)).unwrap();
            let n = exact.recv_x.dims()[0];
            assert_eq!(out.recv_x.dims(), [worst, h]);
            assert_eq!(out.handle.num_recv_tokens(), worst);
            assert!(out.num_recv_tokens_per_expert.is_empty());
            let rows = |t: &candle_core::Tensor, a: usize, b: usize| {
                t.narrow(0, a, b - a)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            assert_eq!(rows(&out.recv_x, 0, n), rows(&exact.recv_x, 0, n));
            assert!(rows(&out.recv_x, n, worst).iter().all(|&v| v == 0.0));
            let src: Vec<i32> = out.recv_src_idx.to_vec1().unwrap();
            let ex_src: Vec<i32> = exact.recv_src_idx.to_vec1().unwrap();
            assert_eq!(&src[..n], &ex_src[..]);
            assert!(src[n..].iter().all(|&s| s == -1));
            let ids_of = |o: &ep_runtime::DispatchOutput| -> Vec<i64> {
                let idx = o.recv_topk_idx.as_ref().unwrap();
                idx.flatten_all().unwrap().to_vec1().unwrap()
            };
            let (ids, ex_ids) = (ids_of(&out), ids_of(&exact));
            assert_eq!(&ids[..n * k], &ex_ids[..]);
            assert!(ids[n * k..].iter().all(|&i| i == -1));
            let ws = rows(out.recv_topk_weights.as_ref().unwrap(), 0, worst);
            let ex_ws = rows(exact.recv_topk_weights.as_ref().unwrap(), 0, n);
            assert_eq!(&ws[..n * k], &ex_ws[..]);
            assert!(ws[n * k..].iter().all(|&v| v == 0.0));
            // Combine every row back (the padding is not read), and a cached dispatch.
            let ce = buf
                .combine(&CombineArgs::new(&exact.recv_x, &exact.handle))
                .unwrap();
            let cw = buf
                .combine(&CombineArgs::new(&out.recv_x, &out.handle))
                .unwrap();
            assert_eq!(rows(&cw.combined_x, 0, t), rows(&ce.combined_x, 0, t));
            let x2 = (&x * 2.0).unwrap();
            let kw = buf
                .dispatch(&DispatchArgs::new(&x2).cached(&out.handle))
                .unwrap();
            let ke = buf
                .dispatch(&DispatchArgs::new(&x2).cached(&exact.handle))
                .unwrap();
            assert_eq!(kw.recv_x.dims(), [worst, h]);
            assert_eq!(rows(&kw.recv_x, 0, n), rows(&ke.recv_x, 0, n));
            assert!(buf
                .dispatch(
                    &DispatchArgs::new(&x2)
                        .cached(&out.handle)
                        .num_worst_tokens(worst)
                )
                .is_err());
            // Too small: every rank fails, naming the first rank over it.
            let err = match buf.dispatch(&args().num_worst_tokens(2)) {
                Err(e @ Error::RecvCapacity { .. }) => e.to_string(),
                other => panic!("rank {me}: want RecvCapacity, got {other:?}"),
            };
            let again = buf.dispatch(&args()).unwrap();
            assert_eq!(again.recv_x.dims()[0], n);
            err
        });
        assert!(
            errors.windows(2).all(|p| p[0] == p[1]),
            "{style:?}: {errors:?}"
        );
    }
}
