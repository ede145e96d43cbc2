// The host side of nvshmem-sys: plain C entry points over NVSHMEM's host API, built by build.rs
// into libep_nvshmem_shim.so (compiled with -rdc=true, device-linked with libnvshmem_device.a,
// linked with libnvshmem_host.so.3 and the static CUDA runtime) and loaded at run time by
// src/shim.rs.
//
// Why a shim: NVSHMEM's init entry points (nvshmemx_init_attr, ...) are `static inline` in its
// headers and call nvshmemi_init_thread from libnvshmem_device.a, which also registers this
// library's device code (the test kernels below) with NVSHMEM.
//
// Conventions: every function returns an EP_NVSHMEM_* status (0 = success) unless it returns a
// plain value; on failure a message naming the call and its arguments is kept per thread and
// read with ep_nvshmem_last_error(). No C++ exception crosses this boundary (nothing here
// throws). Every call that touches CUDA first makes the NVSHMEM device current on the calling
// thread, so the Rust side may call from any thread (one at a time: NVSHMEM is initialised
// with NVSHMEM_THREAD_SERIALIZED).

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

// Keep in sync with src/shim.rs.
#define EP_NVSHMEM_ABI_VERSION 1
#define EP_NVSHMEM_OK 0
#define EP_NVSHMEM_ERR_CUDA 1
#define EP_NVSHMEM_ERR_NVSHMEM 2
#define EP_NVSHMEM_ERR_ARGUMENT 3
#define EP_NVSHMEM_ERR_OUT_OF_MEMORY 4
#define EP_NVSHMEM_ERR_STATE 5

#define EP_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

thread_local char g_last_error[512];
// The CUDA device NVSHMEM was initialised on; -1 before init and after finalize.
int g_device = -1;

int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
    va_end(ap);
    return code;
}

int cuda_fail(const char *call, cudaError_t err) {
    return fail(EP_NVSHMEM_ERR_CUDA, "%s failed: %s (%s, cudaError_t %d)", call,
                cudaGetErrorString(err), cudaGetErrorName(err), (int)err);
}

// Makes the NVSHMEM device current on the calling thread.
int use_device(const char *what) {
    if (g_device < 0) {
        return fail(EP_NVSHMEM_ERR_STATE, "%s: NVSHMEM is not initialised", what);
    }
    cudaError_t err = cudaSetDevice(g_device);
    if (err != cudaSuccess) return cuda_fail("cudaSetDevice", err);
    return EP_NVSHMEM_OK;
}

// Test kernel: one thread writes `value` into the next PE's `sym` and completes the put.
__global__ void ring_put_kernel(int *sym, int value) {
    int peer = (nvshmem_my_pe() + 1) % nvshmem_n_pes();
    nvshmem_int_p(sym, value, peer);
    nvshmem_quiet();
}

// Test kernel: one thread sends `value` to the next PE's sym[1] with put-with-signal (the
// signal set to my_pe + 1), then waits for its own signal and copies the sym[1] it sees at that
// moment into sym[2] (so the host can check that the data arrived before the signal).
__global__ void ring_put_signal_kernel(int *sym, uint64_t *sig, int value) {
    int me = nvshmem_my_pe();
    int peer = (me + 1) % nvshmem_n_pes();
    sym[0] = value;
    nvshmem_int_put_signal(sym + 1, sym, 1, sig, (uint64_t)me + 1, NVSHMEM_SIGNAL_SET, peer);
    nvshmem_quiet();
    nvshmem_signal_wait_until(sig, NVSHMEM_CMP_NE, 0);
    sym[2] = *(volatile int *)(sym + 1);
}

}  // namespace

EP_EXPORT int ep_nvshmem_abi_version(void) { return EP_NVSHMEM_ABI_VERSION; }

EP_EXPORT size_t ep_nvshmem_uniqueid_size(void) { return sizeof(nvshmemx_uniqueid_t); }

EP_EXPORT const char *ep_nvshmem_last_error(void) { return g_last_error; }

