// Does the first launch of a lazily loaded kernel block the host while another kernel runs?
// And does it block other host threads, driving other GPUs, too? (Plain CUDA C++, runtime API;
// built by scripts/gpu/probe/build.sh.) Needs 2 GPUs. Run it under CUDA_MODULE_LOADING=LAZY
// (the default) and EAGER.
//
// Each case runs `spin` on GPU 0 (it waits for a host-mapped flag, at most 4 s), then times
// host calls while it runs; the main thread raises the flag at 1.5 s. A call that returns at
// about 1.5 s waited for the spinning kernel; one that returns in microseconds did not.
//   1. same GPU, first launch of `first_a` on another stream of GPU 0;
//   2. same GPU, launch of `preloaded` (its attributes queried before the spin: loaded);
//   3. other GPU: thread A does case 1's first launch of `first_b` on GPU 0 while thread B,
//      100 ms later, launches `first_c` for the first time on the idle GPU 1;
//   4. other GPU: as 3 (thread A: `first_d`), but thread B launches `warm`, already launched
//      once on GPU 1.

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            std::exit(1);                                                                     \
        }                                                                                     \
    } while (0)

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin(const volatile int* flag, unsigned long long max_ns) {
    const unsigned long long t0 = now_ns();
    while (*flag == 0 && now_ns() - t0 < max_ns) {
    }
}
__global__ void first_a(int* out) { out[0] = 1; }
__global__ void first_b(int* out) { out[1] = 2; }
__global__ void first_c(int* out) { out[2] = 3; }
__global__ void first_d(int* out) { out[5] = 6; }
__global__ void preloaded(int* out) { out[3] = 4; }
__global__ void warm(int* out) { out[4] = 5; }

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

struct Gpu {
    cudaStream_t spin_stream;
    cudaStream_t other;
    int* out;
};

int main() {
    int n = 0;
    CHECK(cudaGetDeviceCount(&n));
    if (n < 2) {
        std::printf("lazy-load probe: needs 2 GPUs, found %d\n", n);
        return 0;
    }
    const char* mode = std::getenv("CUDA_MODULE_LOADING");
    std::printf("lazy-load probe: CUDA_MODULE_LOADING=%s\n", mode ? mode : "(unset: lazy)");
    int* flag = nullptr;
    CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    int* dflag = nullptr;
    CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dflag), flag, 0));
    Gpu g[2];
    for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaStreamCreateWithFlags(&g[d].spin_stream, cudaStreamNonBlocking));
        CHECK(cudaStreamCreateWithFlags(&g[d].other, cudaStreamNonBlocking));
        CHECK(cudaMalloc(&g[d].out, 64));
    }
    CHECK(cudaSetDevice(1));
    warm<<<1, 1, 0, g[1].other>>>(g[1].out);
    CHECK(cudaStreamSynchronize(g[1].other));
    CHECK(cudaSetDevice(0));
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, preloaded));

    // Starts the spin on GPU 0 and raises the flag 1.5 s later from a thread; returns it.
    auto start_spin = [&]() {
        *reinterpret_cast<volatile int*>(flag) = 0;
        CHECK(cudaSetDevice(0));
        spin<<<1, 1, 0, g[0].spin_stream>>>(dflag, 4000000000ull);
        CHECK(cudaGetLastError());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        return std::thread([flag] {
            std::this_thread::sleep_for(std::chrono::milliseconds(1400));
            *reinterpret_cast<volatile int*>(flag) = 1;
        });
    };
    auto finish = [&](std::thread& raiser) {
        raiser.join();
        for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            CHECK(cudaDeviceSynchronize());
        }
    };

    {
        std::thread raiser = start_spin();
        const auto t0 = Clock::now();
        first_a<<<1, 1, 0, g[0].other>>>(g[0].out);
        std::printf("1. same GPU, first launch:            %8.2f ms\n", ms_since(t0));
        finish(raiser);
    }
    {
        std::thread raiser = start_spin();
        const auto t0 = Clock::now();
        preloaded<<<1, 1, 0, g[0].other>>>(g[0].out);
        std::printf("2. same GPU, preloaded kernel:        %8.2f ms\n", ms_since(t0));
        finish(raiser);
    }
    for (int c = 3; c <= 4; ++c) {
        std::thread raiser = start_spin();
        std::atomic<double> a_ms{0.0};
        std::thread a([&] {
            CHECK(cudaSetDevice(0));
            const auto t0 = Clock::now();
            if (c == 3) {
                first_b<<<1, 1, 0, g[0].other>>>(g[0].out);
            } else {
                first_d<<<1, 1, 0, g[0].other>>>(g[0].out);
            }
            a_ms = ms_since(t0);
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        double b_ms = 0.0;
        std::thread b([&] {
            CHECK(cudaSetDevice(1));
            const auto t0 = Clock::now();
            if (c == 3) {
                first_c<<<1, 1, 0, g[1].other>>>(g[1].out);
            } else {
                warm<<<1, 1, 0, g[1].other>>>(g[1].out);
            }
            b_ms = ms_since(t0);
        });
        a.join();
        b.join();
        std::printf("%d. other GPU, %s: %8.2f ms (thread A on GPU 0: %.2f ms)\n", c,
                    c == 3 ? "first launch on GPU 1 " : "warm launch on GPU 1  ", b_ms, a_ms.load());
        finish(raiser);
    }
    return 0;
}
