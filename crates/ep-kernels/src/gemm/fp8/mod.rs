//! Block-scaled FP8 grouped GEMMs of the routed experts, in DeepSeek-V3's recipe: e4m3
//! activations with one f32 scale per row per [`FP8_BLOCK`] channels (`1 x 128`, the format
//! the fp8 dispatch sends), e4m3 weights with one f32 scale per `128 x 128` block (a
//! checkpoint's `weight_scale_inv`, edge blocks partial), f32 accumulation, bf16 out.
//!
//! The layouts are those of [`super::GroupLayout`]; the scale tensors follow their operands
//! row for row, K-major:
//!
//! - `a` `[rows, k]` e4m3 with `sfa` `[rows, ceil(k / 128)]` f32;
//! - `b` `[groups, n, k]` e4m3 with `sfb` `[groups, ceil(n / 128), ceil(k / 128)]` f32;
//! - `d` `[rows, n]` bf16.
//!
//! The experts' gate_up weight holds their `gate_proj` and `up_proj` rows in
//! [`FP8_GATE_UP_BLOCK`]-row blocks in turn (`[2I, H]`, `I` a multiple of 128: every weight
//! scale block is all gate or all up). On the contiguous layout with fewer than
//! [`SWIGLU_EPILOGUE_MAX_ROWS_PER_GROUP`] rows per expert on average the gate_up GEMM runs
//! SwiGLU and the down GEMM's 1 x 128 quantization in its epilogue
//! ([`grouped_gemm_swiglu_fp8`]: the two CTAs of a cluster compute a gate block's and its up
//! block's tiles of the same rows and swap halves through distributed shared memory);
//! elsewhere the GEMM writes the bf16 products and [`swiglu_quantize`] follows in one pass
//! ([`swiglu_in_epilogue`] says which).
//!
//! On CUDA (`cuda/`) the GEMMs are CUTLASS 3's ptr-array blockwise-scaling kernels for sm_90a,
//! the cooperative tiles with our own math loop that overlaps each k-tile's promotion with the
//! next k-tile's WGMMAs (`fp8/grouped_gemm_fp8_sm90.cuh`, `fp8/overlapped_promotion_sm90.cuh`,
//! `quantize_rows.cu`, `dequantize.cu`); the host twins
//! ([`host`]) compute the same functions in f32 from the dequantized operands (DeepSeek's
//! `weight_dequant`) and are the CPU path.

pub mod host;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::*;

pub use host::{
    dequantize_rows, dequantize_weight, grouped_gemm_fp8, grouped_gemm_swiglu_fp8, quantize_rows,
    quantize_weight, swiglu_quantize, HostExtraGroupsFp8, HostFp8,
};

use crate::error::{Error, Result};

/// Channels of K sharing one scale, in activations and weights, and rows of a weight sharing
/// one scale.
pub const FP8_BLOCK: usize = 128;

/// Rows of `gate_proj`, then of `up_proj`, in turn in the fp8 experts' gate_up weight (one
/// weight scale block each): the layout the fused gate_up GEMM pairs its clusters' tiles by.
pub const FP8_GATE_UP_BLOCK: usize = FP8_BLOCK;

/// Average rows per expert from which the contiguous gate_up GEMM writes its products for the
/// one-pass SwiGLU instead of running SwiGLU in its epilogue: the swap between the two CTAs of
/// a cluster idles the tensor cores for a while every tile, which the pass's memory traffic
/// outweighs only at fewer rows (docs/benchmarks.md, "Block-scaled FP8 experts").
pub const SWIGLU_EPILOGUE_MAX_ROWS_PER_GROUP: usize = 512;

/// Whether the experts' gate_up GEMM over `rows` rows of `groups` groups in `layout` runs
/// SwiGLU and the act quantization in its epilogue ([`grouped_gemm_swiglu_fp8`]); otherwise
/// the plain GEMM and [`swiglu_quantize`] run.
pub fn swiglu_in_epilogue(layout: super::GroupLayout, rows: usize, groups: usize) -> bool {
    matches!(layout, super::GroupLayout::Contiguous { .. })
        && rows < SWIGLU_EPILOGUE_MAX_ROWS_PER_GROUP * groups.max(1)
}

