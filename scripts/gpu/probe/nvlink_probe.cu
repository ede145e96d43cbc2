// nvlink_probe: what the NVLink links between the GPUs of one node carry, per transfer method.
//
// One process drives every visible GPU (peer access on between all pairs). Each GPU moves
// `--mib` MiB to (or from) each of its peers at the same time, the way an all-to-all does, and
// the probe prints the off-GPU bandwidth per GPU and the figure DeepEP-style benchmarks would
// count for an all-to-all of that shape (off-GPU bytes * R / (R - 1), local share included).
//
// Methods: copy engines (push: the sender's stream copies; pull: the receiver's), SM stores
// (16-byte vector loads then stores, one warp group per channel), and TMA bulk copies
// (cp.async.bulk global -> shared -> global, one thread per block driving a ring of stages),
// each pushing or pulling, and the hybrids (copy engines for one peer, SMs for the others).
//
// Build: scripts/gpu/probe/build.sh (nvcc, sm_90a; no Rust). Run on the GPU machine:
// `.gpu/probe/nvlink_probe --mib 64`. Results for 4 x H200: docs/benchmarks.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e_ = (x);                                                               \
        if (e_ != cudaSuccess) {                                                            \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            std::exit(1);                                                                   \
        }                                                                                   \
    } while (0)

constexpr int kMaxJobs = 8;

struct Jobs {
    const char* src[kMaxJobs];
    char* dst[kMaxJobs];
    int n;
    size_t bytes;  // per job, multiple of 16
};

