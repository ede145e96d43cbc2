//! [`CeConfig`]: how the copy-engine path splits the work between copy engines, pack / reduce
//! SMs and SM copies, and its tuned defaults (measurements: `docs/benchmarks.md`).

use crate::error::{Error, Result};
use crate::intranode::CE_MAX_CHUNKS;

/// Launch configuration of the copy-engine path.
///
/// The copy engines of one GPU do not add up over peers (`docs/benchmarks.md`, "What NVLink
/// carries"), so they serve `copy_engine_peers` peers and SM warps move the other peers' bytes
/// with the same slots, chunks and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CeConfig {
    /// Blocks (SMs) of the pack (dispatch) and reduce (combine) kernels.
    pub num_sms: usize,
    /// Rows of the first chunk of each block; each next chunk doubles, up to `max_chunk_rows`.
    pub first_chunk_rows: usize,
    /// Largest chunk (raised to `ceil(m / 16)` for blocks of `m` rows).
    pub max_chunk_rows: usize,
    /// Dispatch: `first_chunk_rows` of the blocks pushed over NVLink (`dispatch_push`), which
    /// the receiver copies out of its own buffer chunk by chunk; 0 = `first_chunk_rows`. Small
    /// chunks are copied out while their rows are still in the receiver's L2 cache.
    pub push_first_chunk_rows: usize,
    /// Dispatch: `max_chunk_rows` of the pushed blocks; 0 = `max_chunk_rows`.
    pub push_max_chunk_rows: usize,
    /// Peers served by the copy engines (see [`copy_engine_peer`](crate::intranode::copy_engine_peer)); SM warps serve the rest.
    pub copy_engine_peers: usize,
    /// Blocks (SMs) of SM copies, run as extra blocks of the pack (dispatch) or reduce
    /// (combine) kernel, 768 threads each like those: dispatch pulls the rows of the peers not
    /// served by copy engines and every peer's metadata; combine pushes the rows of the peers
    /// not served by copy engines. Unused (no blocks) when they have nothing to move.
    pub sm_blocks: usize,
    /// Dispatch: between two peers that both serve each other by SM copies, the pack writes
    /// the rows straight into the peer's buffer over NVLink (stores need no round trip) and the
    /// peer's SM blocks copy them out locally, instead of the peer pulling them over NVLink.
    pub dispatch_push: bool,
    /// Dispatch: the pack stores the rows of the peers before this rank's own rows, taking
    /// its work in token order from three queues: the rows the peers fetch from this rank's
    /// buffer (the copy engines wait for these), the rows pushed over NVLink, and this rank's
    /// own rows (reading `x` once per queue), so the peers' chunks complete sooner and in order.
    /// `false`: one pass, each row read once and stored to every destination, tokens handed out
    /// to the warps statically.
    pub own_rows_last: bool,
    /// Dispatch, with `own_rows_last`: warps of each pack block (of [`PACK_WARPS`]) in the
    /// local role, which take the rows the peers fetch first, then the pushes, then the own
    /// rows; the other warps take the pushes first. Without pushed peers every warp starts on
    /// the local queue.
    pub pack_local_warps: usize,
    /// Dispatch, with `own_rows_last`: pack blocks whose warps are all in the local role (see
    /// `pack_local_warps`), so that the local stores do not share an SM with NVLink pushes.
    pub pack_local_blocks: usize,
    /// Dispatch: copy streams per copy-engine peer (1 to [`MAX_COPY_LANES`]). Chunks take
    /// them in turn, so that a chunk's wait and copy set-up overlap the previous chunk's copy.
    /// Combine always uses one per home (its weights copy and chunk flags stay in order).
    pub copy_lanes: usize,
    /// Dispatch, with `dispatch_push`: the rows the peers pushed into this rank's buffer are
    /// copied out into `recv_x` by this GPU's copy engines (one contiguous block per chunk, on
    /// the source's copy streams) instead of by the SM copy blocks, which then move only the
    /// metadata; the SMs saved can pack (and push) instead.
    pub local_copy_out: bool,
    /// Combine: 0 = `num_sms` blocks reduce beside `sm_blocks` blocks pushing to the homes
    /// the copy engines do not serve. `n > 0` = every block (`num_sms + sm_blocks`) has both
    /// roles: its first `n` warps (of [`PACK_WARPS`]) push rows from a work queue in chunk
    /// order, then reduce; the others reduce tokens from a work queue in token order (the
    /// default beyond 2 ranks, see [`CeConfig::combine_for`]).
    pub combine_push_warps: usize,
    /// Combine: the last `n` chunks of each home the SM warps serve move by the copy engines
    /// instead, on the copy-engine home's stream (the first one's), chunk by chunk with that
    /// home's own chunks (every home's chunk j before any home's chunk j + 1), each followed by
    /// its flag: the copy engines keep carrying bytes while the SMs push. 0: the SMs push every
    /// chunk of their homes. (The dispatch has no counterpart: pulling the SM peers' last
    /// chunks by copy engines measured slower, `docs/benchmarks.md`.)
    pub combine_ce_tail_chunks: usize,
}

