//! Host twins of the normal-mode kernels.

use crate::error::{Error, Result};
use crate::layout::ExpertPlacement;
use half::bf16;
use std::ops::Range;

/// The token range of `channel` when `num_tokens` tokens are split into `num_channels`
/// contiguous channels of `ceil(T / C)` tokens (the last ones may be short or empty).
pub fn channel_range(num_tokens: usize, num_channels: usize, channel: usize) -> Range<usize> {
    let per = num_tokens.div_ceil(num_channels.max(1));
    let start = (per * channel).min(num_tokens);
    let end = (per * (channel + 1)).min(num_tokens);
    start..end
}

/// Sender-side `[R, C]` matrix: for destination `d` and channel `c`, the number of tokens
/// sent to `d` from channels `0..=c` (inclusive prefix).
pub fn channel_prefix_matrix(
    is_token_in_rank: &[bool],
    num_tokens: usize,
    num_ranks: usize,
    num_channels: usize,
) -> Result<Vec<i32>> {
    Error::check_len(
        "is_token_in_rank",
        num_tokens * num_ranks,
        is_token_in_rank.len(),
    )?;
    if num_channels == 0 {
        return Err(Error::invalid("num_channels", 0, "must be at least 1"));
    }
    let mut m = vec![0i32; num_ranks * num_channels];
    for d in 0..num_ranks {
        let mut acc = 0;
        for c in 0..num_channels {
            for t in channel_range(num_tokens, num_channels, c) {
                acc += is_token_in_rank[t * num_ranks + d] as i32;
            }
            m[d * num_channels + c] = acc;
        }
    }
    Ok(m)
}

/// What the notify step gives a receiving rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotifyOutput {
    /// `[R, R]`: entry `(i, j)` = tokens sent to rank `j` by ranks `0..=i` (inclusive prefix
    /// over sources). Source `i`'s block on rank `j` starts at entry `(i - 1, j)`.
    pub rank_prefix_matrix: Vec<i32>,
    /// Tokens this rank receives in total (`rank_prefix_matrix[(R - 1, rank)]`).
    pub num_recv_tokens: usize,
    /// `[L]`: (token, expert) pairs this rank's local experts receive, each rounded up to a
    /// multiple of `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<i32>,
}

/// The notify step, given every rank's layout counts.
///
/// `num_tokens_per_rank_all: [R, R]` (row = source rank) and
/// `num_tokens_per_expert_all: [R, E]` (row = source rank).
pub fn notify(
    rank: usize,
    num_tokens_per_rank_all: &[i32],
    num_tokens_per_expert_all: &[i32],
    placement: &ExpertPlacement,
    expert_alignment: usize,
) -> Result<NotifyOutput> {
    let r = placement.num_ranks;
    let e = placement.num_experts;
    let l = placement.experts_per_rank();
    Error::check_len(
        "num_tokens_per_rank_all",
        r * r,
        num_tokens_per_rank_all.len(),
    )?;
    Error::check_len(
        "num_tokens_per_expert_all",
        r * e,
        num_tokens_per_expert_all.len(),
    )?;
    if rank >= r {
        return Err(Error::invalid(
            "rank",
            rank,
            format!("must be < num_ranks = {r}"),
        ));
    }
    if expert_alignment == 0 {
        return Err(Error::invalid("expert_alignment", 0, "must be at least 1"));
    }
    let mut prefix = vec![0i32; r * r];
    for j in 0..r {
        let mut acc = 0;
        for i in 0..r {
            acc += num_tokens_per_rank_all[i * r + j];
            prefix[i * r + j] = acc;
        }
    }
    let per_expert = (0..l)
        .map(|le| {
            let n: i32 = (0..r)
                .map(|src| num_tokens_per_expert_all[src * e + rank * l + le])
                .sum();
            (n as usize).div_ceil(expert_alignment) as i32 * expert_alignment as i32
        })
        .collect();
    Ok(NotifyOutput {
        num_recv_tokens: prefix[(r - 1) * r + rank] as usize,
        rank_prefix_matrix: prefix,
        num_recv_tokens_per_expert: per_expert,
    })
}

/// Where in rank `d`'s receive buffer each of source `src`'s tokens lands: `[T, R]`, `-1`
/// where the token does not go to `d`. Receive order is by source rank, then token order.
pub fn send_slots(
    src: usize,
    is_token_in_rank: &[bool],
    num_tokens: usize,
    rank_prefix_matrix: &[i32],
    num_ranks: usize,
) -> Result<Vec<i32>> {
    Error::check_len(
        "is_token_in_rank",
        num_tokens * num_ranks,
        is_token_in_rank.len(),
    )?;
    Error::check_len(
        "rank_prefix_matrix",
        num_ranks * num_ranks,
        rank_prefix_matrix.len(),
    )?;
    let mut next: Vec<i32> = (0..num_ranks)
        .map(|d| {
            if src == 0 {
                0
            } else {
                rank_prefix_matrix[(src - 1) * num_ranks + d]
            }
        })
        .collect();
    let mut slots = vec![-1i32; num_tokens * num_ranks];
    for t in 0..num_tokens {
        for d in 0..num_ranks {
            if is_token_in_rank[t * num_ranks + d] {
                slots[t * num_ranks + d] = next[d];
                next[d] += 1;
            }
        }
    }
    Ok(slots)
}

