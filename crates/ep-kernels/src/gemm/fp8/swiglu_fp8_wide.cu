// ep-kernels: host library (CUTLASS)
//
// The fp8 experts' gate_up GEMM for many rows per expert (prefill, normal mode) with SwiGLU and
// the down GEMM's 1 x 128 quantization in its epilogue: the tiles of grouped_fp8_wide.cu (128 x
// 128 cooperative, promotions overlapped, clusters of two CTAs along N, which here are the gate
// and the up tile of the same rows). See swiglu_quantize_epilogue_sm90.cuh.
#include "grouped_gemm_fp8_sm90.cuh"

EP_GROUPED_GEMM_FP8(swiglu_wide, 128, 128, 128, 1, 2,
                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
                    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, true, true)
