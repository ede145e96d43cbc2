//! The byte layout of one rank's low-latency buffer (the same on every rank).
//!
//! ```text
//! control   u32 words [13] (op sequence, launch arrival counters, hook FIFOs), padded to 256
//!           active_ranks i32 [R]          (1 = active; cleared by a kernel on a timeout)
//!           send_done    i32 [E]          (local per-expert send counters; balance to 0)
//!           unit_done    i32 [L*R]        (local per-(expert, home) combine chunk counters)
//! set 0, 1  signals u64 [L][R]            dispatch counts: (tag << 32) | u32(-n - 1)
//!           flags   i32 [E]               combine: tag once expert e's rows have arrived
//!           msgs    [R][M] x msg_stride     one per (source, token), sent once per destination
//!                                         rank: {i32 src_token, i32 j, u32 mask, u32 tag |
//!                                         payload: fp8 H bytes or bf16 2H bytes | f32 scales
//!                                         [H/128] (fp8) | padding to 16 bytes | f32 w[K]
//!                                         (dispatches that carry the top-k weights)}
//!           idx     i32 [L][R][M]         slot -> src_token | topk_pos << 24
//!           rows    bf16 [M][LL_MAX_TOPK][H]  combine rows: one per (token, k) of the home
//!                                         rank, or (per-rank combine) one per (token, j-th
//!                                         distinct rank among the token's experts)
//! stage     (NVSHMEM buffers only)        rows and messages bound for ranks of other nodes,
//!                                         written here and put from here:
//!                                         max([R][M] x msg_stride, [R][M][LL_MAX_TOPK] bf16
//!                                         rows of H)
//! ```
//!
//! Every region starts at a multiple of 256 bytes. `L = E / R` local experts,
//! `M = max_tokens_per_rank`. `tag = (op sequence mod 2^31) + 1` is never 0, so zeroed
//! signals and flags never look written.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::FP8_GROUP;

/// Largest top-k the low-latency kernels support (`kMaxTopk` in `protocol.cuh`): the combine
/// region holds this many rows per token.
pub const LL_MAX_TOPK: usize = 16;

/// 4-byte words of one per-(source, token) record in a dispatch's outputs
/// ([`super::RankRecords`]): a header (the token's row at its home, the mask), the packed row
/// of each k in the mask and the weights (`kRecordWords` in `protocol.cuh`).
pub const LL_RECORD_WORDS: usize = 4 + 2 * LL_MAX_TOPK;

/// Bytes of the control words at the start of the buffer (13 used, padded).
const CONTROL_WORDS_BYTES: usize = 256;
/// Alignment of every region.
const REGION_ALIGN: usize = 256;

fn align(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// Sizes and offsets of a low-latency buffer; build it with [`LowLatencyLayout::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowLatencyLayout {
    /// `M`: most tokens a rank dispatches in one op.
    pub max_tokens_per_rank: usize,
    /// `H`: hidden size (a multiple of 128).
    pub hidden: usize,
    /// `R`: number of ranks.
    pub num_ranks: usize,
    /// `E`: number of routed experts (a multiple of `R`).
    pub num_experts: usize,
    /// Bytes per dispatch message slot: `16 + 2H + 4 * LL_MAX_TOPK` (holds the bf16 and the
    /// fp8 form, each with the top-k weights after it).
    pub msg_stride: usize,
    /// Offset of `active_ranks` (in the control area).
    pub off_active: usize,
    /// Offset of `send_done` `[E]`, followed by `unit_done` `[L * R]` (in the control area).
    pub off_send_done: usize,
    /// Offset of buffer set 0; set 1 starts `set_bytes` later.
    pub sets_offset: usize,
    /// Bytes of one buffer set.
    pub set_bytes: usize,
    /// Offset of the dispatch count signals within a set.
    pub off_signals: usize,
    /// Offset of the combine flags within a set.
    pub off_flags: usize,
    /// Offset of the dispatch token messages `[R][M]` within a set.
    pub off_msgs: usize,
    /// Offset of the dispatch slot index `[L][R][M]` (i32) within a set.
    pub off_idx: usize,
    /// Offset of the combine rows within a set.
    pub off_rows: usize,
    /// Offset of the staging region of puts to other nodes (0 without one, see
    /// [`LowLatencyLayout::with_remote_stage`]).
    pub off_stage: usize,
    /// Bytes of the staging region (0 without one).
    pub stage_bytes: usize,
    /// Total bytes of the buffer.
    pub total_bytes: usize,
}

