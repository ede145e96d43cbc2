//! The byte layout of one rank's internode buffer (the same on every rank; see
//! `internode.cuh`), the layout of a dispatch message, and the size checks of an op.
//!
//! ```text
//! sync      u64 [R]             op barrier words
//! counts    i32 [2][R][R + N + 1024 R]  notify rows, by op parity
//! rdma_sig  u64 [N]             block / row arrival per node
//! comb_sig  u64 [P]             combine rows written per local GPU
//! recv      [N][M] slots        dispatch messages per (home node, token); combine rows back
//! stage     [N][M] slots        what this rank puts to other nodes
//! comb_in   [P][N][M] rows      combine rows per (local GPU, home node, token)
//! ```

use crate::error::{Error, Result};
use crate::intranode::MAX_LOCAL_EXPERTS;
use crate::FP8_GROUP;

/// Most GPUs per node (a token's node mask is one byte).
pub const MAX_GPUS_PER_NODE: usize = 8;
/// Most nodes (the receive kernel reads at most 8 x 32 blocks).
pub const MAX_NODES: usize = 32;

fn align(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// Where the parts of one dispatch message lie in a slot (mirror of `InMessage`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageLayout {
    pub(crate) row_bytes: i32,
    pub(crate) num_scales: i32,
    pub(crate) off_scales: i32,
    pub(crate) off_idx: i32,
    pub(crate) off_weights: i32,
    pub(crate) off_src: i32,
    pub(crate) msg_bytes: i32,
    pub(crate) num_topk: i32,
}
const _: () = assert!(std::mem::size_of::<MessageLayout>() == 32);

impl MessageLayout {
    /// A message of `hidden` channels (fp8 with its scales, or bf16) and `num_topk` ids and
    /// weights: `[row | scales | ids | weights | source index]`, each part 16-byte aligned.
    pub fn new(hidden: usize, fp8: bool, num_topk: usize) -> Result<Self> {
        let granule = if fp8 { FP8_GROUP } else { 8 };
        if hidden == 0 || hidden % granule != 0 {
            return Err(Error::invalid(
                "hidden",
                hidden,
                format!("must be a positive multiple of {granule}"),
            ));
        }
        let (row, scales) = if fp8 {
            (hidden, hidden / FP8_GROUP)
        } else {
            (2 * hidden, 0)
        };
        let off_scales = align(row, 16);
        let off_idx = off_scales + align(4 * scales, 16);
        let off_weights = off_idx + align(4 * num_topk, 16);
        let off_src = off_weights + align(4 * num_topk, 16);
        let i = |arg, v: usize| {
            i32::try_from(v).map_err(|_| Error::invalid(arg, v, "must fit in an i32"))
        };
        Ok(Self {
            row_bytes: i("hidden", row)?,
            num_scales: i("hidden", scales)?,
            off_scales: i("hidden", off_scales)?,
            off_idx: i("hidden", off_idx)?,
            off_weights: i("num_topk", off_weights)?,
            off_src: i("num_topk", off_src)?,
            msg_bytes: i("hidden", off_src + 16)?,
            num_topk: i("num_topk", num_topk)?,
        })
    }

    /// Bytes of one message.
    pub fn bytes(&self) -> usize {
        self.msg_bytes as usize
    }
}

/// Bytes of a combine row of `hidden` bf16 channels and `num_topk` weights, and the offset of
/// the weights in it.
pub(crate) fn combine_row(hidden: usize, num_topk: usize) -> (usize, usize) {
    let off_w = align(2 * hidden, 16);
    (off_w + align(4 * num_topk, 16), off_w)
}

