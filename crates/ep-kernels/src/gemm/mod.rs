//! Grouped GEMMs of the routed experts: one GEMM per local expert ("group") over the rows that
//! expert received, with the row counts on the device, in the two layouts expert parallelism
//! produces:
//!
//! - [`GroupLayout::Contiguous`] (normal mode): `A = [rows, K]`, the rows of each group
//!   together, group `g` starting at `sum_{j<g} align_up(counts[j], alignment)`;
//! - [`GroupLayout::Masked`] (low-latency mode): `A = [groups, m_max, K]` as the low-latency
//!   receive leaves it, `counts[g] <= m_max` valid rows in block `g`.
//!
//! `B = [groups, N, K]` (each expert's weight in `nn.Linear` order, out x in) and
//! `D = [rows, N]`, row for row with `A`. Rows past a group's count are never read nor written.
//! bf16 in and out, f32 accumulation. The experts' first GEMM runs with SwiGLU in its
//! epilogue ([`grouped_gemm_swiglu`]): its weight is the expert's `gate_proj` and `up_proj` in
//! the blocked layout ([`GATE_UP_BLOCK`], `N = 2I` rows) and it writes
//! `act = silu(gate) * up` (`[rows, I]`) for the `down` GEMM (`N = H`, `K = I`); the
//! `[rows, 2I]` product is never stored.
//!
//! On CUDA (`cuda/`) the GEMMs are CUTLASS 3 ptr-array kernels for sm_90a (TMA, WGMMA,
//! persistent grouped scheduler; `grouped_gemm_sm90.cuh`, the SwiGLU epilogue in
//! `swiglu_epilogue_sm90.cuh`) in three tile configurations ([`GemmTiles`]); a setup
//! kernel writes each group's shape and pointers from the device counts, so no count is read
//! by the host; for masked blocks of a few rows (decode) a hand-written kernel streams each
//! active group's weights once instead ([`GemmTiles::Gemv`], `grouped_gemv.cu`). The host
//! twins ([`host`]) compute the same functions in f32 and are the test reference.
//!
//! Block-scaled FP8 weights (DeepSeek-V3's release format) have their own grouped GEMMs with
//! the same layouts in [`fp8`].

pub mod fp8;
pub mod host;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use host::{
    group_starts, grouped_gemm, grouped_gemm_extra, grouped_gemm_swiglu, swiglu_rows,
    HostExtraGroups,
};

use crate::error::{Error, Result};

/// Most groups (local experts) one grouped GEMM takes.
pub const MAX_GROUPS: usize = 1024;

/// Rows per block of the blocked gate_up layout the SwiGLU GEMMs read: an expert's `[2I, H]`
/// gate_up weight holds `gate_proj` rows `8b .. 8b + 8` at rows `16b .. 16b + 8` and the
/// `up_proj` rows of the same indices right after them, so that one thread of a WGMMA tile
/// holds both operands of each SwiGLU product (`swiglu_epilogue_sm90.cuh`). `I` must be a
/// multiple of it.
pub const GATE_UP_BLOCK: usize = 8;

/// The rows `(gate, up)` of output column `j` in the blocked gate_up layout ([`GATE_UP_BLOCK`]).
pub fn gate_up_rows(j: usize) -> (usize, usize) {
    let gate = (j / GATE_UP_BLOCK) * 2 * GATE_UP_BLOCK + j % GATE_UP_BLOCK;
    (gate, gate + GATE_UP_BLOCK)
}

/// How the rows of the groups lie in `A` (and `D`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupLayout {
    /// Groups one after another; each group's first row is a multiple of `alignment` (>= 1).
    Contiguous {
        /// Row alignment of every group's start.
        alignment: usize,
    },
    /// Group `g` owns rows `g * m_max .. (g + 1) * m_max`, of which the first `counts[g]` are
    /// valid.
    Masked {
        /// Rows per group block.
        m_max: usize,
    },
}

