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
// `.gpu/probe/nvlink_probe --mib 64` (`--pack-only`: only the local pack and the shared-peer
// cases). Results for 4 x H200: docs/benchmarks.md.
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

// Hopper 1-D bulk copies (one issuing thread): mbarriers, global -> shared loads that complete
// on an mbarrier, shared -> global stores tracked by bulk groups.
__device__ __forceinline__ void mbar_init(unsigned long long* bars, int n) {
    for (int s = 0; s < n; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, unsigned len, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(len) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(dst_smem)),
        "l"(src), "r"(len), "r"(smem_u32(bar))
        : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, unsigned len) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src_smem)),
                 "r"(len)
                 : "memory");
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
    mbar_init(bar, kStages);
    auto load = [&](int k) {
        const int s = k % kStages;
        const size_t off = lo + size_t(k) * chunk;
        const unsigned len = unsigned(std::min<size_t>(chunk, hi - off));
        bulk_load(smem + size_t(s) * chunk, jobs.src[job] + off, len, &bar[s]);
    };
    for (int k = 0; k < n && k < kStages; ++k) load(k);
    for (int k = 0; k < n; ++k) {
        const int s = k % kStages;
        mbar_wait(&bar[s], (k / kStages) & 1);
        const size_t off = lo + size_t(k) * chunk;
        const unsigned len = unsigned(std::min<size_t>(chunk, hi - off));
        bulk_store(jobs.dst[job] + off, smem + size_t(s) * chunk, len);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (k + kStages < n) {
            // The stage is reused by load k + kStages: its store must have read the stage.
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            load(k + kStages);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Pack (local memory only, the pattern of the copy-engine dispatch's pack): `rows` rows of
// `row` bytes are read once each and stored to `ndst` destination buffers at the same index.
struct PackJob {
    const char* src;
    char* dst[4];
    int ndst;
    int rows;
    unsigned row;  // bytes, multiple of 16
};

// Registers: one warp per row, U 16-byte loads in flight per lane, then the stores.
template <int U>
__global__ void pack_regs(PackJob j) {
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int n16 = int(j.row / 16);
    for (int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < j.rows; r += warps) {
        const int4* src = reinterpret_cast<const int4*>(j.src + size_t(r) * j.row);
        for (int base = 0; base < n16; base += 32 * U) {
            int4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = base + u * 32 + lane;
                if (i < n16) asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                                          : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                                          : "l"(src + i));
            }
            for (int d = 0; d < j.ndst; ++d) {
                int4* dst = reinterpret_cast<int4*>(j.dst[d] + size_t(r) * j.row);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int i = base + u * 32 + lane;
                    if (i < n16) dst[i] = v[u];
                }
            }
        }
    }
}

