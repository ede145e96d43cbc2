// ep-kernels: host library (CUTLASS)
//
// The grouped block-scaled fp8 GEMM for few rows per expert (decode, masked blocks): 64 x 128
// tiles of K 128, two consumer warpgroups taking tiles in turn (ping-pong), clusters of two
// CTAs along N. See grouped_gemm_fp8_sm90.cuh.
#include "grouped_gemm_fp8_sm90.cuh"

EP_GROUPED_GEMM_FP8(narrow, 64, 128, 128, 1, 2,
                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
                    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, false, false)