/// Default [`CeConfig::pack_local_warps`].
pub const PACK_LOCAL_WARPS: usize = 4;

/// The best [`CeConfig::combine_push_warps`] measured at 4 ranks (with chunks of 768 doubling
/// to 4096); the default beyond 2 ranks (see [`CeConfig::combine_for`]).
pub const COMBINE_PUSH_WARPS: usize = 5;

/// The [`CeConfig::combine_ce_tail_chunks`] of the combine beyond 2 ranks (3 chunks per home at
/// 4096 tokens: the SMs push the first).
pub const COMBINE_CE_TAIL_CHUNKS: usize = 2;

/// The chunks of the dispatch's pushed blocks beyond 2 ranks (bf16; see
/// [`CeConfig::push_first_chunk_rows`]): 512 rows of 14 KiB are copied out of the receiver's
/// buffer while still in its L2 cache.
pub const PUSH_CHUNK_ROWS: usize = 512;

/// [`CeConfig::pack_local_blocks`] of the fp8 dispatch beyond 2 ranks
/// ([`CeConfig::dispatch_fp8_for`]).
pub const FP8_PACK_LOCAL_BLOCKS: usize = 2;

/// Warps of a block of the copy-engine kernels ([`CeConfig::pack_local_warps`] and
/// [`CeConfig::combine_push_warps`] are at most this).
pub const PACK_WARPS: usize = 24;

/// Most copy streams per peer ([`CeConfig::copy_lanes`]).
pub const MAX_COPY_LANES: usize = 2;

impl Default for CeConfig {
    /// The combine defaults ([`CeConfig::combine_default`]).
    fn default() -> Self {
        Self::combine_default()
    }
}

impl CeConfig {
    /// The chunking of the dispatch's pushed blocks: (`push_first_chunk_rows`,
    /// `push_max_chunk_rows`), each 0 meaning the general one.
    pub fn push_chunks(&self) -> (usize, usize) {
        let first = match self.push_first_chunk_rows {
            0 => self.first_chunk_rows,
            n => n,
        };
        let max = match self.push_max_chunk_rows {
            0 => self.max_chunk_rows,
            n => n,
        };
        (first, max)
    }

    /// Dispatch defaults for 2 ranks and 24 SMs ([`CeConfig::dispatch_for`]).
    pub fn dispatch_default() -> Self {
        Self::dispatch_for(2, 24)
    }

    /// Combine defaults for 2 ranks and 24 SMs ([`CeConfig::combine_for`]).
    pub fn combine_default() -> Self {
        Self::combine_for(2, 24)
    }