// SM copy: blocks are split evenly over the jobs; each block walks its job's bytes in a
// grid-stride loop with U independent 16-byte loads in flight per thread.
template <int U>
__global__ void sm_copy(Jobs jobs) {
    const int job = blockIdx.x % jobs.n;
    const int blk = blockIdx.x / jobs.n;
    const int nblk = (gridDim.x - job + jobs.n - 1) / jobs.n;
    const int4* src = reinterpret_cast<const int4*>(jobs.src[job]);
    int4* dst = reinterpret_cast<int4*>(jobs.dst[job]);
    const size_t n16 = jobs.bytes / 16;
    const size_t stride = size_t(nblk) * blockDim.x;
    size_t i = size_t(blk) * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n16; i += U * stride) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < U; ++u) dst[i + u * stride] = v[u];
    }
    for (; i < n16; i += stride) dst[i] = src[i];
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// TMA copy: one thread per block; a ring of `kStages` shared-memory stages of `chunk` bytes.
// Loads run up to kStages chunks ahead of the stores.
constexpr int kStages = 4;
__global__ void tma_copy(Jobs jobs, unsigned chunk) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) unsigned long long bar[kStages];
    if (threadIdx.x != 0) return;
    const int job = blockIdx.x % jobs.n;
    const int blk = blockIdx.x / jobs.n;
    const int nblk = (gridDim.x - job + jobs.n - 1) / jobs.n;
    // The block's contiguous share of the job, in whole chunks (the last one shorter).
    const size_t per = ((jobs.bytes / nblk + chunk - 1) / chunk) * chunk;
    const size_t lo = std::min(jobs.bytes, per * blk);
    const size_t hi = std::min(jobs.bytes, lo + per);
    const int n = int((hi - lo + chunk - 1) / chunk);
    for (int s = 0; s < kStages; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    auto load = [&](int k) {
        const int s = k % kStages;
        const size_t off = lo + size_t(k) * chunk;
        const unsigned len = unsigned(std::min<size_t>(chunk, hi - off));
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar[s])),
                     "r"(len)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_u32(smem + size_t(s) * chunk)),
            "l"(jobs.src[job] + off), "r"(len), "r"(smem_u32(&bar[s]))
            : "memory");
    };
    for (int k = 0; k < n && k < kStages; ++k) load(k);
    for (int k = 0; k < n; ++k) {
        const int s = k % kStages;
        const unsigned parity = (k / kStages) & 1;
        unsigned done = 0;
        while (!done) {
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(smem_u32(&bar[s])), "r"(parity)
                : "memory");
        }
        const size_t off = lo + size_t(k) * chunk;
        const unsigned len = unsigned(std::min<size_t>(chunk, hi - off));
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(jobs.dst[job] + off),
                     "r"(smem_u32(smem + size_t(s) * chunk)), "r"(len)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (k + kStages < n) {
            // The stage is reused by load k + kStages: its store must have read the stage.
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            load(k + kStages);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Gpu {
    int dev;
    char* src;  // [R][bytes]: block p goes to peer p
    char* dst;  // [R][bytes]: block p came from peer p
    std::vector<cudaStream_t> streams;  // one per peer, plus one for kernels (last)
};

static int R;
static size_t B;
static std::vector<Gpu> gpus;

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Runs `launch(g)` on every GPU at once, `iters` times after 2 warm-ups; median wall time.
static double timed(const std::function<void(Gpu&)>& launch, int iters = 7) {
    std::vector<double> t;
    for (int it = 0; it < iters + 2; ++it) {
        for (auto& g : gpus) { CK(cudaSetDevice(g.dev)); CK(cudaDeviceSynchronize()); }
        const double t0 = now_us();
        for (auto& g : gpus) { CK(cudaSetDevice(g.dev)); launch(g); }
        for (auto& g : gpus) { CK(cudaSetDevice(g.dev)); CK(cudaDeviceSynchronize()); }
        if (it >= 2) t.push_back(now_us() - t0);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static void report(const char* name, int blocks, double us, int peers_per_gpu) {
    const double off = double(B) * peers_per_gpu;  // off-GPU bytes per GPU
    const double gbs = off / us / 1e3;
    std::printf("%-26s blocks %3d  %9.1f us  off-GPU %6.1f GB/s per GPU  counted-EP%d %6.1f GB/s\n", name,
                blocks, us, gbs, R, gbs * R / (R - 1));
    std::fflush(stdout);
}

// Peers of g: every other GPU; `partner_only` keeps g ^ 1, `others_only` drops it.
static std::vector<int> peers_of(int g, int which) {
    std::vector<int> p;
    for (int q = 0; q < R; ++q) {
        if (q == g) continue;
        if (which == 1 && q != (g ^ 1)) continue;
        if (which == 2 && q == (g ^ 1)) continue;
        p.push_back(q);
    }
    return p;
}

static void ce(Gpu& g, bool push, int which, int pieces) {
    for (int q : peers_of(g.dev, which)) {
        cudaStream_t s = g.streams[q];
        const size_t piece = B / pieces;
        for (int k = 0; k < pieces; ++k) {
            const size_t o = size_t(k) * piece;
            if (push)
                CK(cudaMemcpyAsync(gpus[q].dst + size_t(g.dev) * B + o, g.src + size_t(q) * B + o, piece,
                                   cudaMemcpyDefault, s));
            else
                CK(cudaMemcpyAsync(g.dst + size_t(q) * B + o, gpus[q].src + size_t(g.dev) * B + o, piece,
                                   cudaMemcpyDefault, s));
        }
    }
}

static Jobs jobs_for(Gpu& g, bool push, int which) {
    Jobs j{};
    j.bytes = B;
    for (int q : peers_of(g.dev, which)) {
        j.src[j.n] = push ? g.src + size_t(q) * B : gpus[q].src + size_t(g.dev) * B;
        j.dst[j.n] = push ? gpus[q].dst + size_t(g.dev) * B : g.dst + size_t(q) * B;
        ++j.n;
    }
    return j;
}

static void sm(Gpu& g, bool push, int which, int blocks, int threads) {
    sm_copy<4><<<blocks, threads, 0, g.streams[R]>>>(jobs_for(g, push, which));
    CK(cudaGetLastError());
}

static void tma(Gpu& g, bool push, int which, int blocks, unsigned chunk) {
    tma_copy<<<blocks, 32, kStages * chunk, g.streams[R]>>>(jobs_for(g, push, which), chunk);
    CK(cudaGetLastError());
}

// Checks that every dst block holds what its source sent (a byte pattern per (from, to)).
static void verify(const char* name, int which) {
    for (auto& g : gpus) {
        CK(cudaSetDevice(g.dev));
        for (int q : peers_of(g.dev, which)) {
            std::vector<unsigned char> h(4096);
            for (size_t o : {size_t(0), B / 2, B - 4096}) {
                CK(cudaMemcpy(h.data(), g.dst + size_t(q) * B + o, 4096, cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < 4096; ++i) {
                    const unsigned char want = (unsigned char)(q * 16 + g.dev + (o + i) * 7);
                    if (h[i] != want) {
                        std::printf("VERIFY FAIL %s: gpu %d from %d at %zu\n", name, g.dev, q, o + i);
                        std::exit(2);
                    }
                }
            }
            CK(cudaMemset(g.dst + size_t(q) * B, 0xAB, B));
        }
    }
}

__global__ void fill(unsigned char* p, size_t n, int from, int to) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        p[i] = (unsigned char)(from * 16 + to + i * 7);
}

int main(int argc, char** argv) {
    size_t mib = 64;
    for (int i = 1; i + 1 < argc; ++i)
        if (!std::strcmp(argv[i], "--mib")) mib = std::strtoull(argv[i + 1], nullptr, 10);
    B = mib << 20;
    CK(cudaGetDeviceCount(&R));
    if (R < 2) { std::printf("needs 2 GPUs or more\n"); return 1; }
    gpus.resize(R);
    int sms = 0;
    for (int d = 0; d < R; ++d) {
        CK(cudaSetDevice(d));
        for (int q = 0; q < R; ++q)
            if (q != d) CK(cudaDeviceEnablePeerAccess(q, 0));
        gpus[d].dev = d;
        CK(cudaMalloc(&gpus[d].src, B * R));
        CK(cudaMalloc(&gpus[d].dst, B * R));
        CK(cudaMemset(gpus[d].dst, 0xAB, B * R));
        for (int q = 0; q < R; ++q) fill<<<264, 512>>>((unsigned char*)gpus[d].src + size_t(q) * B, B, d, q);
        gpus[d].streams.resize(R + 1);
        for (auto& s : gpus[d].streams) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaFuncSetAttribute(tma_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d));
        CK(cudaDeviceSynchronize());
    }
    std::printf("nvlink_probe: %d GPUs, %d SMs each, %zu MiB per (GPU, peer)\n", R, sms, mib);
    const int all = R - 1;
    const int others = R > 2 ? R - 2 : 0;

    auto ce_case = [&](const char* name, bool push, int which, int pieces, int np) {
        const double us = timed([&](Gpu& g) { ce(g, push, which, pieces); });
        verify(name, which);
        report(name, 0, us, np);
    };
    ce_case("ce-push-one-peer", true, 1, 1, 1);
    ce_case("ce-pull-one-peer", false, 1, 1, 1);
    ce_case("ce-push-all", true, 0, 1, all);
    ce_case("ce-pull-all", false, 0, 1, all);
    ce_case("ce-push-all-16pieces", true, 0, 16, all);
    ce_case("ce-pull-all-16pieces", false, 0, 16, all);

    for (int blocks : {8, 16, 24, 32, 48, 66, 132}) {
        for (int push = 1; push >= 0; --push) {
            const char* name = push ? "sm-push-all" : "sm-pull-all";
            const double us = timed([&](Gpu& g) { sm(g, push, 0, blocks, 512); });
            verify(name, 0);
            report(name, blocks, us, all);
        }
    }
    for (unsigned chunk : {16384u, 32768u}) {
        for (int blocks : {8, 16, 24, 32, 48, 66, 132}) {
            for (int push = 1; push >= 0; --push) {
                char name[64];
                std::snprintf(name, sizeof name, "tma-%s-all-%uk", push ? "push" : "pull", chunk / 1024);
                const double us = timed([&](Gpu& g) { tma(g, push, 0, blocks, chunk); });
                verify(name, 0);
                report(name, blocks, us, all);
            }
        }
    }
    for (int blocks : {8, 16, 24}) {
        const double us = timed([&](Gpu& g) { sm(g, true, 1, blocks, 512); });
        verify("sm-push-one-peer", 1);
        report("sm-push-one-peer", blocks, us, 1);
        const double ut = timed([&](Gpu& g) { tma(g, false, 1, blocks, 32768); });
        verify("tma-pull-one-peer", 1);
        report("tma-pull-one-peer", blocks, ut, 1);
    }
    if (others > 0) {
        for (int blocks : {8, 16, 24, 32}) {
            for (int push = 1; push >= 0; --push) {
                char name[64];
                std::snprintf(name, sizeof name, "hybrid-%s-ce1-sm", push ? "push" : "pull");
                double us = timed([&](Gpu& g) {
                    ce(g, push, 1, 1);
                    sm(g, push, 2, blocks, 512);
                });
                verify(name, 0);
                report(name, blocks, us, all);
                std::snprintf(name, sizeof name, "hybrid-%s-ce1-tma", push ? "push" : "pull");
                us = timed([&](Gpu& g) {
                    ce(g, push, 1, 1);
                    tma(g, push, 2, blocks, 32768);
                });
                verify(name, 0);
                report(name, blocks, us, all);
            }
        }
    }
    std::printf("done\n");
    return 0;
}
