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
    Error::check_len("topk_idx", num_tokens * num_topk, topk_idx.len())?;
    Error::check_len("topk_weights", num_tokens * num_topk, topk_weights.len())?;
    Error::check_len("active_ranks", placement.num_ranks, active_ranks.len())?;
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
    fn packed_layout_is_source_major() {
        let l = RecvLayout::from_counts(vec![2, 0, 3, /* l1 */ 1, 1, 0], 3);
        assert_eq!(l.offsets, vec![0, 2, 2, 0, 1, 2]);
        assert_eq!(l.recv_count, vec![5, 2]);
        assert_eq!(l.packed_row(0, 2, 1), 3);
    }
}
