// The low-latency dispatch built with NVSHMEM (feature `nvshmem`): the same kernel as `dispatch.cu`,
// whose write path (`protocol.cuh`) then reaches ranks of other nodes (a 0 in the buffer's
// peer table) with NVSHMEM puts. Compiled with -rdc and device-linked with libnvshmem_device.a;
// the launcher binds the module to NVSHMEM (`nvshmemx_cumodule_init`) before its first launch.
#include <nvshmem.h>
#include <nvshmemx.h>

#define EP_LL_NVSHMEM 1
#include "dispatch.cu"
