/* nvidia-smi of drasil's fake NVIDIA driver roots (e2e/harness/driverroot): `-L`.
 *
 * Built as <root>/usr/bin/nvidia-smi, dynamically linked against glibc as the real one
 * is, so it runs wherever the driver's own libraries would: on the host and in a
 * container of a glibc image (the probe image) that a CDI spec gave the root's files.
 * Like the real program it knows nothing of GPUs by itself: it dlopens libnvidia-ml.so.1
 * by SONAME (the container's, mounted by the CDI spec) and prints what NVML lists, so
 * what it shows is what the NVML in that place shows: in a container, the GPUs whose
 * /dev/nvidia<minor> the container has and the MIG devices whose capability nodes it has.
 *
 *   nvidia-smi -L | --list-gpus   every GPU, each followed by its MIG devices:
 *       GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-...)
 *         MIG 1g.5gb      Device  0: (UUID: MIG-...)
 *   nvidia-smi                    a header line (driver and CUDA version), then the same
 *   nvidia-smi -h | --help        what this stand-in answers
 *
 * Anything else exits 2 saying it is not implemented here (the host-side stand-in for
 * `-q -x` is e2e/harness/mocknvml/smi.py). Exit codes as the real one's: 0, 6 when NVML
 * lists no GPU ("No devices were found"), 9 when NVML does not initialise, 12 when
 * libnvidia-ml.so.1 cannot be loaded or lacks a call.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#ifndef FAKE_DRIVER_VERSION
#define FAKE_DRIVER_VERSION "unknown"
#endif

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NAME_LEN = 96,
    UUID_LEN = 96,
};

static void *nvml;

static struct {
    nvmlReturn_t (*init)(void);
    nvmlReturn_t (*shutdown)(void);
    const char *(*error_string)(nvmlReturn_t);
    nvmlReturn_t (*count)(unsigned int *);
    nvmlReturn_t (*by_index)(unsigned int, nvmlDevice_t *);
    nvmlReturn_t (*name)(nvmlDevice_t, char *, unsigned int);
    nvmlReturn_t (*uuid)(nvmlDevice_t, char *, unsigned int);
    nvmlReturn_t (*mig_mode)(nvmlDevice_t, unsigned int *, unsigned int *);
    nvmlReturn_t (*max_mig)(nvmlDevice_t, unsigned int *);
    nvmlReturn_t (*mig_by_index)(nvmlDevice_t, unsigned int, nvmlDevice_t *);
    nvmlReturn_t (*driver_version)(char *, unsigned int);
    nvmlReturn_t (*cuda_version)(int *);
} fn;

static int resolve(void **slot, const char *symbol) {
    *slot = dlsym(nvml, symbol);
    if (*slot == NULL) {
        fprintf(stderr, "nvidia-smi: libnvidia-ml.so.1 has no %s\n", symbol);
        return 0;
    }
    return 1;
}

/* 0, or the exit code of a failed load. */
static int load(void) {
    nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nvml == NULL) {
        fprintf(stderr,
                "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that "
                "the NVIDIA Display Driver is properly installed and present in your system.\n"
                "(dlopen: %s)\n",
                dlerror());
        return 12;
    }
    int ok = resolve((void **)&fn.init, "nvmlInit_v2") & resolve((void **)&fn.shutdown, "nvmlShutdown") &
             resolve((void **)&fn.error_string, "nvmlErrorString") &
             resolve((void **)&fn.count, "nvmlDeviceGetCount_v2") &
             resolve((void **)&fn.by_index, "nvmlDeviceGetHandleByIndex_v2") &
             resolve((void **)&fn.name, "nvmlDeviceGetName") & resolve((void **)&fn.uuid, "nvmlDeviceGetUUID") &
             resolve((void **)&fn.mig_mode, "nvmlDeviceGetMigMode") &
             resolve((void **)&fn.max_mig, "nvmlDeviceGetMaxMigDeviceCount") &
             resolve((void **)&fn.mig_by_index, "nvmlDeviceGetMigDeviceHandleByIndex") &
             resolve((void **)&fn.driver_version, "nvmlSystemGetDriverVersion") &
             resolve((void **)&fn.cuda_version, "nvmlSystemGetCudaDriverVersion");
    return ok ? 0 : 12;
}

static int failed(const char *call, nvmlReturn_t r) {
    fprintf(stderr, "nvidia-smi: %s: %s (%d)\n", call, fn.error_string(r), r);
    return 15;
}

/* "MIG 1g.5gb" of a MIG device named "<parent name> MIG 1g.5gb", as NVML names them. */
static const char *profile_of(const char *mig_name, const char *parent_name) {
    size_t n = strlen(parent_name);
    if (strncmp(mig_name, parent_name, n) == 0 && mig_name[n] == ' ') {
        return mig_name + n + 1;
    }
    const char *mig = strstr(mig_name, "MIG ");
    return mig != NULL ? mig : "MIG";
}

