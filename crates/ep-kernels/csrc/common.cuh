// Shared device helpers of the ep-kernels CUDA sources (every `src/**/*.cu` is compiled with
// `-I csrc`, so `#include "common.cuh"` works from any mode folder).
//
// Contents:
//   * fixed-width types, EP_* attribute macros, a device assert that traps;
//   * bf16 / fp8 e4m3 conversions with the exact rounding the Rust host twins use;
//   * memory-model helpers for flags shared across GPUs: acquire/release/relaxed/volatile
//     loads and stores at GPU and system scope, non-coherent streaming loads, fences, atomics;
//   * Hopper 1-D bulk copies (TMA) with mbarriers and bulk async-groups;
//   * timeouts measured with the `%globaltimer` nanosecond clock;
//   * warp reductions.
//
// Host/device layout contract: every kernel takes ONE by-value `struct ...Params` that mirrors
// a `#[repr(C)]` Rust struct field by field; pointers are 8 bytes on both sides. Each .cu file
// pins the size of its params with `EP_CHECK_PARAMS_SIZE`, and the Rust side asserts the same
// number at compile time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define EP_DEVICE __device__ __forceinline__
#define EP_HOST_DEVICE __host__ __device__ __forceinline__
#define EP_KERNEL extern "C" __global__

#define EP_CHECK_PARAMS_SIZE(type, bytes)                                                       \
    static_assert(sizeof(type) == (bytes), #type " must match its #[repr(C)] Rust mirror")

// Traps (the launch then fails with CUDA_ERROR_ILLEGAL_INSTRUCTION / LAUNCH_FAILED) so that a
// broken invariant is never silently ignored. Compiled in always: checks are cheap and rare.
#define EP_DEVICE_ASSERT(cond)                                                                  \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            printf("ep-kernels: assertion `%s` failed at %s:%d\n", #cond, __FILE__, __LINE__);   \
            asm volatile("trap;");                                                               \
        }                                                                                        \
    } while (0)

namespace ep {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Hidden channels sharing one fp8 scale (Rust: `ep_kernels::FP8_GROUP`).
constexpr int kFp8Group = 128;
// Largest finite e4m3 value (Rust: `fp8::E4M3_MAX`).
constexpr float kE4m3Max = 448.0f;
// Smallest amax used for a scale (Rust: `fp8::AMAX_MIN`).
constexpr float kAmaxMin = 1e-4f;

template <typename T>
EP_HOST_DEVICE T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

// ------------------------------------------------------------------------------------------
// bf16 / fp8
// ------------------------------------------------------------------------------------------

EP_DEVICE float bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even, as `half::bf16::from_f32`.
EP_DEVICE __nv_bfloat16 f32_to_bf16(float v) { return __float2bfloat16_rn(v); }

// 8 bf16 values from 16 aligned bytes, as f32.
EP_DEVICE void load_bf16x8(const __nv_bfloat16* at, float (&v)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(at);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&words[i]);
        v[2 * i] = __low2float(pair);
        v[2 * i + 1] = __high2float(pair);
    }
}

// f32 -> e4m3 byte: round to nearest even, saturate finite values to +-448
// (`float8::F8E4M3::from_f32` does the same for every finite input).
EP_DEVICE uint8_t f32_to_e4m3(float v) {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// e4m3 byte -> f32, exact.
EP_DEVICE float e4m3_to_f32(uint8_t v) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
    return __half2float(__half(h));
}

// Rounds a positive normal f32 up to a power of two; bit-level, identical to the Rust
// `fp8::round_scale_ue8m0`.
EP_DEVICE float round_scale_ue8m0(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    uint32_t exp = (bits >> 23) & 0xffu;
    if ((bits & 0x7fffffu) != 0) {
        exp += 1;
    }
    return __uint_as_float(exp << 23);
}

// ------------------------------------------------------------------------------------------
// Memory model. `gpu` scope: other blocks of this GPU; `sys` scope: peers over NVLink/PCIe
// and the host. Use release stores / acquire loads for flags that publish data, relaxed or
// volatile for polling counters whose data is published by a separate fence.
// ------------------------------------------------------------------------------------------