/// `(rows, cols)` of the scales of a `[n, k]` weight whose scale blocks are `scale_rows x 128`.
pub fn weight_scale_dims(n: usize, k: usize, scale_rows: usize) -> (usize, usize) {
    (n.div_ceil(scale_rows), k.div_ceil(FP8_BLOCK))
}

/// Scales per row of a `[rows, k]` activation (`ceil(k / 128)`).
pub fn row_scale_cols(k: usize) -> usize {
    k.div_ceil(FP8_BLOCK)
}

/// Channels of `k` the tile-less fp8 GEMV ([`super::GemmTiles::Gemv`], `grouped_gemv_fp8.cu`)
/// reads per lane quad and step: its `k` must be a multiple of this.
pub const GEMV_K_MULTIPLE: usize = 64;

/// Valid rows the tile-less fp8 GEMV multiplies in one pass over a group's weights (the eight
/// columns of its tensor-core MMA; more rows take more passes).
pub const GEMV_ROWS_PER_PASS: usize = 8;

/// Most 128-column blocks of act (`n / 256` of a gate_up weight `[n, k]`, so `I` up to 16384)
/// the tile-less GEMV with SwiGLU fused ([`super::GemmTiles::Gemv`] in
/// `grouped_gemv_swiglu_fp8_cuda`) takes: its workspace holds that many arrival counters a
/// group.
pub const GEMV_SWIGLU_MAX_ACT_BLOCKS: usize = 128;

/// Warps of a block of the tile-less fp8 GEMV (`kThreads / 32` in `grouped_gemv_fp8.cu`): the
/// most that can share one unit's K.
pub const GEMV_WARPS_PER_BLOCK: u64 = 8;

/// Warps sharing one unit's K in the tile-less fp8 GEMV when `units` units of 16 weight rows
/// are left after its whole rounds (the grid's `warps` warps each taking one unit a round) and
/// K holds `k_blocks` scale blocks: doubled (up to [`GEMV_WARPS_PER_BLOCK`]) while every unit's
/// team still fits on the grid and each warp keeps at least two pairs of scale blocks. The
/// kernel chooses it on the device from the units its counts make (`tail_split` in
/// `grouped_gemv_fp8.cu`, the same rule); this mirror states and tests the rule.
pub fn gemv_tail_split(units: u64, k_blocks: u64, warps: u64) -> u32 {
    let mut split = 1u64;
    while split < GEMV_WARPS_PER_BLOCK && units * split * 2 <= warps && k_blocks >= 2 * split * 4 {
        split *= 2;
    }
    split as u32
}

/// Whether the tile-less fp8 GEMV with SwiGLU fused (`grouped_gemv_swiglu_fp8_cuda`) takes a
/// gate_up weight of `n = 2I` rows: gate and up blocks of [`FP8_GATE_UP_BLOCK`] rows in turn, at
/// most [`GEMV_SWIGLU_MAX_ACT_BLOCKS`] of act.
pub fn gemv_swiglu_takes(n: usize) -> bool {
    let pair = 2 * FP8_GATE_UP_BLOCK;
    n > 0 && n % pair == 0 && n / pair <= GEMV_SWIGLU_MAX_ACT_BLOCKS
}

/// Whether the tile-less fp8 GEMV takes GEMMs of reduction lengths `ks`.
pub fn gemv_takes(ks: &[usize]) -> bool {
    ks.iter().all(|k| k % GEMV_K_MULTIPLE == 0)
}

/// The configuration for masked fp8 GEMMs of reduction lengths `ks` (the experts' `H` and `I`)
/// whose blocks hold at most `expected_rows` valid rows: [`super::GemmTiles::Gemv`] when one of
/// its passes covers them (the weights are then read once, with no tile padding) and it takes
/// the shapes, else `Auto` (the 64 x 128 tiles). Any counts the layout allows give the right
/// result either way; this only picks the faster kernel (`docs/benchmarks.md`, "Grouped GEMM of
/// the experts").
pub fn masked_tiles(expected_rows: usize, ks: &[usize]) -> super::GemmTiles {
    if expected_rows <= GEMV_ROWS_PER_PASS && gemv_takes(ks) {
        super::GemmTiles::Gemv
    } else {
        super::GemmTiles::Auto
    }
}