/* The MIG devices of a GPU in MIG mode, as `nvidia-smi -L` prints them. */
static int list_migs(nvmlDevice_t gpu, const char *gpu_name) {
    unsigned int current = 0, pending = 0;
    nvmlReturn_t r = fn.mig_mode(gpu, &current, &pending);
    if (r == NVML_ERROR_NOT_SUPPORTED || (r == NVML_SUCCESS && !current)) {
        return 0;
    }
    if (r != NVML_SUCCESS) {
        return failed("nvmlDeviceGetMigMode", r);
    }
    unsigned int max = 0;
    if ((r = fn.max_mig(gpu, &max)) != NVML_SUCCESS) {
        return failed("nvmlDeviceGetMaxMigDeviceCount", r);
    }
    for (unsigned int i = 0; i < max; i++) {
        nvmlDevice_t mig;
        r = fn.mig_by_index(gpu, i, &mig);
        if (r == NVML_ERROR_NOT_FOUND) {
            continue;
        }
        if (r != NVML_SUCCESS) {
            return failed("nvmlDeviceGetMigDeviceHandleByIndex", r);
        }
        char name[NAME_LEN], uuid[UUID_LEN];
        if ((r = fn.name(mig, name, sizeof name)) != NVML_SUCCESS) {
            return failed("nvmlDeviceGetName", r);
        }
        if ((r = fn.uuid(mig, uuid, sizeof uuid)) != NVML_SUCCESS) {
            return failed("nvmlDeviceGetUUID", r);
        }
        printf("  %-15s Device %2u: (UUID: %s)\n", profile_of(name, gpu_name), i, uuid);
    }
    return 0;
}

static int list_gpus(int header) {
    nvmlReturn_t r = fn.init();
    if (r != NVML_SUCCESS) {
        fprintf(stderr,
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
                "that the latest NVIDIA driver is installed and running.\n(nvmlInit_v2: %s (%d))\n",
                fn.error_string(r), r);
        return 9;
    }
    int code = 0;
    unsigned int count = 0;
    if ((r = fn.count(&count)) != NVML_SUCCESS) {
        code = failed("nvmlDeviceGetCount_v2", r);
    } else if (count == 0) {
        printf("No devices were found\n");
        code = 6;
    }
    if (code == 0 && header) {
        char version[80] = "N/A";
        int cuda = 0;
        fn.driver_version(version, sizeof version);
        fn.cuda_version(&cuda);
        printf("NVIDIA-SMI %s (drasil's fake driver)    Driver Version: %s    CUDA Version: %d.%d\n",
               FAKE_DRIVER_VERSION, version, cuda / 1000, cuda % 1000 / 10);
    }
    for (unsigned int i = 0; code == 0 && i < count; i++) {
        nvmlDevice_t gpu;
        char name[NAME_LEN], uuid[UUID_LEN];
        if ((r = fn.by_index(i, &gpu)) != NVML_SUCCESS) {
            code = failed("nvmlDeviceGetHandleByIndex_v2", r);
        } else if ((r = fn.name(gpu, name, sizeof name)) != NVML_SUCCESS) {
            code = failed("nvmlDeviceGetName", r);
        } else if ((r = fn.uuid(gpu, uuid, sizeof uuid)) != NVML_SUCCESS) {
            code = failed("nvmlDeviceGetUUID", r);
        } else {
            printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
            code = list_migs(gpu, name);
        }
    }
    fn.shutdown();
    return code;
}

static void usage(FILE *out) {
    fprintf(out,
            "NVIDIA System Management Interface -- drasil's stand-in of fake driver %s.\n"
            "It lists what libnvidia-ml.so.1 serves here, nothing more:\n"
            "    -L, --list-gpus   the GPUs and their MIG devices, with their UUIDs\n"
            "    (no option)       a header line, then the same list\n"
            "    -h, --help        this text\n",
            FAKE_DRIVER_VERSION);
}

int main(int argc, char **argv) {
    int list = 0, header = 0;
    if (argc == 1) {
        list = header = 1;
    } else if (argc == 2 && (strcmp(argv[1], "-L") == 0 || strcmp(argv[1], "--list-gpus") == 0)) {
        list = 1;
    } else if (argc == 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
        usage(stdout);
        return 0;
    }
    if (!list) {
        fprintf(stderr, "nvidia-smi (drasil's fake driver): not implemented here:");
        for (int i = 1; i < argc; i++) {
            fprintf(stderr, " %s", argv[i]);
        }
        fprintf(stderr, "\n");
        usage(stderr);
        return 2;
    }
    int code = load();
    if (code != 0) {
        return code;
    }
    code = list_gpus(header);
    fflush(stdout);
    return code;
}
