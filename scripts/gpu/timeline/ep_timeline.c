// A GPU timeline of any CUDA program, for the machines that have no Nsight Systems: a CUDA
// injection library (the driver loads it at cuInit when CUDA_INJECTION64_PATH names it) that
// records every kernel, memcpy and memset with CUPTI's activity API and writes them, at exit,
// as CSV rows to $EP_TIMELINE_OUT.<pid>.csv:
//
//   kind,device,stream,start_ns,end_ns,correlation,bytes,name
//
// With EP_TIMELINE_DRIVER=1 it also records every driver API call (kind `driver`, device -1,
// the calling thread's id in the stream column), to see where the host spends its time.
//
// Kernels are recorded as they run concurrently (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), so
// the rows show what overlapped on which stream. `timeline.py` beside this turns them into
// per-step tables. Build: `bash scripts/gpu/timeline/build.sh`; run: see that script.

#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BUF_BYTES (8u << 20)

static FILE* g_out = NULL;
static int g_ready = 0;

#define CHECK(call)                                                                  \
    do {                                                                             \
        CUptiResult r_ = (call);                                                     \
        if (r_ != CUPTI_SUCCESS) {                                                   \
            const char* s_ = NULL;                                                   \
            cuptiGetResultString(r_, &s_);                                           \
            fprintf(stderr, "ep_timeline: %s failed: %s\n", #call, s_ ? s_ : "?"); \
            return 1;                                                                \
        }                                                                            \
    } while (0)

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = (uint8_t*)aligned_alloc(8, BUF_BYTES);
    *size = *buffer ? BUF_BYTES : 0;
    *max_records = 0;
}

static void write_record(const CUpti_Activity* rec) {
    switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)rec;
            fprintf(g_out, "kernel,%u,%u,%llu,%llu,%u,0,%s\n", k->deviceId, k->streamId,
                    (unsigned long long)k->start, (unsigned long long)k->end, k->correlationId,
                    k->name ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const CUpti_ActivityMemcpy6* m = (const CUpti_ActivityMemcpy6*)rec;
            fprintf(g_out, "memcpy,%u,%u,%llu,%llu,%u,%llu,kind%u\n", m->deviceId, m->streamId,
                    (unsigned long long)m->start, (unsigned long long)m->end, m->correlationId,
                    (unsigned long long)m->bytes, (unsigned)m->copyKind);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY2: {
            const CUpti_ActivityMemcpyPtoP4* m = (const CUpti_ActivityMemcpyPtoP4*)rec;
            fprintf(g_out, "peercopy,%u,%u,%llu,%llu,%u,%llu,to%u\n", m->deviceId, m->streamId,
                    (unsigned long long)m->start, (unsigned long long)m->end, m->correlationId,
                    (unsigned long long)m->bytes, m->dstDeviceId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const CUpti_ActivityMemset4* m = (const CUpti_ActivityMemset4*)rec;
            fprintf(g_out, "memset,%u,%u,%llu,%llu,%u,%llu,memset\n", m->deviceId, m->streamId,
                    (unsigned long long)m->start, (unsigned long long)m->end, m->correlationId,
                    (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_DRIVER: {
            // Host time: the driver call, on the host thread that made it (in the stream
            // column); the kernel or copy it launched shares its correlation id.
            const CUpti_ActivityAPI* a = (const CUpti_ActivityAPI*)rec;
            const char* name = NULL;
            if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name) != CUPTI_SUCCESS) {
                name = "?";
            }
            fprintf(g_out, "driver,-1,%u,%llu,%llu,%u,0,%s\n", a->threadId,
                    (unsigned long long)a->start, (unsigned long long)a->end, a->correlationId,
                    name ? name : "?");
            break;
        }
        default:
            break;
    }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity* rec = NULL;
    while (valid > 0 && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (g_out) {
            write_record(rec);
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped) {
        fprintf(stderr, "ep_timeline: %zu records dropped\n", dropped);
    }
    free(buffer);
}

static void flush_at_exit(void) {
    if (!g_ready) {
        return;
    }
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (g_out) {
        fclose(g_out);
        g_out = NULL;
    }
}

// Called by the CUDA driver when it loads this library (CUDA_INJECTION64_PATH).
int InitializeInjection(void) {
    const char* prefix = getenv("EP_TIMELINE_OUT");
    char path[4096];
    snprintf(path, sizeof path, "%s.%d.csv", prefix ? prefix : "ep_timeline", (int)getpid());
    g_out = fopen(path, "w");
    if (!g_out) {
        fprintf(stderr, "ep_timeline: cannot write %s\n", path);
        return 1;
    }
    fprintf(g_out, "kind,device,stream,start_ns,end_ns,correlation,bytes,name\n");
    CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY2));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
    if (getenv("EP_TIMELINE_DRIVER") != NULL) {
        CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER));
    }
    // Deliver full buffers every 200 ms, not only at exit (a context destroyed before the
    // atexit flush would otherwise take its records with it).
    CHECK(cuptiActivityFlushPeriod(200));
    g_ready = 1;
    atexit(flush_at_exit);
    fprintf(stderr, "ep_timeline: recording to %s\n", path);
    return 1;
}