/// Byte offsets of one rank's internode buffer (the same on every rank; see
/// `internode.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternodeLayout {
    /// Ranks `R`.
    pub num_ranks: usize,
    /// GPUs per node `P`.
    pub gpus_per_node: usize,
    /// Most tokens a rank dispatches in one op (`M`).
    pub max_tokens: usize,
    /// Largest hidden size of an op.
    pub max_hidden: usize,
    /// Largest top-k of an op.
    pub max_topk: usize,
    pub(crate) slot_bytes: usize,
    pub(crate) comb_bytes: usize,
    pub(crate) count_stride: usize,
    pub(crate) off_sync: usize,
    pub(crate) off_counts: usize,
    pub(crate) off_rdma_sig: usize,
    pub(crate) off_comb_sig: usize,
    pub(crate) off_recv: usize,
    pub(crate) off_stage: usize,
    pub(crate) off_comb_in: usize,
    /// Bytes of the whole buffer.
    pub total_bytes: usize,
}

impl InternodeLayout {
    /// The layout for `num_ranks` ranks in nodes of `gpus_per_node`, ops of at most
    /// `max_tokens` tokens per rank of at most `max_hidden` channels and `max_topk` experts.
    /// Bytes: `(2 N + R) * max_tokens` rows of about `2 * max_hidden` bytes, plus the counts.
    pub fn new(
        num_ranks: usize,
        gpus_per_node: usize,
        max_tokens: usize,
        max_hidden: usize,
        max_topk: usize,
    ) -> Result<Self> {
        if gpus_per_node == 0 || gpus_per_node > MAX_GPUS_PER_NODE {
            return Err(Error::invalid(
                "gpus_per_node",
                gpus_per_node,
                format!("must be in 1..={MAX_GPUS_PER_NODE}"),
            ));
        }
        if num_ranks == 0 || num_ranks % gpus_per_node != 0 {
            return Err(Error::invalid(
                "num_ranks",
                num_ranks,
                format!("must be a positive multiple of gpus_per_node = {gpus_per_node}"),
            ));
        }
        let nodes = num_ranks / gpus_per_node;
        if nodes > MAX_NODES {
            return Err(Error::invalid(
                "num_nodes",
                nodes,
                format!("must be <= {MAX_NODES}"),
            ));
        }
        if max_tokens == 0 || max_tokens * num_ranks >= (1 << 31) {
            return Err(Error::invalid(
                "max_tokens",
                max_tokens,
                "must be positive, and max_tokens * num_ranks < 2^31",
            ));
        }
        let msg = MessageLayout::new(max_hidden, false, max_topk)?.bytes();
        let (comb, _) = combine_row(max_hidden, max_topk);
        let slot_bytes = align(msg.max(comb), 16);
        let count_stride = num_ranks + nodes + num_ranks * MAX_LOCAL_EXPERTS;
        let m = max_tokens;
        let mut at = 0;
        let mut region = |bytes: usize| {
            let off = at;
            at = align(at + bytes, 128);
            off
        };
        let off_sync = region(8 * num_ranks);
        let off_counts = region(4 * 2 * num_ranks * count_stride);
        let off_rdma_sig = region(8 * nodes);
        let off_comb_sig = region(8 * gpus_per_node);
        let off_recv = region(nodes * m * slot_bytes);
        let off_stage = region(nodes * m * slot_bytes);
        let off_comb_in = region(gpus_per_node * nodes * m * comb);
        Ok(Self {
            num_ranks,
            gpus_per_node,
            max_tokens,
            max_hidden,
            max_topk,
            slot_bytes,
            comb_bytes: comb,
            count_stride,
            off_sync,
            off_counts,
            off_rdma_sig,
            off_comb_sig,
            off_recv,
            off_stage,
            off_comb_in,
            total_bytes: at,
        })
    }

    /// Nodes `N`.
    pub fn num_nodes(&self) -> usize {
        self.num_ranks / self.gpus_per_node
    }

