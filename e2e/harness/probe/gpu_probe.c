/*
 * gpu-probe: load the NVIDIA driver's libraries by SONAME, the way CUDA programs and
 * nvidia-smi do, and say what was loaded and what it answered, as one JSON object.
 *
 *   dlopen("libcuda.so.1")       cuInit(0), cuDeviceGetCount, cuDriverGetVersion
 *   dlopen("libnvidia-ml.so.1")  nvmlInit_v2, nvmlSystemGetDriverVersion,
 *                                nvmlDeviceGetCount_v2, nvmlShutdown
 *
 * On success (exit 0):
 *   {"libcuda": "<path the loader used>", "cuInit": 0, "cudaDevices": N,
 *    "cudaDriverVersion": V, "libnvml": "<path>", "nvmlInit": 0,
 *    "driverVersion": "...", "nvmlDevices": N}
 * On the first failure (exit 1): the fields gathered so far, plus "step" (what
 * failed) and "error" (dlerror()'s text, or "<call> returned <code>").
 *
 * No CUDA or NVML headers: the few prototypes are written out below. Built by
 * e2e/harness/node_images.py into the probe image (/usr/local/bin/gpu-probe).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*cu_init_fn)(unsigned int);
typedef int (*cu_int_out_fn)(int *);
typedef int (*nvml_void_fn)(void);
typedef int (*nvml_string_fn)(char *, unsigned int);
typedef int (*nvml_uint_out_fn)(unsigned int *);

#include "probe_json.h"

/* The path the dynamic loader opened for `handle` (link_map's l_name). */
static const char *loaded_path(void *handle) {
    struct link_map *map = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || map == NULL) {
        return "";
    }
    return map->l_name;
}

static void *symbol(void *handle, const char *name, char *step, size_t step_size) {
    dlerror();
    void *sym = dlsym(handle, name);
    if (sym == NULL) {
        snprintf(step, step_size, "dlsym %s", name);
    }
    return sym;
}

int main(void) {
    char step[96];
    int rc;

    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL) {
        return fail("dlopen libcuda.so.1", dlerror());
    }
    put_string("libcuda", loaded_path(cuda));
    cu_init_fn cu_init = (cu_init_fn)symbol(cuda, "cuInit", step, sizeof(step));
    if (cu_init == NULL) {
        return fail(step, dlerror());
    }
    cu_int_out_fn cu_count = (cu_int_out_fn)symbol(cuda, "cuDeviceGetCount", step, sizeof(step));
    if (cu_count == NULL) {
        return fail(step, dlerror());
    }
    cu_int_out_fn cu_version =
        (cu_int_out_fn)symbol(cuda, "cuDriverGetVersion", step, sizeof(step));
    if (cu_version == NULL) {
        return fail(step, dlerror());
    }
    rc = cu_init(0);
    put_number("cuInit", rc);
    if (rc != 0) {
        return fail_code("cuInit", rc);
    }
    int cuda_devices = -1;
    rc = cu_count(&cuda_devices);
    if (rc != 0) {
        return fail_code("cuDeviceGetCount", rc);
    }
    put_number("cudaDevices", cuda_devices);
    int cuda_version = -1;
    rc = cu_version(&cuda_version);
    if (rc != 0) {
        return fail_code("cuDriverGetVersion", rc);
    }
    put_number("cudaDriverVersion", cuda_version);

    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nvml == NULL) {
        return fail("dlopen libnvidia-ml.so.1", dlerror());
    }
    put_string("libnvml", loaded_path(nvml));
    nvml_void_fn nvml_init = (nvml_void_fn)symbol(nvml, "nvmlInit_v2", step, sizeof(step));
    if (nvml_init == NULL) {
        return fail(step, dlerror());
    }
    nvml_string_fn nvml_driver =
        (nvml_string_fn)symbol(nvml, "nvmlSystemGetDriverVersion", step, sizeof(step));
    if (nvml_driver == NULL) {
        return fail(step, dlerror());
    }
    nvml_uint_out_fn nvml_count =
        (nvml_uint_out_fn)symbol(nvml, "nvmlDeviceGetCount_v2", step, sizeof(step));
    if (nvml_count == NULL) {
        return fail(step, dlerror());
    }
    nvml_void_fn nvml_shutdown = (nvml_void_fn)symbol(nvml, "nvmlShutdown", step, sizeof(step));
    if (nvml_shutdown == NULL) {
        return fail(step, dlerror());
    }
    rc = nvml_init();
    put_number("nvmlInit", rc);
    if (rc != 0) {
        return fail_code("nvmlInit_v2", rc);
    }
    char version[80];
    memset(version, 0, sizeof(version));
    rc = nvml_driver(version, sizeof(version));
    if (rc != 0) {
        nvml_shutdown();
        return fail_code("nvmlSystemGetDriverVersion", rc);
    }
    version[sizeof(version) - 1] = '\0';
    put_string("driverVersion", version);
    unsigned int nvml_devices = 0;
    rc = nvml_count(&nvml_devices);
    if (rc != 0) {
        nvml_shutdown();
        return fail_code("nvmlDeviceGetCount_v2", rc);
    }
    put_number("nvmlDevices", nvml_devices);
    rc = nvml_shutdown();
    if (rc != 0) {
        return fail_code("nvmlShutdown", rc);
    }
    return finish(0);
}
