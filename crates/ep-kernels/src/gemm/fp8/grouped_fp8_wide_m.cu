// ep-kernels: host library (CUTLASS)
//
// The grouped block-scaled fp8 GEMM for groups of several M tiles each (prefill with many rows
// per expert): 128 x 128 tiles of K 128, two consumer warpgroups sharing each tile
// (cooperative) with their promotions overlapped, clusters of two CTAs along M that share the
// B tile (the weights) by TMA multicast. See grouped_gemm_fp8_sm90.cuh.
#include "grouped_gemm_fp8_sm90.cuh"

EP_GROUPED_GEMM_FP8(wide_m, 128, 128, 128, 2, 1,
                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
                    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true)
