// The low-latency buffer's reset (`clean_buffer_cuda`) and the benchmarks' delay (`delay_cuda`),
// beside the protocol (`protocol.cuh`) whose control words, counters, signals and flags the reset
// zeroes.
#include "protocol.cuh"

// Zeroes the control words, the send counters, and the signals and flags of both sets;
// optionally marks every rank active. One block.
EP_KERNEL void __launch_bounds__(kThreads) ll_clean(const __grid_constant__ CleanParams p) {
    const LlBuffer& b = p.buf;
    const int tid = threadIdx.x;
    const int R = b.num_ranks, E = b.num_experts, L = E / R;
    uint32_t* ctl = reinterpret_cast<uint32_t*>(b.local);
    for (int i = tid; i < kCtlWords; i += blockDim.x) {
        ctl[i] = 0;
    }
    int* send_done = reinterpret_cast<int*>(b.local + b.off_send_done);
    for (int e = tid; e < 2 * E; e += blockDim.x) {
        send_done[e] = 0;  // send_done [E], then unit_done [L*R == E]
    }
    for (uint32_t set = 0; set < 2; ++set) {
        uint8_t* base = set_base(b, b.local, set);
        uint64_t* sigs = reinterpret_cast<uint64_t*>(base + b.off_signals);
        for (int i = tid; i < L * R; i += blockDim.x) {
            sigs[i] = 0;
        }
        int* flags = reinterpret_cast<int*>(base + b.off_flags);
        for (int e = tid; e < E; e += blockDim.x) {
            flags[e] = 0;
        }
    }
    if (p.reset_active) {
        int* active = reinterpret_cast<int*>(b.local + b.off_active);
        for (int r = tid; r < R; r += blockDim.x) {
            active[r] = 1;
        }
    }
}

// Keeps the stream busy for `ns` nanoseconds (benchmarks: lets data arrive between the send
// and the receive phase, as a GEMM would). One thread.
EP_KERNEL void ll_spin(const __grid_constant__ SpinParams p) {
    const uint64_t end = ep::globaltimer_ns() + p.ns;
    while (ep::globaltimer_ns() < end) {
        __nanosleep(1000);
    }
}
