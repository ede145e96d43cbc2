//! Host-side geometry of the copy-engine path (launchers: `cuda/copy_engine/`, CUDA only): how
//! a block of rows is cut into chunks, where a slot's arrays lie in an NVLink buffer, and how
//! large the buffers must be. Shared by the launchers and the runtime's sizing, and tested without a GPU.

use crate::FP8_GROUP;

/// Where the slots start in an NVLink buffer (the intranode kernels' `kRingBase`).
pub const CE_SLOT_BASE: usize = 65536;

/// Most chunks per (source, destination) block (`kCeMaxChunks`).
pub const CE_MAX_CHUNKS: usize = 32;

/// The chunks of a block of `m` rows, as `(begin, end)` row ranges (mirrors `ce_chunk` in
/// `copy_engine.cuh`: sizes `first, 2 first, ...` up to `cap = max(max_rows, ceil(m / 16))`, with
/// `first` raised to `cap / 256`).
pub fn chunk_bounds(m: usize, first_rows: usize, max_rows: usize) -> Vec<(usize, usize)> {
    let cap = max_rows.max(m.div_ceil(16));
    let mut size = first_rows.max(cap / 256).min(cap);
    let mut begin = 0;
    let mut out = Vec::new();
    while begin < m {
        out.push((begin, (begin + size).min(m)));
        begin += size;
        size = (2 * size).min(cap);
    }
    out
}

/// Whether the copy engines serve `peer` when `copy_engine_peers` of the `num_ranks - 1` peers
/// of `rank` go through them (SM warps serve the others). Peers are taken by their distance
/// `(peer - rank) mod num_ranks` in the order `R/2, R/2 - 1, R/2 + 1, R/2 - 2, ...`, so that with
/// one copy-engine peer every GPU's copy engines serve exactly one peer and are served by one
/// (rank `i` and `i + R/2` pair up), in either direction of the transfer.
pub fn copy_engine_peer(
    rank: usize,
    peer: usize,
    num_ranks: usize,
    copy_engine_peers: usize,
) -> bool {
    if peer == rank || num_ranks < 2 || peer >= num_ranks {
        return false;
    }
    let dist = (peer + num_ranks - rank) % num_ranks;
    let half = num_ranks / 2;
    // Position of `dist` among the distances 1..R in the order half, half - 1, half + 1, ...
    let order = (0..2 * num_ranks).filter_map(|i| {
        let d = if i % 2 == 0 {
            half.checked_add(i / 2)
        } else {
            half.checked_sub(i / 2 + 1)
        }?;
        (1..num_ranks).contains(&d).then_some(d)
    });
    let pos = order.take_while(|&d| d != dist).count();
    pos < copy_engine_peers
}

fn align16(v: usize) -> usize {
    v.div_ceil(16) * 16
}

/// Where the arrays of one slot lie (bytes from the slot start) and how many rows a slot
/// holds, for one op. Every rank computes the same layout from the same op parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CeSlotLayout {
    /// Bytes of one slot (slot `d` starts at `CE_SLOT_BASE + d * slot_bytes`).
    pub slot_bytes: usize,
    /// Rows a slot holds (the most tokens one rank may send, or return to one home).
    pub capacity: usize,
    /// Offset of the per-row f32 scales (dispatch, fp8).
    pub off_scales: usize,
    /// Offset of the per-row i32 source indices (dispatch).
    pub off_src: usize,
    /// Offset of the per-row i64 local expert ids (dispatch).
    pub off_topk_idx: usize,
    /// Offset of the per-row f32 weights (dispatch and combine).
    pub off_topk_weights: usize,
}

impl CeSlotLayout {
    fn new(
        bytes: usize,
        num_ranks: usize,
        row_bytes: usize,
        scales: usize,
        topk: usize,
        src: bool,
    ) -> Self {
        let slot_bytes = (bytes.saturating_sub(CE_SLOT_BASE) / num_ranks.max(1)) / 16 * 16;
        let per_row = row_bytes + 4 * scales + if src { 4 } else { 0 } + 12 * topk;
        let capacity = slot_bytes.saturating_sub(80) / per_row.max(1);
        let off_scales = align16(capacity * row_bytes);
        let off_src = off_scales + align16(capacity * scales * 4);
        let off_topk_idx = off_src + if src { align16(capacity * 4) } else { 0 };
        let off_topk_weights = off_topk_idx + align16(capacity * topk * 8);
        Self {
            slot_bytes,
            capacity,
            off_scales,
            off_src,
            off_topk_idx,
            off_topk_weights,
        }
    }

