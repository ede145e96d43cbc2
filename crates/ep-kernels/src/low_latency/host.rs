//! Host twins of the low-latency kernels.

use crate::error::{Error, Result};
use crate::layout::ExpertPlacement;
use half::bf16;

/// For each `(t, k)` of one source's `topk_idx: [T, K]`, the slot it takes in its expert's
/// region for this source (`-1` for `-1` entries). Also returns the per-expert counts `[E]`.
pub fn send_slots(
    topk_idx: &[i64],
    num_tokens: usize,
    num_topk: usize,
    placement: &ExpertPlacement,
) -> Result<(Vec<i32>, Vec<i32>)> {
    Error::check_len("topk_idx", num_tokens * num_topk, topk_idx.len())?;
    placement.check_topk_idx(topk_idx)?;
    let mut counts = vec![0i32; placement.num_experts];
    let slots = topk_idx
        .iter()
        .map(|&e| {
            if e < 0 {
                -1
            } else {
                let c = &mut counts[e as usize];
                *c += 1;
                *c - 1
            }
        })
        .collect();
    Ok((slots, counts))
}

/// The receive layout of one rank: per local expert `l` and source `s`, where its tokens start
/// in the packed `recv_x[l]` and how many there are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvLayout {
    /// Number of ranks `R`.
    pub num_ranks: usize,
    /// `[L, R]`: first packed row of source `s`'s tokens for local expert `l`.
    pub offsets: Vec<i32>,
    /// `[L, R]`: number of tokens source `s` sent to local expert `l`.
    pub counts: Vec<i32>,
    /// `[L]`: total tokens per local expert.
    pub recv_count: Vec<i32>,
}

impl RecvLayout {
    /// Builds the packed layout from the `[L, R]` counts the sources signalled.
    pub fn from_counts(counts: Vec<i32>, num_ranks: usize) -> Self {
        let num_local = counts.len() / num_ranks.max(1);
        let mut offsets = vec![0i32; counts.len()];
        let mut recv_count = vec![0i32; num_local];
        for l in 0..num_local {
            let mut acc = 0;
            for s in 0..num_ranks {
                offsets[l * num_ranks + s] = acc;
                acc += counts[l * num_ranks + s];
            }
            recv_count[l] = acc;
        }
        Self {
            num_ranks,
            offsets,
            counts,
            recv_count,
        }
    }

    /// The packed row of slot `slot` of source `src` for local expert `l`.
    pub fn packed_row(&self, l: usize, src: usize, slot: usize) -> usize {
        self.offsets[l * self.num_ranks + src] as usize + slot
    }
}

/// Weighted low-latency combine on the home rank:
/// `out[t] = bf16(sum over k with topk_idx[t, k] >= 0 and rank(topk_idx[t, k]) active,
/// in k order, of w[t, k] * f32(y(t, k)))` where `y(t, k)` is the expert output row of
/// `(t, k)`, obtained from `row(t, k)`.
#[allow(clippy::too_many_arguments)] // mirrors the kernel's argument list
pub fn combine<'a>(
    topk_idx: &[i64],
    topk_weights: &[f32],
    num_tokens: usize,
    num_topk: usize,
    hidden: usize,
    placement: &ExpertPlacement,
    active_ranks: &[bool],
    mut row: impl FnMut(usize, usize) -> &'a [bf16],
) -> Result<Vec<bf16>> {
    check_combine(
        topk_idx,
        topk_weights,
        num_tokens,
        num_topk,
        placement,
        active_ranks,
    )?;
    let mut out = vec![bf16::ZERO; num_tokens * hidden];
    let mut acc = vec![0f32; hidden];
    for t in 0..num_tokens {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for k in 0..num_topk {
            let e = topk_idx[t * num_topk + k];
            if e < 0 || !active_ranks[placement.rank_of(e as usize)] {
                continue;
            }
            let w = topk_weights[t * num_topk + k];
            for (a, v) in acc.iter_mut().zip(row(t, k)) {
                *a += w * v.to_f32();
            }
        }
        for (o, a) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    Ok(out)
}

/// The lengths the combine twins read.
fn check_combine(
    topk_idx: &[i64],
    topk_weights: &[f32],
    num_tokens: usize,
    num_topk: usize,
    placement: &ExpertPlacement,
    active_ranks: &[bool],
) -> Result<()> {
    Error::check_len("topk_idx", num_tokens * num_topk, topk_idx.len())?;
    Error::check_len("topk_weights", num_tokens * num_topk, topk_weights.len())?;
    Error::check_len("active_ranks", placement.num_ranks, active_ranks.len())
}

/// How a low-latency combine reduces the expert outputs of a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// DeepEP's: every (token, expert) output row goes back to the token's home rank, which
    /// sums `w * y` over the token's experts in k order in f32 and rounds once ([`combine`]).
    #[default]
    PerExpert,
    /// Each expert rank sums `w * y` over its experts that the token chose (k order, f32),
    /// rounds the partial sum to the output dtype and sends one row per (token, rank); the
    /// home adds the partial rows in the order of the token's ranks ([`combine_per_rank`]).
    /// Fewer bytes back (one row per rank instead of one per expert); one more rounding per
    /// rank (bf16: at most `2^-8` of each partial's magnitude). Needs the top-k weights at
    /// the dispatch. At one rank the same bits as `PerExpert`.
    PerRank,
}

/// The ranks of one token's experts in the order of their first appearance in `topk_row`
/// (`-1` entries skipped): partial row `j` of a per-rank combine comes from rank `ranks[j]`.
pub fn rank_order(topk_row: &[i64], placement: &ExpertPlacement) -> Vec<usize> {
    let mut ranks = Vec::with_capacity(topk_row.len());
    for &e in topk_row {
        if e >= 0 {
            let r = placement.rank_of(e as usize);
            if !ranks.contains(&r) {
                ranks.push(r);
            }
        }
    }
    ranks
}