    /// Checks that an op of `num_tokens` tokens with `msg` messages and combine rows of
    /// `hidden` x `num_topk` fits.
    pub fn check_op(
        &self,
        num_tokens: usize,
        msg: Option<&MessageLayout>,
        comb: Option<(usize, usize)>,
    ) -> Result<()> {
        if num_tokens > self.max_tokens {
            return Err(Error::invalid(
                "num_tokens",
                num_tokens,
                format!(
                    "the internode buffer holds at most max_tokens = {} per rank",
                    self.max_tokens
                ),
            ));
        }
        if let Some(m) = msg {
            if m.bytes() > self.slot_bytes {
                return Err(Error::invalid(
                    "x",
                    format!("messages of {} bytes (hidden x top-k)", m.bytes()),
                    format!(
                        "the internode buffer was sized for hidden <= {} and top-k <= {}",
                        self.max_hidden, self.max_topk
                    ),
                ));
            }
        }
        if let Some((hidden, k)) = comb {
            let (bytes, _) = combine_row(hidden, k);
            if bytes > self.comb_bytes {
                return Err(Error::invalid(
                    "x",
                    format!("combine rows of hidden {hidden} and top-k {k}"),
                    format!(
                        "the internode buffer was sized for hidden <= {} and top-k <= {}",
                        self.max_hidden, self.max_topk
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_disjoint_aligned_and_sized_for_the_op() {
        let l = InternodeLayout::new(4, 2, 4096, 7168, 8).unwrap();
        let regions = [
            (l.off_sync, 8 * 4),
            (l.off_counts, 4 * 2 * 4 * l.count_stride),
            (l.off_rdma_sig, 8 * 2),
            (l.off_comb_sig, 8 * 2),
            (l.off_recv, 2 * 4096 * l.slot_bytes),
            (l.off_stage, 2 * 4096 * l.slot_bytes),
            (l.off_comb_in, 2 * 2 * 4096 * l.comb_bytes),
        ];
        for w in regions.windows(2) {
            assert_eq!(w[0].0 % 128, 0);
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert!(regions[6].0 + regions[6].1 <= l.total_bytes);
        // A bf16 message of hidden 7168 and top-8: row, ids, weights, header.
        let m = MessageLayout::new(7168, false, 8).unwrap();
        assert_eq!(
            (m.off_idx, m.off_weights, m.off_src, m.bytes()),
            (14336, 14368, 14400, 14416)
        );
        assert!(m.bytes() <= l.slot_bytes && l.comb_bytes <= l.slot_bytes);
        let fp8 = MessageLayout::new(7168, true, 8).unwrap();
        assert_eq!(
            (fp8.row_bytes, fp8.num_scales, fp8.off_idx),
            (7168, 56, 7168 + 224)
        );
        // About (2N + R) x M x 2H bytes: 472 MB at 2 x 2, 4096 tokens, hidden 7168.
        assert!(
            (470e6..480e6).contains(&(l.total_bytes as f64)),
            "{}",
            l.total_bytes
        );
    }

    #[test]
    fn bad_sizes_and_ops_too_large_are_refused() {
        assert!(InternodeLayout::new(4, 0, 8, 64, 2).is_err());
        assert!(InternodeLayout::new(4, 9, 8, 64, 2).is_err());
        assert!(InternodeLayout::new(6, 4, 8, 64, 2).is_err());
        assert!(InternodeLayout::new(4, 2, 0, 64, 2).is_err());
        assert!(InternodeLayout::new(66, 2, 8, 64, 2).is_err(), "33 nodes");
        assert!(MessageLayout::new(100, false, 2).is_err());
        assert!(
            MessageLayout::new(64, true, 2).is_err(),
            "fp8 needs whole 128-channel groups"
        );
        let l = InternodeLayout::new(4, 2, 8, 256, 4).unwrap();
        assert!(l.check_op(8, None, None).is_ok());
        let e = l.check_op(9, None, None).unwrap_err().to_string();
        assert!(e.contains("max_tokens = 8"), "{e}");
        let big = MessageLayout::new(512, false, 4).unwrap();
        assert!(l.check_op(1, Some(&big), None).is_err());
        assert!(l.check_op(1, None, Some((256, 4))).is_ok());
        assert!(l.check_op(1, None, Some((256, 16))).is_err());
    }
}