    /// The layout of a dispatch of rows of `row_bytes` bytes with `scales` f32 scales and
    /// `topk` experts per token in buffers of `bytes` bytes among `num_ranks` ranks.
    pub fn dispatch(
        bytes: usize,
        num_ranks: usize,
        row_bytes: usize,
        scales: usize,
        topk: usize,
    ) -> Self {
        Self::new(bytes, num_ranks, row_bytes, scales, topk, true)
    }

    /// The layout of a combine of bf16 rows of `hidden` channels with `topk` weights per row.
    /// (The weights sit at `off_topk_weights`; the dispatch-only arrays are empty.)
    pub fn combine(bytes: usize, num_ranks: usize, hidden: usize, topk: usize) -> Self {
        // Weights only: reuse the i64 id space as nothing (topk ids are not returned).
        let mut l = Self::new(bytes, num_ranks, 2 * hidden, 0, 0, false);
        let per_row = 2 * hidden + 4 * topk;
        l.capacity = l.slot_bytes.saturating_sub(80) / per_row.max(1);
        l.off_scales = align16(l.capacity * 2 * hidden);
        l.off_src = l.off_scales;
        l.off_topk_idx = l.off_scales;
        l.off_topk_weights = l.off_scales;
        l
    }
}

/// NVLink buffer bytes each rank needs for the copy-engine path with up to `max_tokens`
/// tokens per rank, rows of `hidden` bf16 channels (bf16 or fp8 dispatch, bf16 combine) and
/// `num_topk` experts per token among `num_ranks` ranks.
pub fn ce_buffer_size_hint(
    max_tokens: usize,
    hidden: usize,
    num_topk: usize,
    num_ranks: usize,
) -> usize {
    let per_row = 2 * hidden + 4 + 12 * num_topk + 4 * hidden.div_ceil(FP8_GROUP);
    CE_SLOT_BASE + num_ranks * (max_tokens * per_row + 96).div_ceil(16) * 16
}

#[cfg(test)]
mod tests {
    #[test]
    fn copy_engine_peers_pair_up_and_fill_in_order() {
        for r in 2..=8 {
            for n in 0..r {
                for me in 0..r {
                    let served: Vec<usize> =
                        (0..r).filter(|&p| copy_engine_peer(me, p, r, n)).collect();
                    assert_eq!(served.len(), n.min(r - 1), "r {r} n {n} me {me}");
                    assert!(!copy_engine_peer(me, me, r, n));
                }
            }
            // One copy-engine peer: the pairing is symmetric.
            for me in 0..r {
                let p = (0..r).find(|&p| copy_engine_peer(me, p, r, 1)).unwrap();
                if r % 2 == 0 {
                    assert!(
                        copy_engine_peer(p, me, r, 1),
                        "r {r}: {me} -> {p} not mutual"
                    );
                }
            }
        }
        assert!(copy_engine_peer(0, 2, 4, 1) && copy_engine_peer(3, 1, 4, 1));
        assert!(copy_engine_peer(0, 1, 2, 1));
    }

    use super::*;

    #[test]
    fn chunks_cover_the_block() {
        for m in [
            0usize, 1, 255, 256, 257, 1000, 3700, 4096, 100_000, 3_000_000,
        ] {
            let c = chunk_bounds(m, 256, 1024);
            assert!(c.len() <= CE_MAX_CHUNKS, "m = {m}: {} chunks", c.len());
            let mut next = 0;
            for (b, e) in c {
                assert_eq!(b, next);
                assert!(e > b);
                next = e;
            }
            assert_eq!(next, m);
        }
        assert_eq!(
            chunk_bounds(3700, 256, 1024)[..3],
            [(0, 256), (256, 768), (768, 1792)]
        );
    }

    #[test]
    fn size_hint_fits_its_tokens() {
        for (t, h, k, r) in [(4096, 7168, 8, 4), (4096, 7168, 16, 8), (37, 128, 3, 2)] {
            let bytes = ce_buffer_size_hint(t, h, k, r);
            assert!(CeSlotLayout::dispatch(bytes, r, 2 * h, 0, k).capacity >= t);
            assert!(CeSlotLayout::dispatch(bytes, r, h, h / 128, k).capacity >= t);
            assert!(CeSlotLayout::combine(bytes, r, h, k).capacity >= t);
        }
    }

    #[test]
    fn slot_layouts_fit() {
        let bytes = 300 << 20;
        for l in [
            CeSlotLayout::dispatch(bytes, 4, 14336, 0, 8),
            CeSlotLayout::dispatch(bytes, 4, 7168, 56, 8),
            CeSlotLayout::combine(bytes, 4, 7168, 8),
        ] {
            assert!(l.capacity >= 4096, "{l:?}");
            assert!(
                l.off_topk_weights + l.capacity * 8 * 4 <= l.slot_bytes,
                "{l:?}"
            );
        }
    }
}
