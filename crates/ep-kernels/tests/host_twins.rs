//! Host twins against naive references, over random routings (with `-1`, empty ranks, one
#![allow(clippy::needless_range_loop)] // naive references index ranks and tokens
//! hot expert, `T = 0`).

use ep_kernels::intranode::{channel_prefix_matrix, channel_range, notify, send_slots};
use ep_kernels::layout::{get_dispatch_layout, ExpertPlacement};
use ep_kernels::low_latency::{self as ll, RecvLayout};
use proptest::prelude::*;

/// `(R, P, E, K, T, topk_idx)` with ids in `[-1, E)`; some routings use a single hot expert.
fn routing() -> impl Strategy<Value = (usize, usize, usize, usize, usize, Vec<i64>)> {
    (
        1usize..=8,
        1usize..=4,
        1usize..=6,
        0usize..40,
        any::<bool>(),
    )
        .prop_flat_map(|(r, lpr, k, t, hot)| {
            let p_choices: Vec<usize> = (1..=r).filter(|p| r % p == 0).collect();
            let e = r * lpr;
            let id = if hot {
                (-1i64..=0).boxed()
            } else {
                (-1i64..e as i64).boxed()
            };
            (
                Just(r),
                prop::sample::select(p_choices),
                Just(e),
                Just(k),
                Just(t),
                prop::collection::vec(id, t * k),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn layout_matches_naive((r, p, e, k, t, idx) in routing()) {
        let pl = ExpertPlacement::new(e, r, p).unwrap();
        let l = get_dispatch_layout(&idx, t, k, &pl).unwrap();
        let lpr = e / r;
        for rank in 0..r {
            let n = (0..t).filter(|&i| idx[i*k..(i+1)*k].iter().any(|&v| v >= 0 && v as usize / lpr == rank)).count();
            prop_assert_eq!(l.num_tokens_per_rank[rank] as usize, n);
            for i in 0..t {
                let want = idx[i*k..(i+1)*k].iter().any(|&v| v >= 0 && v as usize / lpr == rank);
                prop_assert_eq!(l.is_token_in_rank[i * r + rank], want);
            }
        }
        for node in 0..r / p {
            let n = (0..t).filter(|&i| idx[i*k..(i+1)*k].iter().any(|&v| v >= 0 && v as usize / lpr / p == node)).count();
            prop_assert_eq!(l.num_tokens_per_node[node] as usize, n);
        }
        for ex in 0..e {
            prop_assert_eq!(l.num_tokens_per_expert[ex] as usize, idx.iter().filter(|&&v| v == ex as i64).count());
        }
    }

    #[test]
    fn notify_and_slots_match_naive((r, _p, e, k, t, idx) in routing(), align in 1usize..9, c in 1usize..9) {
        let pl = ExpertPlacement::new(e, r, r).unwrap();
        // Every rank uses a rotated copy of the routing so sources differ.
        let lays: Vec<_> = (0..r).map(|s| {
            let rot: Vec<i64> = idx.iter().map(|&v| if v < 0 { v } else { (v + s as i64) % e as i64 }).collect();
            (get_dispatch_layout(&rot, t, k, &pl).unwrap(), rot)
        }).collect();
        let per_rank: Vec<i32> = lays.iter().flat_map(|(l, _)| l.num_tokens_per_rank.clone()).collect();
        let per_expert: Vec<i32> = lays.iter().flat_map(|(l, _)| l.num_tokens_per_expert.clone()).collect();
        for me in 0..r {
            let n = notify(me, &per_rank, &per_expert, &pl, align).unwrap();
            let total: i32 = (0..r).map(|s| per_rank[s * r + me]).sum();
            prop_assert_eq!(n.num_recv_tokens as i32, total);
            for le in 0..e / r {
                let raw: i32 = (0..r).map(|s| per_expert[s * e + me * (e / r) + le]).sum();
                let want = (raw as usize).div_ceil(align) * align;
                prop_assert_eq!(n.num_recv_tokens_per_expert[le] as usize, want);
            }
            // Slots: for destination `me`, all sources' slots form 0..total in (source, token) order.
            let mut expect = 0;
            for (s, (l, _)) in lays.iter().enumerate() {
                let slots = send_slots(s, &l.is_token_in_rank, t, &n.rank_prefix_matrix, r).unwrap();
                for i in 0..t {
                    let v = slots[i * r + me];
                    if l.is_token_in_rank[i * r + me] {
                        prop_assert_eq!(v, expect);
                        expect += 1;
                    } else {
                        prop_assert_eq!(v, -1);
                    }
                }
            }
        }
        // Channel prefix: last column is the per-rank count; columns are non-decreasing.
        let (l0, _) = &lays[0];
        let m = channel_prefix_matrix(&l0.is_token_in_rank, t, r, c).unwrap();
        for d in 0..r {
            prop_assert_eq!(m[d * c + c - 1], l0.num_tokens_per_rank[d]);
            for ch in 0..c {
                let n: i32 = channel_range(t, c, ch).map(|i| l0.is_token_in_rank[i * r + d] as i32).sum();
                let prev = if ch == 0 { 0 } else { m[d * c + ch - 1] };
                prop_assert_eq!(m[d * c + ch] - prev, n);
            }
        }
    }

    #[test]
    fn low_latency_slots_and_layout((r, _p, e, k, t, idx) in routing()) {
        let pl = ExpertPlacement::new(e, r, r).unwrap();
        let (slots, counts) = ll::send_slots(&idx, t, k, &pl).unwrap();
        let mut seen = vec![0i32; e];
        for (j, &v) in idx.iter().enumerate() {
            if v < 0 {
                prop_assert_eq!(slots[j], -1);
            } else {
                prop_assert_eq!(slots[j], seen[v as usize]);
                seen[v as usize] += 1;
            }
        }
        prop_assert_eq!(&counts, &seen);
        // Packed layout of rank 0 if every source sent these counts.
        let lpr = e / r;
        let c: Vec<i32> = (0..lpr).flat_map(|le| (0..r).map(move |s| ((le + 2 * s) % 5) as i32)).collect();
        let lay = RecvLayout::from_counts(c.clone(), r);
        for le in 0..lpr {
            let mut acc = 0;
            for s in 0..r {
                prop_assert_eq!(lay.offsets[le * r + s], acc);
                acc += c[le * r + s];
            }
            prop_assert_eq!(lay.recv_count[le], acc);
        }
    }
}

#[test]
fn low_latency_combine_skips_masked_ranks() {
    use half::bf16;
    let pl = ExpertPlacement::new(4, 2, 2).unwrap();
    let idx = [0i64, 3, -1, 2];
    let w = [0.5f32, 2.0, 1.0, 1.0];
    let rows: Vec<Vec<bf16>> = (0..4)
        .map(|e| vec![bf16::from_f32(e as f32 + 1.0); 4])
        .collect();
    let all = ll::combine(&idx, &w, 2, 2, 4, &pl, &[true, true], |t, kk| {
        &rows[idx[t * 2 + kk] as usize][..]
    })
    .unwrap();
    assert_eq!(all[0].to_f32(), 0.5 * 1.0 + 2.0 * 4.0);
    assert_eq!(all[4].to_f32(), 3.0);
    let masked = ll::combine(&idx, &w, 2, 2, 4, &pl, &[true, false], |t, kk| {
        &rows[idx[t * 2 + kk] as usize][..]
    })
    .unwrap();
    assert_eq!(masked[0].to_f32(), 0.5);
    assert_eq!(masked[4].to_f32(), 0.0);
}

/// `(E, K, G, topk_group, T, logits)`: `E = G * per_group`, `K` reachable from the allowed
/// groups, logits in (-10, 10) with some exact ties.
fn logits_routing() -> impl Strategy<Value = (usize, usize, usize, usize, usize, Vec<f32>)> {
    (1usize..=8, 1usize..=12, 0usize..12).prop_flat_map(|(g, per, t)| {
        let e = g * per;
        (1..=g).prop_flat_map(move |tg| {
            let logit = prop_oneof![(-10.0f32..10.0), Just(0.5f32), Just(-3.0f32)];
            (
                Just(e),
                1..=(tg * per).min(32),
                Just(g),
                Just(tg),
                Just(t),
                prop::collection::vec(logit, t * e),
            )
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Routing from logits is routing from the scored logits, bit for bit, and the scoring is
    /// within 1e-6 (relative) of the f64 sigmoid / softmax, plus for softmax the rounding of
    /// `l - max` in f32 (relative `|l - max| * 2^-24` after `exp`).
    #[test]
    fn routing_from_logits_scores_them_first(
        (e, k, g, tg, t, logits) in logits_routing(),
        softmax in any::<bool>(),
        with_bias in any::<bool>(),
        top2 in any::<bool>(),
    ) {
        use ep_kernels::routing::{route_topk, scoring, GroupScore, Scoring, TopkInput, TopkSpec};
        let spec = TopkSpec {
            num_experts: e,
            top_k: k,
            n_group: g,
            topk_group: tg,
            group_score: if top2 { GroupScore::Top2Sum } else { GroupScore::Max },
            norm_topk_prob: softmax,
            scaling: 1.5,
        };
        let bias: Vec<f32> = (0..e).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
        let bias = with_bias.then_some(bias.as_slice());
        let f = if softmax { Scoring::Softmax } else { Scoring::Sigmoid };
        let mut scores = vec![0f32; t * e];
        for (row, out) in logits.chunks_exact(e).zip(scores.chunks_exact_mut(e)) {
            if softmax {
                scoring::softmax(row, out);
            } else {
                for (o, &l) in out.iter_mut().zip(row) {
                    *o = scoring::sigmoid(l);
                }
            }
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
            let sum: f64 = row.iter().map(|&l| (f64::from(l) - max).exp()).sum();
            for (&o, &l) in out.iter().zip(row) {
                let l = f64::from(l);
                let (want, rtol) = if softmax {
                    ((l - max).exp() / sum, 1e-6 + (l - max).abs() * 2f64.powi(-24))
                } else {
                    (1.0 / (1.0 + (-l).exp()), 1e-6)
                };
                prop_assert!((f64::from(o) - want).abs() <= rtol * want, "{} vs {}", o, want);
            }
        }
        let (mut idx, mut w) = (vec![0i64; t * k], vec![0f32; t * k]);
        route_topk(&logits, TopkInput::Logits(f), bias, &spec, &mut idx, &mut w).unwrap();
        let (mut want_idx, mut want_w) = (vec![0i64; t * k], vec![0f32; t * k]);
        route_topk(&scores, TopkInput::Scores, bias, &spec, &mut want_idx, &mut want_w).unwrap();
        prop_assert_eq!(idx, want_idx);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&w), bits(&want_w));
    }

    /// The gate twin equals a naive f64 dot product (summed backwards) within one f32 rounding.
    #[test]
    fn gate_twin_matches_naive(
        (e, h, t) in (1usize..20, 1usize..40, 0usize..6),
        seed in any::<u64>(),
    ) {
        use ep_kernels::routing::{gate_logits, GateShape};
        use half::bf16;
        // A small LCG: values in [-2, 2) from the seed.
        let mut state = seed | 1;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        let x: Vec<bf16> = (0..t * h).map(|_| bf16::from_f32(next())).collect();
        let w: Vec<f32> = (0..e * h).map(|_| next() * 0.1).collect();
        let mut logits = vec![f32::NAN; t * e];
        gate_logits(&x, &w, GateShape { num_experts: e, hidden: h }, &mut logits).unwrap();
        for tok in 0..t {
            for ex in 0..e {
                let mut want = 0f64;
                for i in (0..h).rev() {
                    want += x[tok * h + i].to_f64() * f64::from(w[ex * h + i]);
                }
                let got = f64::from(logits[tok * e + ex]);
                prop_assert!((got - want).abs() <= want.abs() * 2f64.powi(-23) + 1e-30,
                    "[{}, {}] {} vs {}", tok, ex, got, want);
            }
        }
    }
}