// TMA: one thread per block drives a ring of `stages` row-sized shared-memory stages; each row
// is loaded once (bulk load) and stored to every destination (bulk stores, one group per row).
__global__ void pack_tma(PackJob j, int stages) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) unsigned long long bar[32];
    if (threadIdx.x != 0) return;
    // Rows of this block: r = blockIdx.x + k * gridDim.x.
    const int n = (j.rows - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
    mbar_init(bar, stages);
    auto load = [&](int k) {
        const int s = k % stages;
        const size_t r = blockIdx.x + size_t(k) * gridDim.x;
        bulk_load(smem + size_t(s) * j.row, j.src + r * j.row, j.row, &bar[s]);
    };
    for (int k = 0; k < n && k < stages; ++k) load(k);
    for (int k = 0; k < n; ++k) {
        const int s = k % stages;
        mbar_wait(&bar[s], (k / stages) & 1);
        const size_t r = blockIdx.x + size_t(k) * gridDim.x;
        for (int d = 0; d < j.ndst; ++d) bulk_store(j.dst[d] + r * j.row, smem + size_t(s) * j.row, j.row);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        // Refill the previous row's stage once its stores have read it (one group may pend).
        if (k >= 1 && k - 1 + stages < n) {
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load(k - 1 + stages);
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
    bool pack_only = false;  // --pack-only: only the pack and the shared-peer cases
    for (int i = 1; i < argc; ++i) {
        if (i + 1 < argc && !std::strcmp(argv[i], "--mib")) mib = std::strtoull(argv[i + 1], nullptr, 10);
        if (!std::strcmp(argv[i], "--pack-only")) pack_only = true;
    }
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
    if (!pack_only) {
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
    }  // !pack_only
    // The pack of the copy-engine dispatch, alone and beside a copy-engine pull from the
    // partner: 4096 rows of 14336 B (7168 bf16) to 2 local destinations (own rows + one slot).
    {
        const int rows = 4096;
        const unsigned row = 14336;
        const size_t pack_bytes = size_t(rows) * row;
        std::vector<char*> psrc(R), pd0(R), pd1(R);
        for (auto& g : gpus) {
            CK(cudaSetDevice(g.dev));
            CK(cudaMalloc(&psrc[g.dev], pack_bytes));
            CK(cudaMalloc(&pd0[g.dev], pack_bytes));
            CK(cudaMalloc(&pd1[g.dev], pack_bytes));
            CK(cudaMemset(psrc[g.dev], 0x5A, pack_bytes));
            CK(cudaFuncSetAttribute(pack_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
        }
        auto job = [&](Gpu& g) {
            PackJob j{};
            j.src = psrc[g.dev];
            j.dst[0] = pd0[g.dev];
            j.dst[1] = pd1[g.dev];
            j.ndst = 2;
            j.rows = rows;
            j.row = row;
            return j;
        };
        auto pack_report = [&](const char* name, int blocks, double us) {
            const double gb = double(pack_bytes) * 3;  // read once, written twice
            std::printf("%-26s blocks %3d  %9.1f us  local %7.1f GB/s (read + 2 writes)\n", name, blocks, us,
                        gb / us / 1e3);
            std::fflush(stdout);
        };
        for (int blocks : {12, 16, 22}) {
            double us = timed([&](Gpu& g) { pack_regs<7><<<blocks, 768, 0, g.streams[R]>>>(job(g)); });
            pack_report("pack-regs-768x7", blocks, us);
            us = timed([&](Gpu& g) { pack_regs<7><<<blocks, 1024, 0, g.streams[R]>>>(job(g)); });
            pack_report("pack-regs-1024x7", blocks, us);
            us = timed([&](Gpu& g) { pack_regs<14><<<blocks, 512, 0, g.streams[R]>>>(job(g)); });
            pack_report("pack-regs-512x14", blocks, us);
            for (int stages : {4, 8, 14}) {
                char name[64];
                std::snprintf(name, sizeof name, "pack-tma-%dstages", stages);
                us = timed([&](Gpu& g) {
                    pack_tma<<<blocks, 32, size_t(stages) * row, g.streams[R]>>>(job(g), stages);
                });
                pack_report(name, blocks, us);
            }
        }
        // Beside a copy-engine pull of the same bytes from the partner (both finish).
        for (int blocks : {22}) {
            double us = timed([&](Gpu& g) {
                const int q = g.dev ^ 1;
                if (q < R)
                    CK(cudaMemcpyAsync(g.dst + size_t(q) * B, gpus[q].src + size_t(g.dev) * B,
                                       std::min(B, pack_bytes), cudaMemcpyDefault, g.streams[q]));
                pack_regs<7><<<blocks, 768, 0, g.streams[R]>>>(job(g));
            });
            pack_report("pack-regs-768x7+ce-pull", blocks, us);
            us = timed([&](Gpu& g) {
                const int q = g.dev ^ 1;
                if (q < R)
                    CK(cudaMemcpyAsync(g.dst + size_t(q) * B, gpus[q].src + size_t(g.dev) * B,
                                       std::min(B, pack_bytes), cudaMemcpyDefault, g.streams[q]));
                pack_tma<<<blocks, 32, size_t(14) * row, g.streams[R]>>>(job(g), 14);
            });
            pack_report("pack-tma-14+ce-pull", blocks, us);
        }
        for (auto& g : gpus) {
            CK(cudaSetDevice(g.dev));
            CK(cudaFree(psrc[g.dev]));
            CK(cudaFree(pd0[g.dev]));
            CK(cudaFree(pd1[g.dev]));
        }
    }
    // One peer carried by a copy engine and SM stores at once: the share `f` of the bytes by
    // the copy engine (push), the rest by `blocks` SMs pushing.
    for (int blocks : {2, 4, 8}) {
        for (double f : {0.9, 0.8, 0.7}) {
            char name[64];
            std::snprintf(name, sizeof name, "ce%.0f%%+sm-push-one-peer", f * 100);
            const double us = timed([&](Gpu& g) {
                const int q = g.dev ^ 1;
                if (q >= R) return;
                const size_t ce_bytes = (size_t(double(B) * f) / 4096) * 4096;
                CK(cudaMemcpyAsync(gpus[q].dst + size_t(g.dev) * B, g.src + size_t(q) * B, ce_bytes,
                                   cudaMemcpyDefault, g.streams[q]));
                Jobs j{};
                j.bytes = B - ce_bytes;
                j.src[0] = g.src + size_t(q) * B + ce_bytes;
                j.dst[0] = gpus[q].dst + size_t(g.dev) * B + ce_bytes;
                j.n = 1;
                sm_copy<4><<<blocks, 512, 0, g.streams[R]>>>(j);
                CK(cudaGetLastError());
            });
            verify(name, 1);
            report(name, blocks, us, 1);
        }
    }
    std::printf("done\n");
    return 0;
}
