//! Host twins of the internode normal mode's plan: where a token goes on its way across
//! nodes, and the row it lands in. The receive order and the values are the intranode
//! mode's ([`crate::intranode::notify`], [`crate::intranode::send_slots`]); these functions
//! fix the two-level route that must reproduce them.
//!
//! Rank `r` is `(node r / P, local r % P)`. Home rank `s` sends each token once per
//! destination node `n`, as message `k` = [`node_send_index`]`[t, n]` of its block on the
//! *forwarder* `(n, s % P)`. Receiver `d` on node `n` reads, from each forwarder `(n, j)` of
//! its node, the blocks of the homes `(m, j)` of every node `m`, and gives the messages that
//! have one of its experts the rows [`plan_block`] says.

use crate::error::{Error, Result};
use crate::layout::ExpertPlacement;

/// `[T, N]`: token `t`'s index among this rank's tokens bound for node `n` (a token is bound
/// for a node when any of its ranks is there), `-1` where it is not.
pub fn node_send_index(
    is_token_in_rank: &[bool],
    num_tokens: usize,
    placement: &ExpertPlacement,
) -> Result<Vec<i32>> {
    let (r, p, n) = (
        placement.num_ranks,
        placement.gpus_per_node,
        placement.num_nodes(),
    );
    Error::check_len("is_token_in_rank", num_tokens * r, is_token_in_rank.len())?;
    let mut next = vec![0i32; n];
    let mut out = vec![-1i32; num_tokens * n];
    for t in 0..num_tokens {
        for node in 0..n {
            let row = &is_token_in_rank[t * r + node * p..t * r + (node + 1) * p];
            if row.iter().any(|&b| b) {
                out[t * n + node] = next[node];
                next[node] += 1;
            }
        }
    }
    Ok(out)
}

/// The header mask of token `t`'s message for node `node`: bit `j` when local GPU `j` of
/// that node is among the token's ranks (the forwarder keeps it to sum the node's rows in
/// combine).
pub fn node_mask(
    is_token_in_rank: &[bool],
    num_ranks: usize,
    t: usize,
    node: usize,
    gpus_per_node: usize,
) -> u8 {
    let row = &is_token_in_rank
        [t * num_ranks + node * gpus_per_node..t * num_ranks + (node + 1) * gpus_per_node];
    row.iter()
        .enumerate()
        .fold(0u8, |m, (j, &b)| if b { m | 1 << j } else { m })
}

/// The plan of one block on receiver `dst_local` (its local index): for each message of a
/// home's block for the receiver's node (the home's tokens bound for that node, in token
/// order, given by their header masks), the row it takes in the receiver's `recv_x` (`-1`:
/// not the receiver's), counting from `first_row` (the rows of the sources before the home).
pub fn plan_block(masks: &[u8], dst_local: usize, first_row: i32) -> Vec<i32> {
    let mut next = first_row;
    masks
        .iter()
        .map(|&m| {
            if m >> dst_local & 1 == 1 {
                next += 1;
                next - 1
            } else {
                -1
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intranode::{notify, send_slots};
    use crate::layout::get_dispatch_layout;

    /// A deterministic pseudo-random routing (`-1` sometimes) of `t` tokens.
    fn routing(seed: u64, t: usize, k: usize, e: usize) -> Vec<i64> {
        let mut s = seed;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as usize
        };
        let mut out = Vec::with_capacity(t * k);
        for _ in 0..t {
            let mut row: Vec<i64> = Vec::new();
            while row.len() < k {
                let v = if next() % 7 == 0 {
                    -1
                } else {
                    (next() % e) as i64
                };
                if v < 0 || !row.contains(&v) {
                    row.push(v);
                }
            }
            out.extend(row);
        }
        out
    }

    /// The two-level route (home -> forwarder block -> receiver plan) gives every (token,
    /// receiver) pair exactly the row the intranode order gives it, for 2 x 2, 2 x 1, 3 x 2 and
    /// 2 x 4 ranks, empty ranks included.
    #[test]
    fn two_level_route_reproduces_the_receive_order() {
        for (nodes, p, seed) in [(2, 2, 1u64), (2, 1, 2), (3, 2, 3), (2, 4, 4), (2, 2, 5)] {
            let r = nodes * p;
            let (e, k) = (4 * r, 3);
            let placement = ExpertPlacement::new(e, r, p).unwrap();
            let tokens: Vec<usize> = (0..r).map(|s| if s == 1 { 0 } else { 3 + 5 * s }).collect();
            let idx: Vec<Vec<i64>> = (0..r)
                .map(|s| routing(seed * 31 + s as u64, tokens[s], k, e))
                .collect();
            let layouts: Vec<_> = (0..r)
                .map(|s| get_dispatch_layout(&idx[s], tokens[s], k, &placement).unwrap())
                .collect();
            let per_rank: Vec<i32> = layouts
                .iter()
                .flat_map(|l| l.num_tokens_per_rank.clone())
                .collect();
            let per_expert: Vec<i32> = layouts
                .iter()
                .flat_map(|l| l.num_tokens_per_expert.clone())
                .collect();
            let rpm = notify(0, &per_rank, &per_expert, &placement, 1)
                .unwrap()
                .rank_prefix_matrix;
            for dst in 0..r {
                // What the intranode order gives: (source, token) -> row.
                let mut want = Vec::new();
                for (s, lay) in layouts.iter().enumerate() {
                    let slots = send_slots(s, &lay.is_token_in_rank, tokens[s], &rpm, r).unwrap();
                    for t in 0..tokens[s] {
                        if slots[t * r + dst] >= 0 {
                            want.push((s, t, slots[t * r + dst]));
                        }
                    }
                }
                // The two-level route: every block of dst's node's forwarders.
                let mut got = Vec::new();
                for j in 0..p {
                    for m in 0..nodes {
                        let s = m * p + j;
                        let nsi =
                            node_send_index(&layouts[s].is_token_in_rank, tokens[s], &placement)
                                .unwrap();
                        let block: Vec<usize> = (0..tokens[s])
                            .filter(|&t| nsi[t * nodes + dst / p] >= 0)
                            .collect();
                        let masks: Vec<u8> = block
                            .iter()
                            .map(|&t| node_mask(&layouts[s].is_token_in_rank, r, t, dst / p, p))
                            .collect();
                        let first = if s == 0 { 0 } else { rpm[(s - 1) * r + dst] };
                        let rows = plan_block(&masks, dst % p, first);
                        for (i, &t) in block.iter().enumerate() {
                            assert_ne!(masks[i], 0, "a block token holds a GPU of the node");
                            if rows[i] >= 0 {
                                got.push((s, t, rows[i]));
                            }
                        }
                    }
                }
                got.sort();
                want.sort();
                assert_eq!(got, want, "{nodes} x {p}, receiver {dst}");
            }
        }
    }

    #[test]
    fn node_send_index_counts_each_node_once() {
        let placement = ExpertPlacement::new(8, 4, 2).unwrap();
        // Token 0: ranks 0 and 1 (node 0 only); token 1: ranks 1 and 2; token 2: none.
        let itir = [
            true, true, false, false, false, true, true, false, false, false, false, false,
        ];
        let nsi = node_send_index(&itir, 3, &placement).unwrap();
        assert_eq!(nsi, vec![0, -1, 1, 0, -1, -1]);
        assert!(node_send_index(&itir[..4], 3, &placement).is_err());
    }
}