/// One rank's partial sum of token `t` for a per-rank combine: `sum over k in order with
/// rank(topk_idx[t, k]) == rank of w[t, k] * f32(y(t, k))` in f32 (separate multiply and add),
/// rounded to bf16.
pub fn partial_row<'a>(
    topk_row: &[i64],
    weights_row: &[f32],
    hidden: usize,
    placement: &ExpertPlacement,
    rank: usize,
    mut row: impl FnMut(usize) -> &'a [bf16],
) -> Vec<bf16> {
    let mut acc = vec![0f32; hidden];
    for (k, (&e, &w)) in topk_row.iter().zip(weights_row).enumerate() {
        if e < 0 || placement.rank_of(e as usize) != rank {
            continue;
        }
        for (a, v) in acc.iter_mut().zip(row(k)) {
            *a += w * v.to_f32();
        }
    }
    acc.into_iter().map(bf16::from_f32).collect()
}

/// Per-rank low-latency combine on the home rank ([`Reduction::PerRank`]): for each token, the
/// partial row of each of its ranks ([`rank_order`]; [`partial_row`] on that rank) is added in
/// that order in f32 and the sum rounded to bf16; inactive ranks contribute nothing.
/// `row(t, k)` is the expert output row of `(t, k)`.
#[allow(clippy::too_many_arguments)] // mirrors `combine`
pub fn combine_per_rank<'a>(
    topk_idx: &[i64],
    topk_weights: &[f32],
    num_tokens: usize,
    num_topk: usize,
    hidden: usize,
    placement: &ExpertPlacement,
    active_ranks: &[bool],
    mut row: impl FnMut(usize, usize) -> &'a [bf16],
) -> Result<Vec<bf16>> {
    check_combine(
        topk_idx,
        topk_weights,
        num_tokens,
        num_topk,
        placement,
        active_ranks,
    )?;
    let mut out = vec![bf16::ZERO; num_tokens * hidden];
    let mut acc = vec![0f32; hidden];
    for t in 0..num_tokens {
        let ids = &topk_idx[t * num_topk..(t + 1) * num_topk];
        let ws = &topk_weights[t * num_topk..(t + 1) * num_topk];
        acc.iter_mut().for_each(|a| *a = 0.0);
        for r in rank_order(ids, placement) {
            if !active_ranks[r] {
                continue;
            }
            let partial = partial_row(ids, ws, hidden, placement, r, |k| row(t, k));
            for (a, v) in acc.iter_mut().zip(&partial) {
                *a += v.to_f32();
            }
        }
        for (o, a) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_per_expert_in_token_order() {
        let p = ExpertPlacement::new(4, 2, 2).unwrap();
        let topk = [0, 3, -1, 3, 0, 1];
        let (slots, counts) = send_slots(&topk, 3, 2, &p).unwrap();
        assert_eq!(slots, vec![0, 0, -1, 1, 1, 0]);
        assert_eq!(counts, vec![2, 1, 0, 2]);
    }

    #[test]
    fn rank_order_is_first_appearance() {
        let p = ExpertPlacement::new(8, 4, 2).unwrap();
        assert_eq!(rank_order(&[5, 0, -1, 4, 1, 7, 2], &p), vec![2, 0, 3, 1]);
        assert!(rank_order(&[-1, -1], &p).is_empty());
    }

    /// Per rank: the partials round once per rank; at one rank the bits equal `combine`'s.
    #[test]
    fn per_rank_combine_sums_partials() {
        let rows: Vec<Vec<bf16>> = [1.0f32, 2.0, 3.0, 1.0 / 3.0]
            .iter()
            .map(|&v| vec![bf16::from_f32(v), bf16::from_f32(-v)])
            .collect();
        let topk = [0i64, 3, 1, 2];
        let w = [0.5f32, 0.25, 1.0, 0.1];
        let two = ExpertPlacement::new(4, 2, 2).unwrap();
        let got =
            combine_per_rank(&topk, &w, 1, 4, 2, &two, &[true, true], |_, k| &rows[k]).unwrap();
        // Rank 0 (k = 0, 2): 0.5 * 1 + 1.0 * 3 = 3.5, exact; rank 1 (k = 1, 3):
        // bf16(0.25 * 2 + 0.1 * bf16(1/3)).
        let third = bf16::from_f32(1.0 / 3.0).to_f32();
        let p1 = bf16::from_f32(0.25 * 2.0 + 0.1 * third).to_f32();
        assert_eq!(got[0], bf16::from_f32(3.5 + p1));
        assert_eq!(got[1], bf16::from_f32(-3.5 - p1));
        let masked =
            combine_per_rank(&topk, &w, 1, 4, 2, &two, &[true, false], |_, k| &rows[k]).unwrap();
        assert_eq!(masked[0], bf16::from_f32(3.5));
        let one = ExpertPlacement::new(4, 1, 1).unwrap();
        let a = combine_per_rank(&topk, &w, 1, 4, 2, &one, &[true], |_, k| &rows[k]).unwrap();
        let b = combine(&topk, &w, 1, 4, 2, &one, &[true], |_, k| &rows[k]).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn packed_layout_is_source_major() {
        let l = RecvLayout::from_counts(vec![2, 0, 3, /* l1 */ 1, 1, 0], 3);
        assert_eq!(l.offsets, vec![0, 2, 2, 0, 1, 2]);
        assert_eq!(l.recv_count, vec![5, 2]);
        assert_eq!(l.packed_row(0, 2, 1), 3);
    }
}
