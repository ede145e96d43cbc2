// ep-kernels: host library (CUTLASS)
//
// The experts' first grouped GEMM with SwiGLU in its epilogue, for few rows per expert
// (low-latency mode): the tiles of grouped_bf16_narrow.cu, act = silu(gate) * up written
// straight from the accumulators. See swiglu_epilogue_sm90.cuh.
#include "grouped_gemm_sm90.cuh"

EP_GROUPED_GEMM_BF16(swiglu_narrow, 64, 128, 128, 1, 2,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, true)
