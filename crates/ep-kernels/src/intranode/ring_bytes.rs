//! Bytes of the SM-ring path's NVLink buffer (host-side geometry of the layout in
//! `intranode.cuh`): a header, then one dispatch or combine ring per (channel, peer).
//! What `buffer_size_hint` (feature `cuda`) sizes buffers by, and what a runtime plans with
//! before it allocates anything.

use crate::FP8_GROUP;

/// Offset of the first ring in an NVLink buffer (`kRingBase`): the header before it holds the
/// barrier signals, channel counters and notify counts.
pub const RING_BASE: usize = 65536;

fn align16(v: usize) -> usize {
    v.div_ceil(16) * 16
}

/// Bytes of one dispatch ring of `q` token slots (rows of `row_bytes`, `topk` experts, `scales`
/// f32 scales per row; mirrors `RingLayout::dispatch`).
pub(crate) fn dispatch_ring_bytes(q: usize, row_bytes: usize, topk: usize, scales: usize) -> usize {
    align16(q * row_bytes) + align16(q * 4) + 2 * align16(q * topk * 4) + align16(q * scales * 4)
}

/// Bytes of one combine ring of `q` token slots (mirrors `RingLayout::combine`).
pub(crate) fn combine_ring_bytes(q: usize, row_bytes: usize, topk: usize) -> usize {
    align16(q * row_bytes) + align16(q * topk * 4)
}

/// NVLink buffer bytes each rank needs for bf16 or fp8 dispatch and bf16 combine of rows of
/// `hidden` channels with `num_topk` experts per token among `num_ranks` ranks, over
/// `num_channels` channels of rings of `ring_tokens` token slots.
pub fn rings_buffer_bytes(
    hidden: usize,
    num_topk: usize,
    num_ranks: usize,
    num_channels: usize,
    ring_tokens: usize,
) -> usize {
    let q = ring_tokens;
    let bf16 = dispatch_ring_bytes(q, hidden * 2, num_topk, 0);
    let fp8 = dispatch_ring_bytes(q, hidden, num_topk, hidden.div_ceil(FP8_GROUP));
    let comb = combine_ring_bytes(q, hidden * 2, num_topk);
    RING_BASE + num_channels * num_ranks * bf16.max(fp8).max(comb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_ring_sizes_every_channel_and_peer() {
        // bf16 rows of 7168 channels, top-8: the bf16 dispatch ring is the largest.
        let ring = dispatch_ring_bytes(256, 2 * 7168, 8, 0);
        assert_eq!(ring, 256 * 14336 + 1024 + 2 * 8192);
        assert_eq!(
            rings_buffer_bytes(7168, 8, 4, 12, 256),
            RING_BASE + 48 * ring
        );
    }
}
