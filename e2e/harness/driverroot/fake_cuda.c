/* A tiny CUDA driver API for drasil's fake NVIDIA driver roots (e2e/harness/driverroot).
 *
 * Built as <root>/.../libcuda.so.<version> with SONAME libcuda.so.1. cuDeviceGetCount
 * says FAKE_NVML_GPU_COUNT (default 1), the same count the fake NVML gives, and needs
 * cuInit first, as the real one does (CUDA_ERROR_NOT_INITIALIZED).
 * cuDriverGetVersion says FAKE_CUDA_DRIVER_VERSION (default 13000).
 */
#include <stdlib.h>

typedef int CUresult;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
};

static int initialized;

static int env_int(const char *name, int fallback) {
    const char *value = getenv(name);
    if (value == NULL || *value == '\0') {
        return fallback;
    }
    char *end = NULL;
    long n = strtol(value, &end, 10);
    if (end == value || *end != '\0' || n < 0 || n > 1 << 20) {
        return fallback;
    }
    return (int)n;
}

CUresult cuInit(unsigned int flags) {
    if (flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    initialized = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (count == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    *count = env_int("FAKE_NVML_GPU_COUNT", 1);
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *version = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
    return CUDA_SUCCESS;
}
