/*
 * gpu-kernel: run one kernel on the container's first GPU through the CUDA driver API,
 * with no CUDA toolkit (no nvcc, no cudart): the kernel is PTX text that the driver's
 * JIT (libnvidia-ptxjitcompiler, one of the mounted driver libraries) compiles.
 *
 *   dlopen("libnvidia-ml.so.1")  the UUIDs of the GPUs the container sees
 *   dlopen("libcuda.so.1")       cuInit, cuDeviceGetCount, cuDeviceGet, cuCtxCreate,
 *                                cuMemGetInfo, cuModuleLoadData(PTX),
 *                                cuModuleGetFunction("drasil_fill"), cuMemAlloc,
 *                                cuLaunchKernel, cuCtxSynchronize, cuMemcpyDtoH
 *
 * The kernel writes out[i] = 3 * i + seed for i < n (seed: the probe's pid, so that no
 * stale buffer can pass); the probe checks every value. `gpu-kernel --alloc MIB` also
 * tries to allocate MIB MiB (an MPS share's limit plus a margin must be refused).
 *
 * Prints one JSON object: on success (exit 0)
 *   {"uuids": "GPU-...[,GPU-...]", "nvmlDevices": N, "cuInit": 0, "cudaDevices": N,
 *    "freeMiB": F, "totalMiB": T, "kernel": "drasil_fill", "values": n, "wrong": 0,
 *    ["allocMiB": M, "allocResult": rc]}
 * on the first failure (exit 1) the fields so far plus "step" and "error".
 *
 * Built by e2e/harness/node_images.py into the probe image (/usr/local/bin/gpu-kernel),
 * which `make gpu-check` runs under containerd.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "probe_json.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;

#define VALUES 4096
#define BLOCK 256
#define UUID_TEXT 96
#define MAX_GPUS 16

static const char PTX[] =
    ".version 6.5\n"
    ".target sm_50\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry drasil_fill(\n"
    "    .param .u64 out,\n"
    "    .param .u32 n,\n"
    "    .param .u32 seed\n"
    ")\n"
    "{\n"
    "    .reg .pred %p;\n"
    "    .reg .b32 %r<9>;\n"
    "    .reg .b64 %rd<5>;\n"
    "\n"
    "    ld.param.u64 %rd1, [out];\n"
    "    ld.param.u32 %r1, [n];\n"
    "    ld.param.u32 %r2, [seed];\n"
    "    mov.u32 %r3, %ctaid.x;\n"
    "    mov.u32 %r4, %ntid.x;\n"
    "    mov.u32 %r5, %tid.x;\n"
    "    mad.lo.s32 %r6, %r3, %r4, %r5;\n"
    "    setp.ge.u32 %p, %r6, %r1;\n"
    "    @%p bra DONE;\n"
    "    cvta.to.global.u64 %rd2, %rd1;\n"
    "    mul.wide.u32 %rd3, %r6, 4;\n"
    "    add.s64 %rd4, %rd2, %rd3;\n"
    "    mul.lo.s32 %r7, %r6, 3;\n"
    "    add.s32 %r8, %r7, %r2;\n"
    "    st.global.u32 [%rd4], %r8;\n"
    "DONE:\n"
    "    ret;\n"
    "}\n";

/* dlsym, or NULL with the failing step named in `missing`. */
static void *need(void *lib, const char *name, const char **missing) {
    void *sym = dlsym(lib, name);
    if (sym == NULL && *missing == NULL) {
        *missing = name;
    }
    return sym;
}

/* The UUIDs NVML lists, comma-separated, into `out`; the count, or -1 on a failure. */
static int nvml_uuids(char *out, size_t size) {
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nvml == NULL) {
        fail("dlopen libnvidia-ml.so.1", dlerror());
        return -1;
    }
    const char *missing = NULL;
    int (*init)(void) = (int (*)(void))need(nvml, "nvmlInit_v2", &missing);
    int (*count)(unsigned int *) = (int (*)(unsigned int *))need(nvml, "nvmlDeviceGetCount_v2", &missing);
    int (*handle)(unsigned int, void **) =
        (int (*)(unsigned int, void **))need(nvml, "nvmlDeviceGetHandleByIndex_v2", &missing);
    int (*uuid)(void *, char *, unsigned int) =
        (int (*)(void *, char *, unsigned int))need(nvml, "nvmlDeviceGetUUID", &missing);
    int (*shutdown)(void) = (int (*)(void))need(nvml, "nvmlShutdown", &missing);
    if (missing != NULL) {
        fail("dlsym", missing);
        return -1;
    }
    int rc = init();
    if (rc != 0) {
        fail_code("nvmlInit_v2", rc);
        return -1;
    }
    unsigned int n = 0;
    if ((rc = count(&n)) != 0) {
        fail_code("nvmlDeviceGetCount_v2", rc);
        return -1;
    }
    out[0] = '\0';
    for (unsigned int i = 0; i < n && i < MAX_GPUS; i++) {
        void *device = NULL;
        char text[UUID_TEXT] = {0};
        if ((rc = handle(i, &device)) != 0 || (rc = uuid(device, text, sizeof(text))) != 0) {
            fail_code("nvmlDeviceGetUUID", rc);
            return -1;
        }
        if (strlen(out) + strlen(text) + 2 < size) {
            strcat(out, i > 0 ? "," : "");
            strcat(out, text);
        }
    }
    shutdown();
    return (int)n;
}