impl LowLatencyLayout {
    /// Checks the sizes and computes the layout.
    pub fn new(
        max_tokens_per_rank: usize,
        hidden: usize,
        num_ranks: usize,
        num_experts: usize,
    ) -> Result<Self> {
        let (m, h, r, e) = (max_tokens_per_rank, hidden, num_ranks, num_experts);
        if m == 0 || m > 1 << 24 {
            return Err(Error::invalid(
                "max_tokens_per_rank",
                m,
                "must be in [1, 2^24]",
            ));
        }
        if h == 0 || h % FP8_GROUP != 0 || h > 1 << 20 {
            return Err(Error::invalid(
                "hidden",
                h,
                format!("must be a positive multiple of {FP8_GROUP}, at most 2^20"),
            ));
        }
        if r == 0 || r > crate::MAX_RANKS {
            return Err(Error::invalid(
                "num_ranks",
                r,
                format!("must be in [1, {}]", crate::MAX_RANKS),
            ));
        }
        if e == 0 || e % r != 0 || e > i32::MAX as usize {
            return Err(Error::invalid(
                "num_experts",
                e,
                format!("must be a positive multiple of num_ranks = {r}"),
            ));
        }
        // The per-rank combine's records name a packed row (< E * M) in an i32.
        if e.checked_mul(m).is_none_or(|v| v > i32::MAX as usize) {
            return Err(Error::invalid(
                "num_experts",
                e,
                format!("times max_tokens_per_rank ({m}) must fit in i32"),
            ));
        }
        let l = e / r;
        let msg_stride = 16 + 2 * h + 4 * LL_MAX_TOPK;
        let off_active = CONTROL_WORDS_BYTES;
        let off_send_done = off_active + align(4 * r, REGION_ALIGN);
        // send_done [E], then unit_done [L * R] (= [E]).
        let sets_offset = off_send_done + align(8 * e, REGION_ALIGN);
        let off_signals = 0;
        let off_flags = off_signals + align(8 * l * r, REGION_ALIGN);
        let off_msgs = off_flags + align(4 * e, REGION_ALIGN);
        let msgs_bytes = r
            .checked_mul(m)
            .and_then(|v| v.checked_mul(msg_stride))
            .ok_or_else(|| Error::invalid("max_tokens_per_rank", m, "buffer size overflows"))?;
        let off_idx = off_msgs + align(msgs_bytes, REGION_ALIGN);
        let off_rows = off_idx + align(4 * l * r * m, REGION_ALIGN);
        let rows_bytes = m * LL_MAX_TOPK * 2 * h;
        let set_bytes = off_rows + align(rows_bytes, REGION_ALIGN);
        let total_bytes = sets_offset + 2 * set_bytes;
        Ok(Self {
            max_tokens_per_rank: m,
            hidden: h,
            num_ranks: r,
            num_experts: e,
            msg_stride,
            off_active,
            off_send_done,
            sets_offset,
            set_bytes,
            off_signals,
            off_flags,
            off_msgs,
            off_idx,
            off_rows,
            off_stage: 0,
            stage_bytes: 0,
            total_bytes,
        })
    }