impl GroupLayout {
    /// Checks the layout against `groups` groups and `rows` rows of `A`.
    pub fn check(&self, groups: usize, rows: usize) -> Result<()> {
        if groups == 0 || groups > MAX_GROUPS {
            return Err(Error::invalid(
                "groups",
                groups,
                format!("must be in 1..={MAX_GROUPS}"),
            ));
        }
        match *self {
            GroupLayout::Contiguous { alignment } => {
                if alignment == 0 || alignment > i32::MAX as usize {
                    return Err(Error::invalid(
                        "alignment",
                        alignment,
                        "must be in 1..=i32::MAX",
                    ));
                }
            }
            GroupLayout::Masked { m_max } => {
                if m_max == 0 || m_max > i32::MAX as usize {
                    return Err(Error::invalid("m_max", m_max, "must be in 1..=i32::MAX"));
                }
                if groups.checked_mul(m_max) != Some(rows) {
                    return Err(Error::invalid(
                        "a",
                        format!("{rows} rows"),
                        format!("the masked layout needs groups * m_max = {groups} * {m_max} rows"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Layout code of the kernels (`kContiguous` / `kMasked`).
    #[cfg(feature = "cuda")]
    pub(crate) fn code(&self) -> i32 {
        match self {
            GroupLayout::Contiguous { .. } => 0,
            GroupLayout::Masked { .. } => 1,
        }
    }

    /// `(m_max, alignment)` as the kernels take them (the unused one is 1).
    #[cfg(feature = "cuda")]
    pub(crate) fn params(&self) -> (i32, i32) {
        // Both fit in an i32: checked by `check`.
        match *self {
            GroupLayout::Contiguous { alignment } => (1, alignment as i32),
            GroupLayout::Masked { m_max } => (m_max as i32, 1),
        }
    }
}

/// The tile configuration of a CUDA grouped GEMM (one CUTLASS instantiation each; measured in
/// `docs/benchmarks.md`, "Grouped GEMM of the experts").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmTiles {
    /// [`GemmTiles::Narrow`] for the masked layout; for the contiguous layout
    /// [`GemmTiles::WideM`] with at least 512 rows per group on average, else
    /// [`GemmTiles::Wide`] (it holds up even at a few rows per group).
    #[default]
    Auto,
    /// 128 x 256 cooperative tiles, clusters of 2 CTAs along N sharing the A tile.
    Wide,
    /// 128 x 256 cooperative tiles, clusters of 2 CTAs along M sharing the B tile (the
    /// weights): best when every group has several M tiles.
    WideM,
    /// 64 x 128 ping-pong tiles, clusters of 2 along N: few rows per group (decode).
    Narrow,
    /// No tiles (masked layout only): warps stream each active group's weight rows once and
    /// multiply them with the group's valid rows, [`GEMV_ROWS_PER_PASS`] rows per pass over
    /// the weights (`grouped_gemv.cu`). For blocks expected to hold at most a few rows (one
    /// decode token per rank); `Auto` never picks it because the counts are on the device:
    /// the caller who knows the expected rows does ([`GemmTiles::for_masked_rows`]).
    Gemv,
}

/// How many CTAs a CUTLASS grouped GEMM launches ([`GroupedGemmWorkspace::set_grid`] on CUDA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmGrid {
    /// One CTA (or cluster member) per SM, each looping over tiles (CUTLASS's persistent
    /// scheduler): the fastest alone, but it holds every SM until its last tile, so a kernel
    /// queued on another stream meanwhile waits for the whole GEMM. The default.
    #[default]
    Persistent,
    /// Persistent on at most this many SMs, leaving the others to kernels on other streams
    /// (DeepGEMM's `num_sms` beside DeepEP's transfers), also when those are not running.
    PersistentOn(u32),
    /// About one CTA per output tile (an upper bound of the tiles the shape can have), which
    /// the hardware places as SMs free up: between two tiles, the blocks of a kernel on a
    /// higher-priority stream (the communication streams) take the SMs they need and give them
    /// back when they end, so a transfer and the GEMM share the GPU only while both run.
    PerTile,
}

impl GemmTiles {
    /// Output tile rows and columns, and the cluster's CTAs along M and N, of a CUTLASS
    /// configuration (`None` for [`GemmTiles::Gemv`]; [`GemmTiles::Auto`] must be resolved).
    pub fn tile_and_cluster(self) -> Option<((usize, usize), (usize, usize))> {
        match self {
            GemmTiles::Wide => Some(((128, 256), (1, 2))),
            GemmTiles::WideM => Some(((128, 256), (2, 1))),
            GemmTiles::Narrow => Some(((64, 128), (1, 2))),
            GemmTiles::Auto | GemmTiles::Gemv => None,
        }
    }

    /// An upper bound of the output tiles (counted as the scheduler pads them to whole
    /// clusters) of a grouped GEMM of `shape` with these tiles: every group may end in a
    /// partial tile along M. `None` for [`GemmTiles::Gemv`] and unresolved `Auto`.
    pub fn max_tiles(self, shape: &GroupedGemmShape) -> Option<usize> {
        let ((tm, tn), (cm, cn)) = self.tile_and_cluster()?;
        let m_tiles = shape.rows.div_ceil(tm) + shape.groups * cm;
        let n_tiles = shape.n.div_ceil(tn).next_multiple_of(cn);
        Some(m_tiles * n_tiles)
    }
}

/// Valid rows a [`GemmTiles::Gemv`] GEMM multiplies per pass over a group's weights (more rows
/// take more passes).
pub const GEMV_ROWS_PER_PASS: usize = 2;

/// Most DRAM bandwidth per SM (GB/s, peak) at which [`GemmTiles::for_masked_rows`] picks the
/// tile-less kernel for a few rows per block. Its register loads keep a fixed number of bytes
/// in flight per SM, the 64 x 128 tiles' TMA pipeline more: at one decode token the MoE layer
/// measured faster with it on GPUs below this bandwidth per SM and with the tiles above it
/// (`docs/benchmarks.md`, "Grouped GEMM of the experts" and "The MoE layer (one GPU)").
pub const GEMV_MAX_GBS_PER_SM: f64 = 30.0;

impl GemmTiles {
    /// The configuration for a masked GEMM whose blocks are expected to hold at most
    /// `expected_rows` valid rows each (e.g. a low-latency step's tokens per rank times the
    /// ranks) on a GPU of `peak_gbs_per_sm` GB/s of DRAM bandwidth per SM:
    /// [`GemmTiles::Gemv`] up to [`GEMV_ROWS_PER_PASS`] rows on GPUs of at most
    /// [`GEMV_MAX_GBS_PER_SM`], else `Auto` (the 64 x 128 tiles). Any counts the layout allows
    /// give the right result either way; this only picks the faster kernel
    /// ([`GemmTiles::for_masked_rows_cuda`] reads the bandwidth from the device).
    pub fn for_masked_rows(expected_rows: usize, peak_gbs_per_sm: f64) -> GemmTiles {
        if expected_rows <= GEMV_ROWS_PER_PASS && peak_gbs_per_sm <= GEMV_MAX_GBS_PER_SM {
            GemmTiles::Gemv
        } else {
            GemmTiles::Auto
        }
    }

    /// The configuration `Auto` picks for `layout` with `rows` rows over `groups` groups.
    pub fn resolve(self, layout: GroupLayout, rows: usize, groups: usize) -> GemmTiles {
        match self {
            GemmTiles::Auto => match layout {
                GroupLayout::Masked { .. } => GemmTiles::Narrow,
                GroupLayout::Contiguous { .. } if rows >= 512 * groups.max(1) => GemmTiles::WideM,
                GroupLayout::Contiguous { .. } => GemmTiles::Wide,
            },
            other => other,
        }
    }
}

/// The sizes of one grouped GEMM: `D [rows, n] = A [rows, k] x B [groups, n, k]^T` per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedGemmShape {
    /// Number of groups `G`.
    pub groups: usize,
    /// Rows of `A` and `D` (masked: `groups * m_max`).
    pub rows: usize,
    /// Output columns `N`.
    pub n: usize,
    /// Reduction length `K`.
    pub k: usize,
    /// Where each group's rows are.
    pub layout: GroupLayout,
}

impl GroupedGemmShape {
    /// Checks the sizes: the layout, and `n` and `k` positive multiples of 8 (rows of 16 bytes,
    /// as the TMA loads and stores need).
    pub fn check(&self) -> Result<()> {
        self.layout.check(self.groups, self.rows)?;
        for (arg, v) in [("n", self.n), ("k", self.k)] {
            if v == 0 || v % 8 != 0 || v > i32::MAX as usize {
                return Err(Error::invalid(
                    arg,
                    v,
                    "must be a positive multiple of 8 (16-byte bf16 rows) below 2^31",
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
    fn masked_tiles_follow_rows_and_bandwidth() {
        // An H100 SXM (3352 GB/s) and an H200 (4915 GB/s), 132 SMs each.
        let (h100, h200) = (3352.0 / 132.0, 4915.0 / 132.0);
        assert_eq!(GemmTiles::for_masked_rows(1, h100), GemmTiles::Gemv);
        assert_eq!(
            GemmTiles::for_masked_rows(GEMV_ROWS_PER_PASS, h100),
            GemmTiles::Gemv
        );
        assert_eq!(GemmTiles::for_masked_rows(3, h100), GemmTiles::Auto);
        assert_eq!(GemmTiles::for_masked_rows(1, h200), GemmTiles::Auto);
        // A driver that reports no memory clock: the tile-less kernel, as before.
        assert_eq!(GemmTiles::for_masked_rows(1, 0.0), GemmTiles::Gemv);
        let masked = GroupLayout::Masked { m_max: 128 };
        assert_eq!(
            GemmTiles::for_masked_rows(1, h200).resolve(masked, 256 * 128, 256),
            GemmTiles::Narrow
        );
    }

    #[test]
    fn max_tiles_bounds_every_split_of_the_rows() {
        let shape = |groups, rows, n| GroupedGemmShape {
            groups,
            rows,
            n,
            k: 64,
            layout: GroupLayout::Contiguous { alignment: 1 },
        };
        // 300 rows in 3 groups: at most 3 + 3 tiles of 128 rows (every group ending in a
        // partial one), 512 columns in 2 tiles of 256 (a whole cluster of 2 along N).
        assert_eq!(GemmTiles::Wide.max_tiles(&shape(3, 300, 512)), Some(6 * 2));
        // Clusters along M: 2 more M tiles per group; 300 columns -> 2 N tiles.
        assert_eq!(GemmTiles::WideM.max_tiles(&shape(3, 300, 300)), Some(9 * 2));
        // 64 x 128 tiles; 136 columns -> 2 N tiles, already a whole cluster.
        assert_eq!(
            GemmTiles::Narrow.max_tiles(&shape(2, 100, 136)),
            Some(4 * 2)
        );
        // One N tile rounds up to the cluster of 2.
        assert_eq!(GemmTiles::Wide.max_tiles(&shape(1, 128, 16)), Some(2 * 2));
        assert_eq!(GemmTiles::Gemv.max_tiles(&shape(1, 128, 16)), None);
        assert_eq!(GemmTiles::Auto.max_tiles(&shape(1, 128, 16)), None);
    }
}