struct cuda {
    CUresult (*init)(unsigned int);
    CUresult (*count)(int *);
    CUresult (*device)(CUdevice *, int);
    CUresult (*ctx_create)(CUcontext *, unsigned int, CUdevice);
    CUresult (*ctx_destroy)(CUcontext);
    CUresult (*mem_info)(size_t *, size_t *);
    CUresult (*load)(CUmodule *, const void *);
    CUresult (*function)(CUfunction *, CUmodule, const char *);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*launch)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                       unsigned int, unsigned int, unsigned int, void *, void **, void **);
    CUresult (*sync)(void);
    CUresult (*copy)(void *, CUdeviceptr, size_t);
};

static const char *bind_cuda(void *lib, struct cuda *c) {
    const char *missing = NULL;
    *(void **)&c->init = need(lib, "cuInit", &missing);
    *(void **)&c->count = need(lib, "cuDeviceGetCount", &missing);
    *(void **)&c->device = need(lib, "cuDeviceGet", &missing);
    *(void **)&c->ctx_create = need(lib, "cuCtxCreate_v2", &missing);
    *(void **)&c->ctx_destroy = need(lib, "cuCtxDestroy_v2", &missing);
    *(void **)&c->mem_info = need(lib, "cuMemGetInfo_v2", &missing);
    *(void **)&c->load = need(lib, "cuModuleLoadData", &missing);
    *(void **)&c->function = need(lib, "cuModuleGetFunction", &missing);
    *(void **)&c->alloc = need(lib, "cuMemAlloc_v2", &missing);
    *(void **)&c->free = need(lib, "cuMemFree_v2", &missing);
    *(void **)&c->launch = need(lib, "cuLaunchKernel", &missing);
    *(void **)&c->sync = need(lib, "cuCtxSynchronize", &missing);
    *(void **)&c->copy = need(lib, "cuMemcpyDtoH_v2", &missing);
    return missing;
}

/* Launch drasil_fill over VALUES values and check them; fields "values" and "wrong". */
static int run_kernel(struct cuda *c) {
    CUmodule module = NULL;
    CUfunction fill = NULL;
    CUdeviceptr out = 0;
    int rc;
    if ((rc = c->load(&module, PTX)) != 0) {
        return fail_code("cuModuleLoadData", rc);
    }
    if ((rc = c->function(&fill, module, "drasil_fill")) != 0) {
        return fail_code("cuModuleGetFunction", rc);
    }
    put_string("kernel", "drasil_fill");
    if ((rc = c->alloc(&out, VALUES * sizeof(unsigned int))) != 0) {
        return fail_code("cuMemAlloc_v2", rc);
    }
    unsigned int n = VALUES, seed = (unsigned int)getpid();
    void *params[] = {&out, &n, &seed};
    rc = c->launch(fill, (VALUES + BLOCK - 1) / BLOCK, 1, 1, BLOCK, 1, 1, 0, NULL, params, NULL);
    if (rc != 0) {
        return fail_code("cuLaunchKernel", rc);
    }
    if ((rc = c->sync()) != 0) {
        return fail_code("cuCtxSynchronize", rc);
    }
    static unsigned int values[VALUES];
    if ((rc = c->copy(values, out, sizeof(values))) != 0) {
        return fail_code("cuMemcpyDtoH_v2", rc);
    }
    int wrong = 0;
    for (unsigned int i = 0; i < VALUES; i++) {
        wrong += values[i] != 3 * i + seed;
    }
    put_number("values", VALUES);
    put_number("wrong", wrong);
    c->free(out);
    return wrong == 0 ? 0 : fail("check", "the kernel's values are wrong");
}

int main(int argc, char **argv) {
    long alloc_mib = -1;
    if (argc == 3 && strcmp(argv[1], "--alloc") == 0) {
        alloc_mib = strtol(argv[2], NULL, 10);
    } else if (argc != 1) {
        return fail("usage", "gpu-kernel [--alloc MIB]");
    }
    char uuids[MAX_GPUS * UUID_TEXT];
    int gpus = nvml_uuids(uuids, sizeof(uuids));
    if (gpus < 0) {
        return 1;
    }
    put_string("uuids", uuids);
    put_number("nvmlDevices", gpus);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        return fail("dlopen libcuda.so.1", dlerror());
    }
    struct cuda c;
    const char *missing = bind_cuda(lib, &c);
    if (missing != NULL) {
        return fail("dlsym", missing);
    }
    int rc = c.init(0);
    put_number("cuInit", rc);
    if (rc != 0) {
        return fail_code("cuInit", rc);
    }
    int count = 0;
    if ((rc = c.count(&count)) != 0) {
        return fail_code("cuDeviceGetCount", rc);
    }
    put_number("cudaDevices", count);
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    if ((rc = c.device(&dev, 0)) != 0) {
        return fail_code("cuDeviceGet", rc);
    }
    if ((rc = c.ctx_create(&ctx, 0, dev)) != 0) {
        return fail_code("cuCtxCreate_v2", rc);
    }
    size_t free_bytes = 0, total_bytes = 0;
    if ((rc = c.mem_info(&free_bytes, &total_bytes)) != 0) {
        return fail_code("cuMemGetInfo_v2", rc);
    }
    put_number("freeMiB", (long long)(free_bytes >> 20));
    put_number("totalMiB", (long long)(total_bytes >> 20));
    if ((rc = run_kernel(&c)) != 0) {
        return rc;
    }
    if (alloc_mib >= 0) {
        CUdeviceptr big = 0;
        put_number("allocMiB", alloc_mib);
        rc = c.alloc(&big, (size_t)alloc_mib << 20);
        put_number("allocResult", rc);
        if (rc == 0) {
            c.free(big);
        }
    }
    c.ctx_destroy(ctx);
    return finish(0);
}