EP_EXPORT int ep_nvshmem_version(int *major, int *minor, int *patch) {
    if (!major || !minor || !patch) return fail(EP_NVSHMEM_ERR_ARGUMENT, "version: null output");
    *major = NVSHMEM_VENDOR_MAJOR_VERSION;
    *minor = NVSHMEM_VENDOR_MINOR_VERSION;
    *patch = NVSHMEM_VENDOR_PATCH_VERSION;
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_device_count(int *count) {
    if (!count) return fail(EP_NVSHMEM_ERR_ARGUMENT, "device_count: null output");
    cudaError_t err = cudaGetDeviceCount(count);
    if (err != cudaSuccess) return cuda_fail("cudaGetDeviceCount", err);
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_get_uniqueid(void *out, size_t len) {
    if (!out || len != sizeof(nvshmemx_uniqueid_t)) {
        return fail(EP_NVSHMEM_ERR_ARGUMENT, "get_uniqueid: buffer of %zu bytes, expected %zu",
                    len, sizeof(nvshmemx_uniqueid_t));
    }
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    int status = nvshmemx_get_uniqueid(&id);
    if (status != 0) {
        return fail(EP_NVSHMEM_ERR_NVSHMEM, "nvshmemx_get_uniqueid returned %d", status);
    }
    memcpy(out, &id, sizeof(id));
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_init(int device, int rank, int nranks, const void *id_bytes,
                              size_t len) {
    if (g_device >= 0) {
        return fail(EP_NVSHMEM_ERR_STATE, "init: NVSHMEM is already initialised on device %d",
                    g_device);
    }
    if (!id_bytes || len != sizeof(nvshmemx_uniqueid_t)) {
        return fail(EP_NVSHMEM_ERR_ARGUMENT, "init: unique id of %zu bytes, expected %zu", len,
                    sizeof(nvshmemx_uniqueid_t));
    }
    if (device < 0 || nranks < 1 || rank < 0 || rank >= nranks) {
        return fail(EP_NVSHMEM_ERR_ARGUMENT, "init: device %d, rank %d, nranks %d", device, rank,
                    nranks);
    }
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return cuda_fail("cudaSetDevice", err);
    // Create the primary context now, so that NVSHMEM finds a current context.
    err = cudaFree(0);
    if (err != cudaSuccess) return cuda_fail("cudaFree(0) (context creation)", err);

    nvshmemx_uniqueid_t id;
    memcpy(&id, id_bytes, sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    int status = nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
    if (status != 0) {
        return fail(EP_NVSHMEM_ERR_NVSHMEM,
                    "nvshmemx_set_attr_uniqueid_args(rank %d, nranks %d) returned %d", rank,
                    nranks, status);
    }
    // nvshmemx_init_attr without its exit(-1) on failure (the header's inline version aborts
    // the process; the caller gets the status instead).
    int provided = 0;
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    nvshmemx_init_init_attr_ver_only(attr);
    status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                  NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
    if (status != 0) {
        return fail(EP_NVSHMEM_ERR_NVSHMEM,
                    "nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, rank %d of %d, device %d) "
                    "returned %d",
                    rank, nranks, device, status);
    }
    g_device = device;
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_my_pe(void) { return g_device < 0 ? -1 : nvshmem_my_pe(); }

EP_EXPORT int ep_nvshmem_n_pes(void) { return g_device < 0 ? -1 : nvshmem_n_pes(); }

EP_EXPORT int ep_nvshmem_malloc(size_t bytes, int zeroed, void **out) {
    if (!out) return fail(EP_NVSHMEM_ERR_ARGUMENT, "malloc: null output");
    *out = NULL;
    int status = use_device("malloc");
    if (status != EP_NVSHMEM_OK) return status;
    void *ptr = zeroed ? nvshmem_calloc(bytes, 1) : nvshmem_malloc(bytes);
    if (!ptr) {
        return fail(EP_NVSHMEM_ERR_OUT_OF_MEMORY, "%s(%zu bytes) returned null",
                    zeroed ? "nvshmem_calloc" : "nvshmem_malloc", bytes);
    }
    *out = ptr;
    return EP_NVSHMEM_OK;
}

// Waits for all work on the device first (kernels may still use the memory); on a CUDA error
// the memory is left allocated.
EP_EXPORT int ep_nvshmem_free(void *ptr) {
    int status = use_device("free");
    if (status != EP_NVSHMEM_OK) return status;
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) return cuda_fail("cudaDeviceSynchronize (before nvshmem_free)", err);
    nvshmem_free(ptr);
    return EP_NVSHMEM_OK;
}

EP_EXPORT void *ep_nvshmem_ptr(const void *ptr, int pe) {
    if (g_device < 0) return NULL;
    return nvshmem_ptr(ptr, pe);
}

EP_EXPORT int ep_nvshmem_barrier_all(void) {
    int status = use_device("barrier_all");
    if (status != EP_NVSHMEM_OK) return status;
    nvshmem_barrier_all();
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_barrier_all_on_stream(void *stream) {
    int status = use_device("barrier_all_on_stream");
    if (status != EP_NVSHMEM_OK) return status;
    nvshmemx_barrier_all_on_stream((cudaStream_t)stream);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail("nvshmemx_barrier_all_on_stream", err);
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_quiet(void) {
    int status = use_device("quiet");
    if (status != EP_NVSHMEM_OK) return status;
    nvshmem_quiet();
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_finalize(void) {
    int status = use_device("finalize");
    if (status != EP_NVSHMEM_OK) return status;
    nvshmem_finalize();
    g_device = -1;
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_cumodule_init(void *module) {
    int status = use_device("cumodule_init");
    if (status != EP_NVSHMEM_OK) return status;
    if (!module) return fail(EP_NVSHMEM_ERR_ARGUMENT, "cumodule_init: null CUmodule");
    status = nvshmemx_cumodule_init((CUmodule)module);
    if (status != 0) {
        return fail(EP_NVSHMEM_ERR_NVSHMEM, "nvshmemx_cumodule_init returned %d", status);
    }
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_memcpy(void *dst, const void *src, size_t bytes, int to_device) {
    int status = use_device("memcpy");
    if (status != EP_NVSHMEM_OK) return status;
    cudaError_t err =
        cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
        return cuda_fail(to_device ? "cudaMemcpy (host to device)" : "cudaMemcpy (device to host)",
                         err);
    }
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_stream_synchronize(void *stream) {
    int status = use_device("stream_synchronize");
    if (status != EP_NVSHMEM_OK) return status;
    cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
    if (err != cudaSuccess) return cuda_fail("cudaStreamSynchronize", err);
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_ring_put(int *sym, int value, void *stream) {
    int status = use_device("ring_put");
    if (status != EP_NVSHMEM_OK) return status;
    ring_put_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(sym, value);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail("ring_put_kernel launch", err);
    return EP_NVSHMEM_OK;
}

EP_EXPORT int ep_nvshmem_ring_put_signal(int *sym, uint64_t *sig, int value, void *stream) {
    int status = use_device("ring_put_signal");
    if (status != EP_NVSHMEM_OK) return status;
    ring_put_signal_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(sym, sig, value);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_fail("ring_put_signal_kernel launch", err);
    return EP_NVSHMEM_OK;
}
