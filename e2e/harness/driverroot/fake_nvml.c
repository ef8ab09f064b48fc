/* A tiny NVML for drasil's fake NVIDIA driver roots (e2e/harness/driverroot).
 *
 * Built as <root>/.../libnvidia-ml.so.<version> with SONAME libnvidia-ml.so.1. It answers
 * what `nvidia-ctk cdi generate --mode=management` asks (init, the driver version,
 * shutdown) and a little more, from compile-time constants and the environment:
 *   FAKE_NVML_GPU_COUNT      the device count (default 1)
 *   FAKE_CUDA_DRIVER_VERSION what nvmlSystemGetCudaDriverVersion says (default 13000)
 *   FAKE_NVML_TRACE          a file to which every call appends its function's name
 * Like the real library it refuses calls before nvmlInit (NVML_ERROR_UNINITIALIZED).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef FAKE_DRIVER_VERSION
#error "compile with -DFAKE_DRIVER_VERSION=\"580.95.05\""
#endif
#ifndef FAKE_NVML_VERSION
#define FAKE_NVML_VERSION "13." FAKE_DRIVER_VERSION
#endif

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};

static int init_count;

static void trace(const char *function) {
    const char *path = getenv("FAKE_NVML_TRACE");
    if (path == NULL || *path == '\0') {
        return;
    }
    FILE *f = fopen(path, "a");
    if (f != NULL) {
        fprintf(f, "%s\n", function);
        fclose(f);
    }
}

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

static nvmlReturn_t copy_string(const char *value, char *out, unsigned int length) {
    if (out == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(value) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) {
    trace("nvmlInit_v2");
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) {
    trace("nvmlInit");
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    trace("nvmlInitWithFlags");
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    trace("nvmlShutdown");
    if (init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    init_count--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    trace("nvmlSystemGetDriverVersion");
    if (init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    return copy_string(FAKE_DRIVER_VERSION, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    trace("nvmlSystemGetNVMLVersion");
    return copy_string(FAKE_NVML_VERSION, version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    trace("nvmlSystemGetCudaDriverVersion");
    if (version == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *version = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    trace("nvmlSystemGetCudaDriverVersion_v2");
    if (version == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *version = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
    return NVML_SUCCESS;
}

static nvmlReturn_t device_count(unsigned int *count) {
    if (init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (count == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *count = (unsigned int)env_int("FAKE_NVML_GPU_COUNT", 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    trace("nvmlDeviceGetCount_v2");
    return device_count(count);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) {
    trace("nvmlDeviceGetCount");
    return device_count(count);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    default:
        return "Unknown Error";
    }
}