    /// Dispatch split of `sms` SMs (at least 3) for `num_ranks` ranks, one copy-engine peer, the
    /// own rows packed last, 4 local-role warps per pack block and two copy streams per
    /// copy-engine peer. Two ranks: all but 2 SMs pack and 2 pull the metadata, chunks of 768
    /// rows doubling to 4096. More ranks: five sixths of the SMs pack (pushing the rows of the
    /// SM peers into their buffers), the receiver's copy engines copy the pushed rows out
    /// (`local_copy_out`) in chunks of [`PUSH_CHUNK_ROWS`] rows, and the other sixth moves the
    /// metadata, chunks of 768 doubling to 4096. Both measured best in their sweeps
    /// (`docs/benchmarks.md`, normal mode); tuned on bf16 rows (fp8:
    /// [`CeConfig::dispatch_fp8_for`]).
    pub fn dispatch_for(num_ranks: usize, sms: usize) -> Self {
        let sms = sms.max(3);
        if num_ranks <= 2 {
            Self {
                num_sms: sms - 2,
                first_chunk_rows: 768,
                max_chunk_rows: 4096,
                push_first_chunk_rows: 0,
                push_max_chunk_rows: 0,
                copy_engine_peers: 1,
                sm_blocks: 2,
                dispatch_push: true,
                own_rows_last: true,
                pack_local_warps: PACK_LOCAL_WARPS,
                pack_local_blocks: 0,
                copy_lanes: 2,
                local_copy_out: false,
                combine_push_warps: 0,
                combine_ce_tail_chunks: 0,
            }
        } else {
            Self {
                num_sms: sms - sms / 6,
                first_chunk_rows: 768,
                max_chunk_rows: 4096,
                push_first_chunk_rows: PUSH_CHUNK_ROWS,
                push_max_chunk_rows: PUSH_CHUNK_ROWS,
                copy_engine_peers: 1,
                sm_blocks: (sms / 6).max(1),
                dispatch_push: true,
                own_rows_last: true,
                pack_local_warps: PACK_LOCAL_WARPS,
                pack_local_blocks: 0,
                copy_lanes: 2,
                local_copy_out: true,
                combine_push_warps: 0,
                combine_ce_tail_chunks: 0,
            }
        }
    }

    /// [`CeConfig::dispatch_for`] for fp8 payloads. The pushed blocks keep the general
    /// chunking: rows half as wide leave less for small chunks to save (their copy-out's bytes)
    /// than the chunks' set-up costs, and fixed small chunks measured slower for fp8 while
    /// faster for bf16. Beyond 2 ranks a quarter of the SMs move the metadata and two pack
    /// blocks are wholly in the local role, as the fetched rows are the fp8 dispatch's longest
    /// path; that split measured faster than the bf16 one for fp8 (`docs/benchmarks.md`,
    /// "Normal mode (prefill), intranode").
    pub fn dispatch_fp8_for(num_ranks: usize, sms: usize) -> Self {
        let d = Self::dispatch_for(num_ranks, sms);
        if num_ranks <= 2 {
            // No pushed blocks there, and the same split.
            return d;
        }
        let sms = sms.max(3);
        let sm_blocks = (sms / 4).max(1);
        let num_sms = sms - sm_blocks;
        Self {
            num_sms,
            sm_blocks,
            pack_local_blocks: FP8_PACK_LOCAL_BLOCKS.min(num_sms / 2),
            push_first_chunk_rows: 0,
            push_max_chunk_rows: 0,
            ..d
        }
    }

