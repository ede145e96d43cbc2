// ep-kernels: host library (CUTLASS)
//
// The grouped block-scaled fp8 GEMM for many rows per expert (prefill, normal mode): 128 x 128
// tiles of K 128, two consumer warpgroups sharing each tile (cooperative) with their promotions
// overlapped, clusters of two CTAs along N that share the A tile by TMA multicast. See
// grouped_gemm_fp8_sm90.cuh.
#include "grouped_gemm_fp8_sm90.cuh"

EP_GROUPED_GEMM_FP8(wide, 128, 128, 128, 1, 2,
                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
                    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true, false)
