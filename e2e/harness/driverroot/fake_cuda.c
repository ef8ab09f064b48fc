/* A tiny CUDA driver API for drasil's fake NVIDIA driver roots (e2e/harness/driverroot).
 *
 * Built as <root>/.../libcuda.so.<version> with SONAME libcuda.so.1. cuDeviceGetCount
 * says FAKE_NVML_GPU_COUNT (default 1), the same count the fake NVML gives, and needs
 * cuInit first, as the real one does (CUDA_ERROR_NOT_INITIALIZED).
 * cuDriverGetVersion says FAKE_CUDA_DRIVER_VERSION (default 13000).
 *
 * What a program needs to run one kernel (the GPU check's gpu-kernel probe): a context,
 * memory (host memory behind the device pointers), modules of PTX text and the launch.
 * The stand-in knows one kernel, `drasil_fill(u64 out, u32 n, u32 seed)`, and does on
 * the CPU what its PTX says: out[i] = 3 * i + seed for every launched thread i < n. A
 * module must be PTX (.version, .target) that declares the entry, else the real
 * driver's errors. Memory: 80 GiB less 512 MiB of context free; with
 * CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=<N>M" (an MPS share's) N MiB, and an allocation
 * past what is free fails as out of memory, as under MPS.
 */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
};

#define MIB (1ULL << 20)
#define TOTAL (80ULL * 1024 * MIB)
#define CONTEXT (512ULL * MIB)
#define FILL "drasil_fill"

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

static int context;        /* one context, current once created */
static size_t used;        /* bytes allocated in it */
static const char module_tag[] = "drasil fake module";
static const char fill_tag[] = FILL;

CUresult cuDeviceGet(int *device, int ordinal) {
    if (!initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (device == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (ordinal < 0 || ordinal >= env_int("FAKE_NVML_GPU_COUNT", 1)) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(void **ctx, unsigned int flags, int device) {
    (void)flags;
    if (!initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (ctx == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (device < 0 || device >= env_int("FAKE_NVML_GPU_COUNT", 1)) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    context = 1;
    *ctx = &context;
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy_v2(void *ctx) {
    if (ctx != &context || !context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    context = 0;
    return CUDA_SUCCESS;
}

/* The memory a context may use: the MPS share's pinned limit for device 0, else all. */
static size_t limit(void) {
    const char *value = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    if (value != NULL && strncmp(value, "0=", 2) == 0) {
        char *end = NULL;
        unsigned long long mib = strtoull(value + 2, &end, 10);
        if (end != value + 2 && (*end == 'M' || *end == '\0')) {
            return (size_t)(mib * MIB);
        }
    }
    return (size_t)(TOTAL - CONTEXT);
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (free_bytes == NULL || total == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *free_bytes = limit() - used;
    *total = (size_t)TOTAL;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
    if (!context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (ptr == NULL || size == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (size > limit() - used) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* What a kernel writes must be real memory; a big allocation that is only
       counted (never touched here) gets a token page instead. */
    void *memory = malloc(size <= 64 * MIB ? size : 4096);
    if (memory == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    used += size;
    *ptr = (CUdeviceptr)(size_t)memory;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    if (!context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    free((void *)(size_t)ptr); /* `used` stays: the probe frees only at its end */
    return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(void **module, const void *image) {
    if (!context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (module == NULL || image == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    const char *text = image;
    if (strstr(text, ".version") == NULL || strstr(text, ".target") == NULL) {
        return CUDA_ERROR_INVALID_IMAGE;
    }
    if (strstr(text, ".entry " FILL "(") == NULL || strstr(text, "st.global.u32") == NULL) {
        return CUDA_ERROR_INVALID_PTX;
    }
    *module = (void *)module_tag;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
    if (module != module_tag) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (function == NULL || name == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (strcmp(name, FILL) != 0) {
        return CUDA_ERROR_NOT_FOUND;
    }
    *function = (void *)fill_tag;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(void *function, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        void *stream, void **params, void **extra) {
    (void)shared, (void)stream, (void)extra;
    if (!context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (function != fill_tag) {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (params == NULL || gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    unsigned int *out = (unsigned int *)(size_t)*(CUdeviceptr *)params[0];
    unsigned int n = *(unsigned int *)params[1];
    unsigned int seed = *(unsigned int *)params[2];
    /* The PTX's index: ctaid.x * ntid.x + tid.x; y and z do not enter it. */
    for (unsigned long long i = 0; i < (unsigned long long)gx * bx; i++) {
        if (i < n) {
            out[i] = 3 * (unsigned int)i + seed;
        }
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    return context ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t size) {
    if (!context) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (dst == NULL || src == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    memcpy(dst, (void *)(size_t)src, size);
    return CUDA_SUCCESS;
}