    /// The layout with a staging region after the two sets, for buffers that reach ranks of
    /// other nodes with NVSHMEM puts: a message per (destination rank, token) or a combine row
    /// per (destination rank, token, k), whichever is larger (one region serves both ops and
    /// both sets: a launch completes its puts before it ends).
    pub fn with_remote_stage(self) -> Result<Self> {
        if self.stage_bytes != 0 {
            return Ok(self);
        }
        let (r, m, h) = (self.num_ranks, self.max_tokens_per_rank, self.hidden);
        let too_big = || Error::invalid("max_tokens_per_rank", m, "staging size overflows");
        let msgs = r
            .checked_mul(m)
            .and_then(|v| v.checked_mul(self.msg_stride))
            .ok_or_else(too_big)?;
        let rows = r
            .checked_mul(m)
            .and_then(|v| v.checked_mul(LL_MAX_TOPK * 2 * h))
            .ok_or_else(too_big)?;
        let stage_bytes = align(msgs.max(rows), REGION_ALIGN);
        let off_stage = self.total_bytes;
        Ok(Self {
            off_stage,
            stage_bytes,
            total_bytes: off_stage.checked_add(stage_bytes).ok_or_else(too_big)?,
            ..self
        })
    }

    /// `L = E / R`: experts per rank.
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// Rows of `recv_x` per local expert: `R * M`.
    pub fn recv_rows_per_expert(&self) -> usize {
        self.num_ranks * self.max_tokens_per_rank
    }
}

/// Where the `i32` outputs of one dispatch lie in their one allocation (in elements, every part
/// 16-byte aligned: the combine kernel reads the ranges as pairs), in address order:
/// `recv_src_info` `[L, R*M]`, `recv_count` `[L]`, `recv_src_topk` `[L, R*M]`,
/// `recv_layout_range` `[L, R, 2]`; the gaps between them are padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvI32Block {
    count: usize,
    src_topk: usize,
    range: usize,
    /// `L`, `R * M` (rows per local expert), `R`.
    l: usize,
    rows_per_expert: usize,
    r: usize,
}

impl RecvI32Block {
    /// The block of a dispatch laid out as `layout`.
    pub fn new(layout: &LowLatencyLayout) -> Self {
        let (l, r) = (layout.num_local_experts(), layout.num_ranks);
        let rows_per_expert = layout.recv_rows_per_expert();
        let up = |v: usize| v.div_ceil(4) * 4;
        let rows = l * rows_per_expert;
        let count = up(rows);
        let src_topk = count + up(l);
        Self {
            count,
            src_topk,
            range: src_topk + up(rows),
            l,
            rows_per_expert,
            r,
        }
    }

    /// Elements of the whole block.
    pub fn total_len(&self) -> usize {
        self.range + 2 * self.l * self.r
    }

    /// `L`: local experts.
    pub fn num_local_experts(&self) -> usize {
        self.l
    }

    /// `R * M`: rows per local expert.
    pub fn rows_per_expert(&self) -> usize {
        self.rows_per_expert
    }

    /// `R`: ranks.
    pub fn num_ranks(&self) -> usize {
        self.r
    }

    /// `recv_src_info` `[L, R*M]`: the source token of each packed row, `-1` past the counts.
    pub fn src_info(&self) -> Range<usize> {
        0..self.l * self.rows_per_expert
    }

    /// `recv_count` `[L]`: rows per local expert.
    pub fn count(&self) -> Range<usize> {
        self.count..self.count + self.l
    }

    /// `recv_src_topk` `[L, R*M]`: the top-k position of each packed row at its source.
    pub fn src_topk(&self) -> Range<usize> {
        self.src_topk..self.src_topk + self.l * self.rows_per_expert
    }

    /// `recv_layout_range` `[L, R, 2]`: `(offset, count)` of each source's rows per local
    /// expert.
    pub fn layout_range(&self) -> Range<usize> {
        self.range..self.total_len()
    }
}

