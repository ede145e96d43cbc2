//! Host twin of the dispatch-layout kernel.

use crate::error::{Error, Result};

/// How experts are spread over ranks and ranks over nodes.
///
/// Expert `e` lives on rank `e / experts_per_rank` as its local expert `e % experts_per_rank`;
/// rank `r` is on node `r / gpus_per_node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// Number of routed experts `E`.
    pub num_experts: usize,
    /// Number of ranks `R`; must divide `E`.
    pub num_ranks: usize,
    /// Ranks per node `P`; must divide `R`.
    pub gpus_per_node: usize,
}

impl ExpertPlacement {
    /// Checks `E % R == 0` and `R % P == 0`.
    pub fn new(num_experts: usize, num_ranks: usize, gpus_per_node: usize) -> Result<Self> {
        if num_ranks == 0 || num_ranks > crate::MAX_RANKS {
            return Err(Error::invalid(
                "num_ranks",
                num_ranks,
                format!("must be in [1, {}]", crate::MAX_RANKS),
            ));
        }
        if num_experts == 0 || num_experts % num_ranks != 0 {
            return Err(Error::invalid(
                "num_experts",
                num_experts,
                format!("must be a positive multiple of num_ranks = {num_ranks}"),
            ));
        }
        check_gpus_per_node(num_ranks, gpus_per_node)?;
        Ok(Self {
            num_experts,
            num_ranks,
            gpus_per_node,
        })
    }

    /// Local experts per rank, `E / R`.
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// Number of nodes, `R / P`.
    pub fn num_nodes(&self) -> usize {
        self.num_ranks / self.gpus_per_node
    }

    /// The rank holding global expert `expert`.
    pub fn rank_of(&self, expert: usize) -> usize {
        expert / self.experts_per_rank()
    }

    /// Checks that every entry of `topk_idx` is in `[-1, E)`.
    pub fn check_topk_idx(&self, topk_idx: &[i64]) -> Result<()> {
        let e = self.num_experts as i64;
        if let Some((i, &v)) = topk_idx.iter().enumerate().find(|(_, &v)| v < -1 || v >= e) {
            return Err(Error::invalid(
                "topk_idx",
                format!("{v} (at flat index {i})"),
                format!("expert ids must be in [-1, {e})"),
            ));
        }
        Ok(())
    }
}

/// Checks that `gpus_per_node` (ranks per node) is at least 1 and divides `num_ranks`.
pub fn check_gpus_per_node(num_ranks: usize, gpus_per_node: usize) -> Result<()> {
    if gpus_per_node == 0 || num_ranks % gpus_per_node != 0 {
        return Err(Error::invalid(
            "gpus_per_node",
            gpus_per_node,
            format!("must be >= 1 and divide num_ranks = {num_ranks}"),
        ));
    }
    Ok(())
}

/// Token counts per destination, as the layout kernel writes them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DispatchLayout {
    /// `[R]`: tokens sent to each rank (a token counts once per rank).
    pub num_tokens_per_rank: Vec<i32>,
    /// `[R / P]`: tokens sent to each node (a token counts once per node).
    pub num_tokens_per_node: Vec<i32>,
    /// `[E]`: (token, expert) pairs per expert.
    pub num_tokens_per_expert: Vec<i32>,
    /// `[T, R]` row-major: whether token `t` goes to rank `r`.
    pub is_token_in_rank: Vec<bool>,
}

/// Computes the dispatch layout of `topk_idx` (`[num_tokens, num_topk]`, row-major, `-1` = no
/// expert).
pub fn get_dispatch_layout(
    topk_idx: &[i64],
    num_tokens: usize,
    num_topk: usize,
    placement: &ExpertPlacement,
) -> Result<DispatchLayout> {
    Error::check_len("topk_idx", num_tokens * num_topk, topk_idx.len())?;
    placement.check_topk_idx(topk_idx)?;
    let r = placement.num_ranks;
    let mut out = DispatchLayout {
        num_tokens_per_rank: vec![0; r],
        num_tokens_per_node: vec![0; placement.num_nodes()],
        num_tokens_per_expert: vec![0; placement.num_experts],
        is_token_in_rank: vec![false; num_tokens * r],
    };
    let mut node_seen = vec![false; placement.num_nodes()];
    for t in 0..num_tokens {
        node_seen.iter_mut().for_each(|s| *s = false);
        let in_rank = &mut out.is_token_in_rank[t * r..(t + 1) * r];
        for &e in &topk_idx[t * num_topk..(t + 1) * num_topk] {
            if e < 0 {
                continue;
            }
            let e = e as usize;
            out.num_tokens_per_expert[e] += 1;
            let dst = placement.rank_of(e);
            if !in_rank[dst] {
                in_rank[dst] = true;
                out.num_tokens_per_rank[dst] += 1;
            }
            let node = dst / placement.gpus_per_node;
            if !node_seen[node] {
                node_seen[node] = true;
                out.num_tokens_per_node[node] += 1;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_once_per_rank_and_node() {
        // 8 experts on 4 ranks (2 per rank), 2 nodes of 2 ranks.
        let p = ExpertPlacement::new(8, 4, 2).unwrap();
        let topk = [
            0, 1, 2, -1, /* t1 */ 7, 6, -1, -1, /* t2 */ -1, -1, -1, -1,
        ];
        let l = get_dispatch_layout(&topk, 3, 4, &p).unwrap();
        assert_eq!(l.num_tokens_per_rank, vec![1, 1, 0, 1]);
        assert_eq!(l.num_tokens_per_node, vec![1, 1]);
        assert_eq!(l.num_tokens_per_expert, vec![1, 1, 1, 0, 0, 0, 1, 1]);
        assert_eq!(
            l.is_token_in_rank,
            vec![true, true, false, false, false, false, false, true, false, false, false, false]
        );
    }

    #[test]
    fn rejects_out_of_range_experts() {
        let p = ExpertPlacement::new(8, 4, 4).unwrap();
        let e = get_dispatch_layout(&[0, 8], 1, 2, &p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("topk_idx") && e.contains('8') && e.contains("[-1, 8)"),
            "{e}"
        );
        assert!(get_dispatch_layout(&[-2, 0], 1, 2, &p).is_err());
        assert!(ExpertPlacement::new(6, 4, 4).is_err());
        assert!(ExpertPlacement::new(8, 4, 3).is_err());
    }
}