/// Checks the sizes of an fp8 GEMM on top of [`super::GroupedGemmShape::check`]: `k` and `n`
/// multiples of 16 (rows of 16 bytes of e4m3 for the TMA loads).
pub fn check_shape(shape: &super::GroupedGemmShape) -> Result<()> {
    shape.check()?;
    for (arg, v) in [("n", shape.n), ("k", shape.k)] {
        if v % 16 != 0 {
            return Err(Error::invalid(
                arg,
                v,
                "must be a multiple of 16 (16-byte e4m3 rows)",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swiglu_runs_in_the_epilogue_on_contiguous_groups_below_512_rows() {
        use super::super::GroupLayout;
        let contiguous = GroupLayout::Contiguous { alignment: 1 };
        assert!(swiglu_in_epilogue(contiguous, 256 * 128, 256));
        assert!(swiglu_in_epilogue(contiguous, 511 * 8, 8));
        assert!(!swiglu_in_epilogue(contiguous, 512 * 8, 8));
        assert!(!swiglu_in_epilogue(
            GroupLayout::Masked { m_max: 4 },
            1024,
            256
        ));
    }

    #[test]
    fn scale_shapes_round_partial_blocks_up() {
        assert_eq!(weight_scale_dims(576, 7168, 128), (5, 56));
        assert_eq!(weight_scale_dims(4096, 7168, 64), (64, 56));
        assert_eq!(row_scale_cols(2880), 23);
    }

    #[test]
    fn the_gemv_splits_k_only_over_the_units_a_round_leaves() {
        // H200: 132 SMs x 2 blocks x 8 warps.
        let warps = 132 * 2 * 8;
        // A prefill-sized step (256 groups of 448 units): whole rounds, then 256 * 448 % 2112
        // = 640 units, in teams of 2 warps.
        assert_eq!(gemv_tail_split(256 * 448 % warps, 56, warps), 2);
        // One token of DeepSeek-V3 with its shared expert: gate_up (9 x 256 units) leaves 192
        // after a round, each shared by 8 warps; down (9 x 448) leaves 1920, one warp each.
        assert_eq!(gemv_tail_split(9 * 256 - warps, 56, warps), 8);
        assert_eq!(gemv_tail_split(9 * 448 - warps, 16, warps), 1);
        // DeepSeek-V3's o_proj (448 units, K 16384), q_a_proj (96, K 7168), q_b_proj (1536):
        // no whole round.
        assert_eq!(gemv_tail_split(448, 128, warps), 4);
        assert_eq!(gemv_tail_split(96, 56, warps), 8);
        assert_eq!(gemv_tail_split(1536, 12, warps), 1);
        // A short K bounds it: every warp keeps two pairs of scale blocks.
        assert_eq!(gemv_tail_split(36, 8, warps), 2);
        assert_eq!(gemv_tail_split(36, 2, warps), 1);
    }

    #[test]
    fn the_fused_swiglu_gemv_takes_whole_gate_and_up_blocks() {
        assert!(gemv_swiglu_takes(4096));
        assert!(gemv_swiglu_takes(256));
        assert!(!gemv_swiglu_takes(128));
        assert!(!gemv_swiglu_takes(5760)); // gpt-oss: I = 2880
        assert!(gemv_swiglu_takes(GEMV_SWIGLU_MAX_ACT_BLOCKS * 256));
        assert!(!gemv_swiglu_takes((GEMV_SWIGLU_MAX_ACT_BLOCKS + 1) * 256));
        assert!(!gemv_swiglu_takes(0));
    }

    #[test]
    fn the_gemv_takes_one_pass_of_rows_and_whole_k_steps() {
        use crate::gemm::GemmTiles;
        assert_eq!(masked_tiles(1, &[7168, 2048]), GemmTiles::Gemv);
        assert_eq!(
            masked_tiles(GEMV_ROWS_PER_PASS, &[2880, 2880]),
            GemmTiles::Gemv
        );
        assert_eq!(
            masked_tiles(GEMV_ROWS_PER_PASS + 1, &[7168, 2048]),
            GemmTiles::Auto
        );
        assert_eq!(masked_tiles(1, &[7168, 2080]), GemmTiles::Auto);
    }
}
