// ep-kernels: host library (CUTLASS)
//
// The grouped bf16 GEMM for few rows per expert (decode, low-latency mode): 64 x 128 tiles
// with a deep K pipeline, two consumer warpgroups alternating tiles (ping-pong) so that one
// tile's epilogue overlaps the next one's loads, clusters of two CTAs along N sharing A.
// See grouped_gemm_sm90.cuh.
#include "grouped_gemm_sm90.cuh"

EP_GROUPED_GEMM_BF16(narrow, 64, 128, 128, 1, 2,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, false)
