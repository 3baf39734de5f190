/*
 * A stand-in libcuda.so.1 for machines without an NVIDIA driver.
 *
 * Why this exists: Mooncake 0.3.14 (the first release with batch_probe_key, which the
 * selective and last-hit-only lease modes need) is published on PyPI only as a CUDA 13 build.
 * Its Python extension links libcuda.so.1 (the driver) even when the transfer protocol is TCP
 * and no GPU memory is ever touched, so without a driver the import fails. This stub exports
 * the driver entry points the wheel imports (list them with `nm -D --undefined-only` on
 * mooncake/_store*.so) and answers every call with CUDA_ERROR_NO_DEVICE, which Mooncake treats
 * as "no GPU here" and falls back to host memory. It is built by `make setup` for development
 * and test processes, and by the Dockerfile into the `mooncake` image, whose master and store
 * pool never touch a GPU; the vLLM (connector) image runs on a real driver and never sees it.
 */
#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100

static const char *const no_device_name = "CUDA_ERROR_NO_DEVICE";
static const char *const no_device_text = "no CUDA-capable device (moonlease CPU libcuda stub)";

int cuGetErrorName(int error, const char **name) {
    (void)error;
    if (name) *name = no_device_name;
    return 0;
}

int cuGetErrorString(int error, const char **text) {
    (void)error;
    if (text) *text = no_device_text;
    return 0;
}

/* Every other entry point: report that there is no device. The arguments are never read. */
#define NO_DEVICE(fn) int fn(void) { return CUDA_ERROR_NO_DEVICE; }
NO_DEVICE(cuInit)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxGetDevice)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetAttribute)
NO_DEVICE(cuDeviceGetPCIBusId)
NO_DEVICE(cuDevicePrimaryCtxRelease_v2)
NO_DEVICE(cuDevicePrimaryCtxRetain)
NO_DEVICE(cuFuncSetAttribute)
NO_DEVICE(cuLaunchKernel)
NO_DEVICE(cuLaunchKernelEx)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemAddressReserve)
NO_DEVICE(cuMemCreate)
NO_DEVICE(cuMemExportToShareableHandle)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemGetAllocationGranularity)
NO_DEVICE(cuMemGetHandleForAddressRange)
NO_DEVICE(cuMemImportFromShareableHandle)
NO_DEVICE(cuMemMap)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuModuleGetFunction)
NO_DEVICE(cuModuleLoadDataEx)
NO_DEVICE(cuModuleUnload)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuPointerSetAttribute)