/// Bytes of the low-latency buffer each rank needs for up to `max_tokens_per_rank` tokens of
/// hidden size `hidden`, `num_ranks` ranks and `num_experts` experts (top-k up to
/// [`LL_MAX_TOPK`]); two buffer sets included.
pub fn buffer_size_hint(
    max_tokens_per_rank: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
) -> Result<usize> {
    Ok(LowLatencyLayout::new(max_tokens_per_rank, hidden, num_ranks, num_experts)?.total_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_and_disjoint() {
        let l = LowLatencyLayout::new(128, 7168, 4, 288).unwrap();
        for off in [
            l.off_active,
            l.off_send_done,
            l.sets_offset,
            l.off_flags,
            l.off_msgs,
            l.off_idx,
            l.off_rows,
        ] {
            assert_eq!(off % 256, 0);
        }
        assert!(l.off_send_done >= l.off_active + 4 * 4);
        assert!(l.sets_offset >= l.off_send_done + 8 * 288);
        assert!(l.off_msgs >= l.off_flags + 4 * 288);
        assert_eq!(
            l.off_idx - l.off_msgs,
            4 * 128 * (16 + 2 * 7168 + 4 * LL_MAX_TOPK)
        );
        assert_eq!(l.off_rows - l.off_idx, 4 * 72 * 4 * 128);
        assert_eq!(l.set_bytes - l.off_rows, 128 * LL_MAX_TOPK * 2 * 7168);
        assert_eq!(l.total_bytes, l.sets_offset + 2 * l.set_bytes);
        assert_eq!(buffer_size_hint(128, 7168, 4, 288).unwrap(), l.total_bytes);
        assert_eq!((l.off_stage, l.stage_bytes), (0, 0));
    }

    #[test]
    fn remote_stage_follows_the_sets() {
        let l = LowLatencyLayout::new(128, 7168, 4, 288).unwrap();
        let s = l.with_remote_stage().unwrap();
        assert_eq!(s.off_stage, l.total_bytes);
        assert_eq!(s.off_stage % 256, 0);
        // Combine rows (4 x 128 x 16 x 14 KiB) outweigh the messages here.
        assert_eq!(s.stage_bytes, 4 * 128 * LL_MAX_TOPK * 2 * 7168);
        assert_eq!(s.total_bytes, s.off_stage + s.stage_bytes);
        assert_eq!(s.with_remote_stage().unwrap(), s);
        // Everything else is unchanged.
        assert_eq!(
            (s.off_rows, s.set_bytes, s.sets_offset),
            (l.off_rows, l.set_bytes, l.sets_offset)
        );
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(LowLatencyLayout::new(0, 128, 2, 4).is_err());
        assert!(LowLatencyLayout::new(8, 100, 2, 4).is_err());
        assert!(LowLatencyLayout::new(8, 128, 3, 4).is_err());
        assert!(LowLatencyLayout::new(8, 128, 0, 4).is_err());
        // E * M past i32 (the per-rank records' slot numbers).
        assert!(LowLatencyLayout::new(1 << 24, 128, 2, 256).is_err());
    }

    #[test]
    fn recv_i32_block_parts_are_aligned_and_disjoint() {
        for (m, r, e) in [(1, 1, 1), (128, 1, 256), (5, 2, 6), (7, 8, 256)] {
            let lay = LowLatencyLayout::new(m, 128, r, e).unwrap();
            let b = RecvI32Block::new(&lay);
            let (l, rows) = (e / r, e / r * r * m);
            let parts = [b.src_info(), b.count(), b.src_topk(), b.layout_range()];
            let lens = [rows, l, rows, 2 * l * r];
            for (i, (p, len)) in parts.iter().zip(lens).enumerate() {
                assert_eq!(
                    p.start % 4,
                    0,
                    "part {i} of {m}x{r}x{e} not 16-byte aligned"
                );
                assert_eq!(p.len(), len, "part {i} of {m}x{r}x{e}");
                let end = parts.get(i + 1).map_or(b.total_len(), |q| q.start);
                assert!(p.end <= end, "part {i} of {m}x{r}x{e} overlaps the next");
            }
            assert_eq!(b.layout_range().end, b.total_len());
        }
    }
}