    /// Combine split of `sms` SMs (at least 3) for `num_ranks` ranks, one copy-engine peer. Two
    /// ranks: every SM reduces (the copy engines push everything), chunks of 1024 rows doubling
    /// to 4096. More ranks: every block both pushes to the peers beyond the copy engines' one
    /// ([`CeConfig::combine_push_warps`] = [`COMBINE_PUSH_WARPS`] warps) and reduces, the copy
    /// engines also push those peers' last [`COMBINE_CE_TAIL_CHUNKS`] chunks, chunks of 1024 doubling
    /// to 4096 (`docs/benchmarks.md`, normal mode); `combine_push_warps = 0` gives separate
    /// blocks, two thirds reducing and one third pushing.
    pub fn combine_for(num_ranks: usize, sms: usize) -> Self {
        let sms = sms.max(3);
        if num_ranks <= 2 {
            Self {
                num_sms: sms,
                first_chunk_rows: 1024,
                max_chunk_rows: 4096,
                push_first_chunk_rows: 0,
                push_max_chunk_rows: 0,
                copy_engine_peers: 1,
                sm_blocks: 1,
                dispatch_push: true,
                own_rows_last: true,
                pack_local_warps: PACK_LOCAL_WARPS,
                pack_local_blocks: 0,
                copy_lanes: 2,
                local_copy_out: false,
                combine_push_warps: 0,
                combine_ce_tail_chunks: 0,
            }
        } else {
            Self {
                num_sms: sms - sms / 3,
                first_chunk_rows: 1024,
                max_chunk_rows: 4096,
                push_first_chunk_rows: 0,
                push_max_chunk_rows: 0,
                copy_engine_peers: 1,
                sm_blocks: (sms / 3).max(1),
                dispatch_push: true,
                own_rows_last: true,
                pack_local_warps: PACK_LOCAL_WARPS,
                pack_local_blocks: 0,
                copy_lanes: 2,
                local_copy_out: false,
                combine_push_warps: COMBINE_PUSH_WARPS,
                combine_ce_tail_chunks: COMBINE_CE_TAIL_CHUNKS,
            }
        }
    }

    /// Checks `1 <= num_sms <= 1024`, `1 <= sm_blocks <= 1024`,
    /// `1 <= first_chunk_rows <= max_chunk_rows <= 2^24`, `pack_local_warps <= 24`,
    /// `combine_push_warps <= 24`, `pack_local_blocks <= num_sms` and
    /// `combine_ce_tail_chunks <= 32`.
    pub fn validate(&self) -> Result<()> {
        if self.num_sms == 0 || self.num_sms > 1024 {
            return Err(Error::invalid(
                "num_sms",
                self.num_sms,
                "must be in [1, 1024]",
            ));
        }
        if self.sm_blocks == 0 || self.sm_blocks > 1024 {
            return Err(Error::invalid(
                "sm_blocks",
                self.sm_blocks,
                "must be in [1, 1024]",
            ));
        }
        if self.first_chunk_rows == 0 || self.first_chunk_rows > self.max_chunk_rows {
            return Err(Error::invalid(
                "first_chunk_rows",
                self.first_chunk_rows,
                format!("must be in [1, max_chunk_rows = {}]", self.max_chunk_rows),
            ));
        }
        let (push_first, push_max) = self.push_chunks();
        if push_first > push_max || push_max > 1 << 24 {
            return Err(Error::invalid(
                "push_first_chunk_rows",
                push_first,
                format!("must be <= push_max_chunk_rows = {push_max} <= 2^24 (0 = the general chunking)"),
            ));
        }
        if self.copy_lanes == 0 || self.copy_lanes > MAX_COPY_LANES {
            return Err(Error::invalid(
                "copy_lanes",
                self.copy_lanes,
                format!("must be in [1, {MAX_COPY_LANES}]"),
            ));
        }
        if self.pack_local_warps > PACK_WARPS {
            return Err(Error::invalid(
                "pack_local_warps",
                self.pack_local_warps,
                format!("must be <= {PACK_WARPS} (warps of a pack block)"),
            ));
        }
        if self.combine_push_warps > PACK_WARPS {
            return Err(Error::invalid(
                "combine_push_warps",
                self.combine_push_warps,
                format!("must be <= {PACK_WARPS} (warps of a block)"),
            ));
        }
        if self.pack_local_blocks > self.num_sms {
            return Err(Error::invalid(
                "pack_local_blocks",
                self.pack_local_blocks,
                format!("must be <= num_sms = {}", self.num_sms),
            ));
        }
        if self.combine_ce_tail_chunks > CE_MAX_CHUNKS {
            return Err(Error::invalid(
                "combine_ce_tail_chunks",
                self.combine_ce_tail_chunks,
                format!("must be <= {CE_MAX_CHUNKS} (chunks of a block)"),
            ));
        }
        if self.max_chunk_rows > 1 << 24 {
            return Err(Error::invalid(
                "max_chunk_rows",
                self.max_chunk_rows,
                "must be <= 2^24",
            ));
        }
        Ok(())
    }
}