/// Rewrites one token's global expert ids for receiver `dst`: local ids `[0, L)` for experts
/// on `dst`, `-1` elsewhere; weights are zeroed where the id is `-1`.
pub fn localize_topk(
    topk_idx: &[i64],
    topk_weights: &[f32],
    dst: usize,
    placement: &ExpertPlacement,
    out_idx: &mut [i64],
    out_weights: &mut [f32],
) {
    let l = placement.experts_per_rank() as i64;
    let lo = dst as i64 * l;
    for k in 0..topk_idx.len() {
        let e = topk_idx[k];
        if e >= lo && e < lo + l {
            out_idx[k] = e - lo;
            out_weights[k] = topk_weights[k];
        } else {
            out_idx[k] = -1;
            out_weights[k] = 0.0;
        }
    }
}

/// The combine reduction for one token: the f32 sum, in rank order, of the rows the ranks
/// holding it return, rounded to bf16. `rows` yields those rows in rank order.
pub fn combine_token<'a>(
    bias: Option<&[bf16]>,
    rows: impl Iterator<Item = &'a [bf16]>,
    out: &mut [bf16],
    acc: &mut [f32],
) {
    match bias {
        Some(b) => acc.iter_mut().zip(b).for_each(|(a, v)| *a = v.to_f32()),
        None => acc.iter_mut().for_each(|a| *a = 0.0),
    }
    for row in rows {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += v.to_f32();
        }
    }
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = bf16::from_f32(*a);
    }
}

/// The combine of a whole rank: `out[t] = bf16(f32(bias[t]) + sum over ranks r with a slot,
/// in rank order, of f32(x_r[slot[t, r]]))` (no bias: the sum from zero), where `x_r` is rank
/// `r`'s combine input `[N_r, H]`, `slots` is this rank's [`send_slots`] output and `bias` is
/// `[num_tokens, H]`.
pub fn combine(
    slots: &[i32],
    num_tokens: usize,
    hidden: usize,
    x_per_rank: &[&[bf16]],
    bias: Option<&[bf16]>,
) -> Result<Vec<bf16>> {
    let r = x_per_rank.len();
    Error::check_len("slots", num_tokens * r, slots.len())?;
    if let Some(b) = bias {
        Error::check_len("bias", num_tokens * hidden, b.len())?;
    }
    let mut out = vec![bf16::ZERO; num_tokens * hidden];
    let mut acc = vec![0f32; hidden];
    for t in 0..num_tokens {
        let rows = (0..r).filter_map(|d| {
            let s = slots[t * r + d];
            (s >= 0).then(|| &x_per_rank[d][s as usize * hidden..(s as usize + 1) * hidden])
        });
        let b = bias.map(|b| &b[t * hidden..(t + 1) * hidden]);
        combine_token(b, rows, &mut out[t * hidden..(t + 1) * hidden], &mut acc);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_cover_tokens_once() {
        for t in [0, 1, 5, 64, 100] {
            for c in [1, 3, 8] {
                let all: Vec<usize> = (0..c).flat_map(|i| channel_range(t, c, i)).collect();
                assert_eq!(all, (0..t).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn notify_prefix_and_alignment() {
        let p = ExpertPlacement::new(4, 2, 2).unwrap();
        // source 0 sends 3 to rank 0 and 1 to rank 1; source 1 sends 2 and 5.
        let per_rank = [3, 1, 2, 5];
        // experts per source: e0..e3
        let per_expert = [2, 1, 1, 0, /* src1 */ 1, 2, 3, 4];
        let n = notify(1, &per_rank, &per_expert, &p, 4).unwrap();
        assert_eq!(n.rank_prefix_matrix, vec![3, 1, 5, 6]);
        assert_eq!(n.num_recv_tokens, 6);
        // local experts of rank 1 are e2, e3: 1+3 = 4 -> 4, 0+4 = 4 -> 4
        assert_eq!(n.num_recv_tokens_per_expert, vec![4, 4]);
        let n = notify(0, &per_rank, &per_expert, &p, 1).unwrap();
        assert_eq!(n.num_recv_tokens_per_expert, vec![3, 3]);
    }

    #[test]
    fn slots_follow_source_then_token_order() {
        // 2 ranks, source 1 with 3 tokens; source 0 sent 2 tokens to rank 0 and 1 to rank 1.
        let in_rank = [true, false, true, true, false, true];
        let prefix = [2, 1, 4, 3];
        let s = send_slots(1, &in_rank, 3, &prefix, 2).unwrap();
        assert_eq!(s, vec![2, -1, 3, 1, -1, 2]);
    }
}