EP_DEVICE int ld_acquire_sys(const int* ptr) {
    int v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

EP_DEVICE int ld_acquire_gpu(const int* ptr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

EP_DEVICE uint64_t ld_acquire_sys_u64(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

EP_DEVICE int ld_relaxed_sys(const int* ptr) {
    int v;
    asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

EP_DEVICE int ld_volatile(const int* ptr) {
    int v;
    asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

EP_DEVICE void st_release_sys(int* ptr, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

EP_DEVICE void st_release_gpu(int* ptr, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

EP_DEVICE void st_relaxed_sys_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

EP_DEVICE void st_relaxed_sys(int* ptr, int v) {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

EP_DEVICE void st_volatile(int* ptr, int v) {
    asm volatile("st.volatile.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Atomic add with release semantics at system scope; returns the old value.
EP_DEVICE int atomic_add_release_sys(int* ptr, int v) {
    int old;
    asm volatile("atom.release.sys.global.add.s32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(ptr), "r"(v)
                 : "memory");
    return old;
}

// Atomic add with release semantics at GPU scope; returns the old value.
EP_DEVICE int atomic_add_release_gpu(int* ptr, int v) {
    int old;
    asm volatile("atom.release.gpu.global.add.s32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(ptr), "r"(v)
                 : "memory");
    return old;
}

// Relaxed atomic add at system scope (counters read after a separate acquire).
EP_DEVICE int atomic_add_relaxed_sys(int* ptr, int v) {
    int old;
    asm volatile("atom.relaxed.sys.global.add.s32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(ptr), "r"(v)
                 : "memory");
    return old;
}

EP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
EP_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// ------------------------------------------------------------------------------------------
// Loads of data, by who may write it (the cache policy follows):
// - ld_nc_no_alloc: no one writes it during the kernel (non-coherent path, no L1 allocation);
// - ld_peer_no_alloc: another GPU wrote it before an acquire and a barrier of this block that
//   order it (weak, coherent, no L1 allocation);
// - ld_cg_*: peers write it during this kernel (L2, the coherence point for NVLink writes,
//   never a possibly stale L1 line).
// ------------------------------------------------------------------------------------------

// Streaming read of data no one writes during the kernel: non-coherent path, no L1 allocation.
EP_DEVICE int4 ld_nc_no_alloc(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

// The same for weights streamed by the GEMVs (a lane quad reading a row's consecutive 16-byte
// vectors): the L2 fetches the whole 128-byte line with the first request (docs/design.md).
EP_DEVICE int4 ld_nc_no_alloc_l2_128(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

// Non-allocating weak load of data another GPU wrote (ordered by a prior acquire + barrier).
EP_DEVICE int4 ld_peer_no_alloc(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr)
                 : "memory");
    return v;
}

// A 16-byte load of data that peers wrote during this kernel: L2, never a stale L1 line.
EP_DEVICE int4 ld_cg_v4(const uint8_t* ptr) {
    int4 v;
    asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr)
                 : "memory");
    return v;
}

// A 4-byte load of data that peers wrote during this kernel (L2).
EP_DEVICE int ld_cg_i32(const uint8_t* ptr) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

// An f32 load of data that peers wrote during this kernel (L2).
EP_DEVICE float ld_cg_f32(const uint8_t* ptr) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr) : "memory");
    return v;
}

// Streaming write that should not stay in L1.
EP_DEVICE void st_no_alloc(int4* ptr, int4 v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// ------------------------------------------------------------------------------------------
// Hopper bulk copies (1-D TMA) and mbarriers. Shared-memory operands are 32-bit `shared::cta`
// addresses (`smem_addr`). Bulk copies need 16-byte aligned addresses and sizes that are
// multiples of 16. A load completes on an mbarrier (transaction bytes); stores are tracked
// per thread with bulk async-groups (commit / wait_group).
// ------------------------------------------------------------------------------------------

EP_DEVICE uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Dynamic shared memory of this launch, in bytes.
EP_DEVICE uint32_t dynamic_smem_bytes() {
    uint32_t v;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

EP_DEVICE void mbarrier_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes mbarrier inits (generic proxy) visible to the async proxy / other threads.
EP_DEVICE void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses with its async-proxy ones.
EP_DEVICE void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Orders this thread's generic-proxy global-memory accesses with its async-proxy ones.
EP_DEVICE void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// One arrival that also expects `bytes` more transaction bytes in the current phase.
EP_DEVICE void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}

// Spins until the phase with parity `parity` of the mbarrier has completed.
EP_DEVICE void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (done == 0);
}

// Bulk load global -> shared; completes `bytes` transaction bytes on mbarrier `bar`.
EP_DEVICE void bulk_load(uint32_t dst_smem, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            dst_smem),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// Bulk store shared -> global (may be a peer's memory mapped over NVLink), in the current
// bulk async-group.
EP_DEVICE void bulk_store(void* dst, uint32_t src_smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(src_smem), "r"(bytes)
                 : "memory");
}

EP_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's bulk async-groups still read their shared memory.
template <int N>
EP_DEVICE void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until at most N of this thread's bulk async-groups are incomplete (writes done).
template <int N>
EP_DEVICE void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------------------------------
// Timeouts
// ------------------------------------------------------------------------------------------

// Nanoseconds from the GPU's global timer (same clock on every SM of one GPU).
EP_DEVICE uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A point in time after which a wait gives up. `timeout_ns == 0` means "never".
struct Deadline {
    uint64_t end_ns;

    EP_DEVICE static Deadline after(uint64_t timeout_ns) {
        Deadline d;
        d.end_ns = timeout_ns == 0 ? UINT64_MAX : globaltimer_ns() + timeout_ns;
        return d;
    }

    EP_DEVICE bool expired() const { return globaltimer_ns() >= end_ns; }
};

// Spins until `*flag` (acquire, sys scope) satisfies `pred`, or the deadline passes.
// Returns the last value read and sets `*timed_out`.
template <typename Pred>
EP_DEVICE int wait_flag_sys(const int* flag, Pred pred, const Deadline& deadline,
                            bool* timed_out) {
    int v = ld_acquire_sys(flag);
    while (!pred(v)) {
        if (deadline.expired()) {
            *timed_out = true;
            return v;
        }
        v = ld_acquire_sys(flag);
    }
    *timed_out = false;
    return v;
}

// ------------------------------------------------------------------------------------------
// Warp helpers
// ------------------------------------------------------------------------------------------

EP_DEVICE int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }
EP_DEVICE int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }

EP_DEVICE float warp_reduce_max(float v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    }
    return v;
}

EP_DEVICE float warp_reduce_sum(float v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(kFullMask, v, offset);
    }
    return v;
}

EP_DEVICE int warp_reduce_sum(int v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(kFullMask, v, offset);
    }
    return v;
}

}  // namespace ep
