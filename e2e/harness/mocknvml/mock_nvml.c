/* drasil's mock NVML: libnvidia-ml.so.1 serving the simulated backend's GPUs.
 *
 * Built by e2e/harness/mocknvml/__init__.py (`compiled_mock()`), which also writes the config
 * this library reads and documents its format. In short:
 *
 * - the config comes from the file named by $DRASIL_MOCK_NVML_CONFIG, else from the
 *   text embedded at build time (mock_nvml_embedded_config, a second C file), else
 *   there are no GPUs; it is (re)read on every 0 -> 1 init, so one process can switch
 *   nodes between init/shutdown pairs;
 * - a GPU is visible only while <dev root>/nvidia<minor> exists (checked at init), and
 *   indices count visible GPUs only, as real NVML does inside a container;
 * - a MIG device is visible only while <dev root>/nvidia-caps/nvidia-cap<N> exists for
 *   both its GPU instance's and its compute instance's access capability (the minors of
 *   /proc/driver/nvidia-caps/mig-minors: 3 + 135 * gpu minor + 9 * gi [+ 1 + ci], as
 *   e2e.harness.mocknvml.mig_cap_minor numbers them), and MIG device indices count the
 *   visible ones only: a container holds exactly the caps nodes its CDI spec gave it.
 *   This applies where the dev root is a container's /dev (the config's dev root is not
 *   there) or has an nvidia-caps folder; a node's dev root without one stands for a host,
 *   where root reaches every capability (nvidia-modprobe makes the nodes on demand);
 * - MIG mode, instances and compute modes live in the simulated backend's JSON state
 *   file, read when it changed (stat) and written atomically (temp file + rename) under
 *   flock on <file>.lock after re-reading it; keys this library does not manage are kept;
 * - XID events and lost GPUs come from an append-only events file (lines
 *   "xid <uuid> <xid> <gi> <ci>" and "lost <uuid>");
 * - two test hooks that are not NVML: mockNvmlInitCount() and mockNvmlReset().
 *
 * Every call but init, shutdown and nvmlErrorString answers NVML_ERROR_UNINITIALIZED
 * while the init count is 0. One mutex guards all state; nvmlEventSetWait_v2 drops it
 * while it sleeps.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nvml_types.h"

#define EXPORT __attribute__((visibility("default")))

#define MAX_GPUS 64
#define MAX_PROFILES 18
#define MAX_PLACEMENTS 16
#define MAX_GI 15 /* GPU instance ids 0..14: the nodes of a tree over 8 memory slices */
#define MAX_CI 8
#define MAX_EVENT_SETS 256
#define MAX_STATE_FILE (1 << 20)
#define MAX_EVENTS_FILE (16 << 20)
#define UUID_LEN 96
#define NAME_LEN 96
#define NO_INSTANCE 0xFFFFFFFFu
#define ARCH_AMPERE 7

extern const char mock_nvml_embedded_config[];

/* ---- the model ------------------------------------------------------------------- */

struct placement {
    unsigned start, size, gi_id;
};

struct profile {
    unsigned index, id, slices, count, sms, ce, dec, enc, jpeg, ofa;
    unsigned long long mem_mib;
    char name[NAME_LEN]; /* with the "MIG " prefix */
    unsigned nplace;
    struct placement place[MAX_PLACEMENTS];
};

struct gi_state {
    int exists;
    unsigned profile_id, start, size;
    unsigned ci_mask; /* bit c: compute instance c exists */
};

/* A GPU's state in the state file: MIG mode and instances, and its compute mode. */
struct mig_state {
    int enabled, pending;
    struct gi_state gi[MAX_GI];
    unsigned compute_mode; /* nvmlComputeMode_t; "computeMode" when not DEFAULT */
};

struct gpu {
    char uuid[UUID_LEN], name[NAME_LEN], bus[32];
    unsigned minor, pci_id, brand, arch, cc_major, cc_minor;
    int numa;
    unsigned long long mem_mib;
    int mig_capable;
    unsigned max_mig;
    int events_supported, busy, lost;
    int nprof;
    struct profile prof[MAX_PROFILES];
    char mig_uuid[MAX_GI][MAX_CI][64];
    struct mig_state initial, st;
    char *extra; /* raw "key": value pairs of its state entry we do not manage */
};

/* Handles: addresses inside these arrays, so a handle's kind is where it points. */
struct handle {
    int gpu, gi, ci;
};
static struct handle gpu_handles[MAX_GPUS];
static struct handle mig_handles[MAX_GPUS][MAX_GI][MAX_CI];
static struct handle gi_handles[MAX_GPUS][MAX_GI];
static struct handle ci_handles[MAX_GPUS][MAX_GI][MAX_CI];

struct event_set {
    int used;
    long long offset;
    unsigned long long mask[MAX_GPUS];
};
static struct event_set event_sets[MAX_EVENT_SETS];

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static char *loaded_config; /* the text the GPUs below came from */
static char driver_version[80] = "580.95.05";
static int cuda_version = 13000;
static char state_path[4096], events_path[4096], dev_root[4096] = "/dev",
                                                  boot_id_path[4096] = "/proc/sys/kernel/random/boot_id";
static int ngpus;
static struct gpu gpus[MAX_GPUS];
static int visible[MAX_GPUS], nvisible;
/* The dev root init chose, and whether MIG devices need their caps nodes there. */
static char used_dev_root[4096] = "/dev";
static int caps_checked;

/* What we last read or wrote of the state file: 0 never, 1 missing, 2 the file below. */
static int seen_kind;
static struct stat seen_stat;
static char *top_extra, *other_gpus; /* raw top-level keys and GPU entries not ours */

static int state_locked;     /* this process holds <state>.lock */
static int loaded_from_reboot; /* the last file read came from another boot */

static long long events_scanned = -1;
static ino_t events_ino;

/* ---- small helpers ------------------------------------------------------------------ */

struct sb {
    char *p;
    size_t n, cap;
};

static void sb_add(struct sb *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (b->n + n + 1 > cap) {
            cap *= 2;
        }
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            abort();
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_str(struct sb *b, const char *s) { sb_add(b, s, strlen(s)); }

static void sb_fmt(struct sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_fmt(struct sb *b, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) {
        sb_add(b, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    }
}

static void sb_json_string(struct sb *b, const char *s) {
    sb_str(b, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            sb_fmt(b, "\\%c", c);
        } else if (c < 0x20) {
            sb_fmt(b, "\\u%04x", c);
        } else {
            sb_add(b, (const char *)&c, 1);
        }
    }
    sb_str(b, "\"");
}

static char *read_file(const char *path, size_t limit, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return NULL;
    }
    struct sb b = {0};
    char buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break;
        }
        if (b.n + (size_t)n > limit) {
            free(b.p);
            close(fd);
            errno = EFBIG;
            return NULL;
        }
        sb_add(&b, buf, (size_t)n);
    }
    close(fd);
    if (b.p == NULL) {
        sb_add(&b, "", 0);
    }
    if (len != NULL) {
        *len = b.n;
    }
    return b.p;
}

static nvmlReturn_t copy_string(const char *value, char *out, unsigned int length) {
    if (out == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    size_t n = strlen(value) + 1;
    if (n > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, value, n);
    return NVML_SUCCESS;
}

static void read_boot_id(char *out, size_t cap) {
    out[0] = '\0';
    char *text = read_file(boot_id_path, 4096, NULL);
    if (text == NULL) {
        return;
    }
    char *s = text;
    while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r') {
        s++;
    }
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\n' || s[n - 1] == '\t' || s[n - 1] == '\r')) {
        n--;
    }
    if (n >= cap) {
        n = cap - 1;
    }
    memcpy(out, s, n);
    out[n] = '\0';
    free(text);
}

/* ---- the config ------------------------------------------------------------------- */

static void reset_model(void) {
    for (int i = 0; i < ngpus; i++) {
        free(gpus[i].extra);
    }
    memset(gpus, 0, sizeof gpus);
    ngpus = 0;
    nvisible = 0;
    strcpy(driver_version, "580.95.05");
    cuda_version = 13000;
    state_path[0] = events_path[0] = '\0';
    strcpy(dev_root, "/dev");
    strcpy(boot_id_path, "/proc/sys/kernel/random/boot_id");
    seen_kind = 0;
    free(top_extra);
    free(other_gpus);
    top_extra = other_gpus = NULL;
    events_scanned = -1;
}

static void set_path(char *dst, const char *value) {
    if (strcmp(value, "-") == 0) {
        dst[0] = '\0';
    } else {
        snprintf(dst, 4096, "%s", value);
    }
}

static struct profile *profile_by_id(struct gpu *g, unsigned id) {
    for (int i = 0; i < g->nprof; i++) {
        if (g->prof[i].id == id) {
            return &g->prof[i];
        }
    }
    return NULL;
}

/* Parse the config text (see e2e/harness/mocknvml/__init__.py); unknown lines are ignored. */
static void parse_config(const char *text) {
    reset_model();
    char *copy = strdup(text);
    if (copy == NULL) {
        return;
    }
    struct gpu *g = NULL;
    char *save = NULL;
    for (char *line = strtok_r(copy, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        char *sp = strchr(line, ' ');
        const char *rest = sp ? sp + 1 : "";
        size_t klen = sp ? (size_t)(sp - line) : strlen(line);
        char key[32];
        if (klen == 0 || klen >= sizeof key || line[0] == '#') {
            continue;
        }
        memcpy(key, line, klen);
        key[klen] = '\0';
        if (strcmp(key, "driver_version") == 0) {
            snprintf(driver_version, sizeof driver_version, "%s", rest);
        } else if (strcmp(key, "cuda_version") == 0) {
            cuda_version = atoi(rest);
        } else if (strcmp(key, "state_file") == 0) {
            set_path(state_path, rest);
        } else if (strcmp(key, "events_file") == 0) {
            set_path(events_path, rest);
        } else if (strcmp(key, "dev_root") == 0) {
            set_path(dev_root, rest);
        } else if (strcmp(key, "boot_id_file") == 0) {
            set_path(boot_id_path, rest);
        } else if (strcmp(key, "gpu") == 0) {
            if (ngpus >= MAX_GPUS) {
                g = NULL;
                continue;
            }
            g = &gpus[ngpus++];
            memset(g, 0, sizeof *g);
            snprintf(g->uuid, sizeof g->uuid, "%s", rest);
            g->numa = -1;
            g->events_supported = 1;
        } else if (g == NULL) {
            continue;
        } else if (strcmp(key, "name") == 0) {
            snprintf(g->name, sizeof g->name, "%s", rest);
        } else if (strcmp(key, "minor") == 0) {
            g->minor = (unsigned)strtoul(rest, NULL, 10);
        } else if (strcmp(key, "bus_id") == 0) {
            snprintf(g->bus, sizeof g->bus, "%s", rest);
        } else if (strcmp(key, "pci_device_id") == 0) {
            g->pci_id = (unsigned)strtoul(rest, NULL, 0);
        } else if (strcmp(key, "memory_mib") == 0) {
            g->mem_mib = strtoull(rest, NULL, 10);
        } else if (strcmp(key, "numa_node") == 0) {
            g->numa = atoi(rest);
        } else if (strcmp(key, "brand") == 0) {
            g->brand = (unsigned)strtoul(rest, NULL, 10);
        } else if (strcmp(key, "architecture") == 0) {
            g->arch = (unsigned)strtoul(rest, NULL, 10);
        } else if (strcmp(key, "compute_capability") == 0) {
            if (sscanf(rest, "%u %u", &g->cc_major, &g->cc_minor) != 2) {
                g->cc_major = g->cc_minor = 0;
            }
        } else if (strcmp(key, "mig") == 0) {
            int enabled = 0;
            if (sscanf(rest, "%d %u %d", &g->mig_capable, &g->max_mig, &enabled) == 3) {
                g->initial.enabled = g->initial.pending = enabled != 0;
            }
        } else if (strcmp(key, "events_supported") == 0) {
            g->events_supported = atoi(rest) != 0;
        } else if (strcmp(key, "busy") == 0) {
            g->busy = atoi(rest) != 0;
        } else if (strcmp(key, "profile") == 0) {
            if (g->nprof >= MAX_PROFILES) {
                continue;
            }
            struct profile *p = &g->prof[g->nprof];
            int used = 0;
            if (sscanf(rest, "%u %u %u %u %u %u %u %u %u %u %llu %n", &p->index, &p->id, &p->slices,
                       &p->count, &p->sms, &p->ce, &p->dec, &p->enc, &p->jpeg, &p->ofa, &p->mem_mib,
                       &used) >= 11 &&
                used > 0) {
                snprintf(p->name, sizeof p->name, "%s", rest + used);
                g->nprof++;
            }
        } else if (strcmp(key, "placement") == 0) {
            unsigned id, start, size, gi;
            if (sscanf(rest, "%u %u %u %u", &id, &start, &size, &gi) == 4) {
                struct profile *p = profile_by_id(g, id);
                if (p != NULL && p->nplace < MAX_PLACEMENTS && gi < MAX_GI) {
                    p->place[p->nplace++] = (struct placement){start, size, gi};
                }
            }
        } else if (strcmp(key, "mig_uuid") == 0) {
            unsigned gi, ci;
            char uuid[64];
            if (sscanf(rest, "%u %u %63s", &gi, &ci, uuid) == 3 && gi < MAX_GI && ci < MAX_CI) {
                snprintf(g->mig_uuid[gi][ci], sizeof g->mig_uuid[gi][ci], "%s", uuid);
            }
        } else if (strcmp(key, "layout") == 0) {
            unsigned gi, id, start, size, cis;
            if (sscanf(rest, "%u %u %u %u %u", &gi, &id, &start, &size, &cis) == 5 && gi < MAX_GI) {
                g->initial.gi[gi] = (struct gi_state){1, id, start, size, cis};
            }
        }
    }
    free(copy);
    for (int i = 0; i < ngpus; i++) {
        gpus[i].st = gpus[i].initial;
    }
}

/* ---- events file: lost GPUs ----------------------------------------------------------- */

static int gpu_by_uuid(const char *uuid) {
    for (int i = 0; i < ngpus; i++) {
        if (strcmp(gpus[i].uuid, uuid) == 0) {
            return i;
        }
    }
    return -1;
}

/* Mark the GPUs a "lost" line names, when the events file grew. */
static void scan_lost(void) {
    if (events_path[0] == '\0') {
        return;
    }
    struct stat st;
    if (stat(events_path, &st) != 0) {
        return;
    }
    if (st.st_size == events_scanned && st.st_ino == events_ino) {
        return;
    }
    size_t len = 0;
    char *text = read_file(events_path, MAX_EVENTS_FILE, &len);
    if (text == NULL) {
        return;
    }
    events_scanned = st.st_size;
    events_ino = st.st_ino;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
        char uuid[UUID_LEN];
        if (sscanf(line, "lost %95s", uuid) == 1) {
            int g = gpu_by_uuid(uuid);
            if (g >= 0) {
                gpus[g].lost = 1;
            }
        }
    }
    free(text);
}

/* ---- the state file: a small bounded JSON reader --------------------------------------- */

struct jp {
    const char *s;
    size_t n, i;
};

static void j_ws(struct jp *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\n' || p->s[p->i] == '\t' || p->s[p->i] == '\r')) {
        p->i++;
    }
}

static int j_peek(struct jp *p) {
    j_ws(p);
    return p->i < p->n ? (unsigned char)p->s[p->i] : -1;
}

static int j_eat(struct jp *p, char c) {
    if (j_peek(p) != (unsigned char)c) {
        return 0;
    }
    p->i++;
    return 1;
}

/* A string into out (truncation is an error); \u escapes above ASCII become '?'. */
static int j_string(struct jp *p, char *out, size_t cap) {
    if (!j_eat(p, '"')) {
        return 0;
    }
    size_t o = 0;
    while (p->i < p->n) {
        char c = p->s[p->i++];
        if (c == '"') {
            if (out != NULL) {
                out[o] = '\0';
            }
            return 1;
        }
        if ((unsigned char)c < 0x20) {
            return 0;
        }
        if (c == '\\') {
            if (p->i >= p->n) {
                return 0;
            }
            char e = p->s[p->i++];
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u': {
                if (p->i + 4 > p->n) {
                    return 0;
                }
                unsigned v = 0;
                for (int k = 0; k < 4; k++) {
                    char h = p->s[p->i++];
                    v <<= 4;
                    if (h >= '0' && h <= '9') v |= (unsigned)(h - '0');
                    else if (h >= 'a' && h <= 'f') v |= (unsigned)(h - 'a' + 10);
                    else if (h >= 'A' && h <= 'F') v |= (unsigned)(h - 'A' + 10);
                    else return 0;
                }
                c = v < 0x80 && v > 0 ? (char)v : '?';
                break;
            }
            default:
                return 0;
            }
        }
        if (out != NULL) {
            if (o + 1 >= cap) {
                return 0;
            }
            out[o++] = c;
        }
    }
    return 0;
}

static int j_int(struct jp *p, long long *out) {
    j_ws(p);
    size_t start = p->i;
    if (p->i < p->n && p->s[p->i] == '-') {
        p->i++;
    }
    size_t digits = p->i;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        p->i++;
    }
    if (p->i == digits || p->i - start > 18) {
        return 0;
    }
    if (p->i < p->n && (p->s[p->i] == '.' || p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
        return 0; /* whole numbers only, as the state file has */
    }
    char buf[24];
    memcpy(buf, p->s + start, p->i - start);
    buf[p->i - start] = '\0';
    *out = strtoll(buf, NULL, 10);
    return 1;
}

static int j_word(struct jp *p, const char *w) {
    size_t n = strlen(w);
    j_ws(p);
    if (p->n - p->i < n || memcmp(p->s + p->i, w, n) != 0) {
        return 0;
    }
    p->i += n;
    return 1;
}

static int j_bool(struct jp *p, int *out) {
    if (j_word(p, "true")) {
        *out = 1;
        return 1;
    }
    if (j_word(p, "false")) {
        *out = 0;
        return 1;
    }
    return 0;
}

static int j_skip(struct jp *p, int depth) {
    if (depth > 32) {
        return 0;
    }
    int c = j_peek(p);
    if (c == '"') {
        return j_string(p, NULL, 0);
    }
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        p->i++;
        if (j_eat(p, close)) {
            return 1;
        }
        for (;;) {
            if (c == '{') {
                if (!j_string(p, NULL, 0) || !j_eat(p, ':')) {
                    return 0;
                }
            }
            if (!j_skip(p, depth + 1)) {
                return 0;
            }
            if (j_eat(p, close)) {
                return 1;
            }
            if (!j_eat(p, ',')) {
                return 0;
            }
        }
    }
    if (j_word(p, "true") || j_word(p, "false") || j_word(p, "null")) {
        return 1;
    }
    j_ws(p);
    size_t start = p->i;
    while (p->i < p->n && strchr("+-0123456789.eE", p->s[p->i]) != NULL) {
        p->i++;
    }
    return p->i > start;
}

/* Object iteration: 1 with the key read and ':' eaten, 0 at the end, -1 on an error.
 * key_start/key_end: the raw key with its quotes. */
static int j_next_key(struct jp *p, int *first, char *key, size_t cap, size_t *key_start, size_t *key_end) {
    if (j_eat(p, '}')) {
        return 0;
    }
    if (!*first && !j_eat(p, ',')) {
        return -1;
    }
    *first = 0;
    j_ws(p);
    *key_start = p->i;
    if (!j_string(p, key, cap)) {
        return -1;
    }
    *key_end = p->i;
    return j_eat(p, ':') ? 1 : -1;
}

static void extra_add(char **extra, const char *s, size_t ks, size_t ke, size_t vs, size_t ve) {
    struct sb b = {0};
    if (*extra != NULL) {
        sb_str(&b, *extra);
        sb_str(&b, ", ");
        free(*extra);
    }
    sb_add(&b, s + ks, ke - ks);
    sb_str(&b, ": ");
    sb_add(&b, s + vs, ve - vs);
    *extra = b.p;
}

/* One "gpuInstances" item into st (validated as the simulated backend does). */
static int parse_instance(struct jp *p, struct gpu *g, struct mig_state *st, int keep) {
    long long id = -1, profile = -1, start = -1, size = -1;
    unsigned cis = 0;
    int have_cis = 0, first = 1, r;
    char key[64];
    size_t ks, ke;
    if (!j_eat(p, '{')) {
        return 0;
    }
    while ((r = j_next_key(p, &first, key, sizeof key, &ks, &ke)) == 1) {
        if (strcmp(key, "id") == 0) {
            if (!j_int(p, &id)) return 0;
        } else if (strcmp(key, "profileId") == 0) {
            if (!j_int(p, &profile)) return 0;
        } else if (strcmp(key, "start") == 0) {
            if (!j_int(p, &start)) return 0;
        } else if (strcmp(key, "size") == 0) {
            if (!j_int(p, &size)) return 0;
        } else if (strcmp(key, "computeInstances") == 0) {
            have_cis = 1;
            if (!j_eat(p, '[')) return 0;
            if (!j_eat(p, ']')) {
                for (;;) {
                    long long ci;
                    if (!j_int(p, &ci) || ci < 0 || ci >= MAX_CI) return 0;
                    cis |= 1u << ci;
                    if (j_eat(p, ']')) break;
                    if (!j_eat(p, ',')) return 0;
                }
            }
        } else if (!j_skip(p, 0)) {
            return 0;
        }
    }
    if (r < 0 || !have_cis || profile < 0) {
        return 0;
    }
    struct profile *prof = profile_by_id(g, (unsigned)profile);
    if (prof == NULL) {
        return 0;
    }
    int found = 0;
    for (unsigned k = 0; k < prof->nplace; k++) {
        struct placement *pl = &prof->place[k];
        if (pl->start == start && pl->size == size && pl->gi_id == id) {
            found = 1;
        }
    }
    if (!found) {
        return 0;
    }
    if (keep) {
        st->gi[id] = (struct gi_state){1, (unsigned)profile, (unsigned)start, (unsigned)size, cis};
    }
    return 1;
}

/* One GPU's entry. reboot: a file from another boot (instances, time slice and compute
 * mode go). */
static int parse_gpu_entry(struct jp *p, struct gpu *g, int reboot, struct mig_state *st, char **extra) {
    int first = 1, r, enabled = -1, pending = -1, have_gis = 0;
    long long compute_mode = NVML_COMPUTEMODE_DEFAULT;
    char key[64];
    size_t ks, ke;
    memset(st, 0, sizeof *st);
    if (!j_eat(p, '{')) {
        return 0;
    }
    while ((r = j_next_key(p, &first, key, sizeof key, &ks, &ke)) == 1) {
        if (strcmp(key, "migEnabled") == 0) {
            if (!j_bool(p, &enabled)) return 0;
        } else if (strcmp(key, "migPending") == 0) {
            if (!j_bool(p, &pending)) return 0;
        } else if (strcmp(key, "computeMode") == 0) {
            /* Validated as the simulated backend does: a bad value damages the file. */
            if (!j_int(p, &compute_mode) || compute_mode < 0 || compute_mode >= NVML_COMPUTEMODE_COUNT) return 0;
        } else if (strcmp(key, "gpuInstances") == 0) {
            have_gis = 1;
            if (!j_eat(p, '[')) return 0;
            if (!j_eat(p, ']')) {
                for (;;) {
                    if (!parse_instance(p, g, st, !reboot)) return 0;
                    if (j_eat(p, ']')) break;
                    if (!j_eat(p, ',')) return 0;
                }
            }
        } else {
            j_ws(p);
            size_t vs = p->i;
            if (!j_skip(p, 0)) return 0;
            if (!(reboot && strcmp(key, "timeSlice") == 0)) {
                extra_add(extra, p->s, ks, ke, vs, p->i);
            }
        }
    }
    if (r < 0 || enabled < 0 || !have_gis) {
        return 0;
    }
    if (pending < 0) {
        pending = enabled;
    }
    if (reboot) {
        /* A reset applies the pending mode (Ampere); instances are gone, and the compute
         * mode is DEFAULT again (Linux does not keep it across reboots). */
        st->enabled = st->pending = pending;
    } else {
        st->enabled = enabled;
        st->pending = pending;
        st->compute_mode = (unsigned)compute_mode;
    }
    return 1;
}

/* Parse a whole state file into the GPUs; 0 when it is not ours (nothing changed). */
static int parse_state(const char *text, size_t len) {
    struct jp p = {text, len, 0};
    struct mig_state states[MAX_GPUS];
    int found[MAX_GPUS] = {0};
    char *extras[MAX_GPUS] = {0};
    char *top = NULL, *others = NULL;
    char key[128], boot[128] = "", current[128];
    long long version = -1;
    int first = 1, r, ok = 0;
    size_t ks, ke, gpus_at = 0;
    int have_gpus = 0, have_boot = 0;
    if (!j_eat(&p, '{')) {
        return 0;
    }
    /* First pass: version and boot id (the gpus entry needs to know about a reboot). */
    while ((r = j_next_key(&p, &first, key, sizeof key, &ks, &ke)) == 1) {
        j_ws(&p);
        size_t vs = p.i;
        if (strcmp(key, "version") == 0) {
            if (!j_int(&p, &version)) return 0;
        } else if (strcmp(key, "bootId") == 0) {
            if (!j_string(&p, boot, sizeof boot)) return 0;
            have_boot = 1;
        } else if (strcmp(key, "gpus") == 0) {
            have_gpus = 1;
            gpus_at = vs;
            if (!j_skip(&p, 0)) return 0;
        } else {
            if (!j_skip(&p, 0)) return 0;
            extra_add(&top, p.s, ks, ke, vs, p.i);
        }
    }
    if (r < 0 || version != 1 || !have_boot || !have_gpus || j_peek(&p) != -1) {
        free(top);
        return 0;
    }
    read_boot_id(current, sizeof current);
    int reboot = strcmp(boot, current) != 0;
    loaded_from_reboot = reboot;
    p.i = gpus_at;
    first = 1;
    if (!j_eat(&p, '{')) {
        goto out;
    }
    while ((r = j_next_key(&p, &first, key, sizeof key, &ks, &ke)) == 1) {
        int g = gpu_by_uuid(key);
        j_ws(&p);
        size_t vs = p.i;
        if (g < 0) {
            if (!j_skip(&p, 0)) goto out;
            extra_add(&others, p.s, ks, ke, vs, p.i);
            continue;
        }
        if (!parse_gpu_entry(&p, &gpus[g], reboot, &states[g], &extras[g])) {
            goto out;
        }
        found[g] = 1;
    }
    if (r < 0) {
        goto out;
    }
    ok = 1;
    for (int i = 0; i < ngpus; i++) {
        free(gpus[i].extra);
        gpus[i].extra = extras[i];
        extras[i] = NULL;
        gpus[i].st = found[i] ? states[i] : gpus[i].initial;
    }
    free(top_extra);
    free(other_gpus);
    top_extra = top;
    other_gpus = others;
    top = others = NULL;
out:
    for (int i = 0; i < ngpus; i++) {
        free(extras[i]);
    }
    free(top);
    free(others);
    return ok;
}

static void all_initial(void) {
    for (int i = 0; i < ngpus; i++) {
        gpus[i].st = gpus[i].initial;
        free(gpus[i].extra);
        gpus[i].extra = NULL;
    }
    free(top_extra);
    free(other_gpus);
    top_extra = other_gpus = NULL;
}

static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_ino == b->st_ino && a->st_dev == b->st_dev && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

static int lock_state(void);
static void unlock_state(int fd);
static void write_state(void);

/* Re-read the state file when it changed since we last read or wrote it. */
static void refresh_state(void) {
    if (state_path[0] == '\0') {
        return;
    }
    struct stat st;
    if (stat(state_path, &st) != 0) {
        if (seen_kind != 1) {
            all_initial();
            seen_kind = 1;
        }
        return;
    }
    if (seen_kind == 2 && same_file(&st, &seen_stat)) {
        return;
    }
    size_t len = 0;
    loaded_from_reboot = 0;
    char *text = read_file(state_path, MAX_STATE_FILE, &len);
    if (text == NULL || !parse_state(text, len)) {
        /* Damaged: start as if there were no file (the simulated backend does so too). */
        all_initial();
    }
    free(text);
    seen_kind = 2;
    seen_stat = st;
    if (loaded_from_reboot && !state_locked) {
        /* Record what the reboot did (pending MIG modes applied, instances gone) so the
         * simulated backend sharing the file sees the same GPUs. */
        int fd = lock_state();
        loaded_from_reboot = 0;
        if (stat(state_path, &st) == 0 && same_file(&st, &seen_stat)) {
            write_state();
        }
        unlock_state(fd);
    }
}

static void write_state(void) {
    if (state_path[0] == '\0') {
        return;
    }
    char boot[128];
    read_boot_id(boot, sizeof boot);
    struct sb b = {0};
    sb_str(&b, "{\n  \"version\": 1,\n  \"bootId\": ");
    sb_json_string(&b, boot);
    sb_str(&b, ",\n  \"gpus\": {");
    int first = 1;
    for (int i = 0; i < ngpus; i++) {
        struct gpu *g = &gpus[i];
        if (!g->mig_capable && g->extra == NULL && g->st.compute_mode == NVML_COMPUTEMODE_DEFAULT) {
            continue;
        }
        sb_str(&b, first ? "\n    " : ",\n    ");
        first = 0;
        sb_json_string(&b, g->uuid);
        sb_str(&b, ": {");
        /* Every entry has MIG mode and instances, a GPU without MIG too (off, none): the
         * simulated backend requires them. */
        sb_fmt(&b, "\"migEnabled\": %s, ", g->st.enabled ? "true" : "false");
        if (g->st.pending != g->st.enabled) {
            sb_fmt(&b, "\"migPending\": %s, ", g->st.pending ? "true" : "false");
        }
        sb_str(&b, "\"gpuInstances\": [");
        int firstgi = 1;
        for (int k = 0; k < MAX_GI; k++) {
            struct gi_state *gi = &g->st.gi[k];
            if (!gi->exists) {
                continue;
            }
            sb_fmt(&b, "%s{\"id\": %d, \"profileId\": %u, \"start\": %u, \"size\": %u, \"computeInstances\": [",
                   firstgi ? "" : ", ", k, gi->profile_id, gi->start, gi->size);
            firstgi = 0;
            int firstci = 1;
            for (int c = 0; c < MAX_CI; c++) {
                if (gi->ci_mask & (1u << c)) {
                    sb_fmt(&b, "%s%d", firstci ? "" : ", ", c);
                    firstci = 0;
                }
            }
            sb_str(&b, "]}");
        }
        sb_str(&b, "]");
        if (g->st.compute_mode != NVML_COMPUTEMODE_DEFAULT) {
            sb_fmt(&b, ", \"computeMode\": %u", g->st.compute_mode);
        }
        if (g->extra != NULL) {
            sb_str(&b, ", ");
            sb_str(&b, g->extra);
        }
        sb_str(&b, "}");
    }
    if (other_gpus != NULL) {
        sb_str(&b, first ? "\n    " : ",\n    ");
        sb_str(&b, other_gpus);
    }
    sb_str(&b, "\n  }");
    if (top_extra != NULL) {
        sb_str(&b, ",\n  ");
        sb_str(&b, top_extra);
    }
    sb_str(&b, "\n}\n");

    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp-mocknvml-%d", state_path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
        size_t off = 0;
        while (off < b.n) {
            ssize_t n = write(fd, b.p + off, b.n - off);
            if (n < 0 && errno == EINTR) {
                continue;
            }
            if (n <= 0) {
                break;
            }
            off += (size_t)n;
        }
        close(fd);
        if (off == b.n && rename(tmp, state_path) == 0) {
            struct stat st;
            if (stat(state_path, &st) == 0) {
                seen_kind = 2;
                seen_stat = st;
            }
        } else {
            unlink(tmp);
        }
    }
    free(b.p);
}

static int lock_state(void) {
    if (state_path[0] == '\0') {
        return -1;
    }
    char lock[4200];
    snprintf(lock, sizeof lock, "%s.lock", state_path);
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        return -1;
    }
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    state_locked = 1;
    return fd;
}

static void unlock_state(int fd) {
    if (fd >= 0) {
        state_locked = 0;
        flock(fd, LOCK_UN);
        close(fd);
    }
}

/* ---- handles ----------------------------------------------------------------------- */

#define IN_ARRAY(ptr, array)                                                                    \
    ((uintptr_t)(ptr) >= (uintptr_t)(array) && (uintptr_t)(ptr) < (uintptr_t)(array) + sizeof(array) && \
     ((uintptr_t)(ptr) - (uintptr_t)(array)) % sizeof(struct handle) == 0)

static void init_handles(void) {
    for (int g = 0; g < MAX_GPUS; g++) {
        gpu_handles[g] = (struct handle){g, -1, -1};
        for (int i = 0; i < MAX_GI; i++) {
            gi_handles[g][i] = (struct handle){g, i, -1};
            for (int c = 0; c < MAX_CI; c++) {
                mig_handles[g][i][c] = (struct handle){g, i, c};
                ci_handles[g][i][c] = (struct handle){g, i, c};
            }
        }
    }
}

static nvmlDevice_t gpu_handle(int g) { return (nvmlDevice_t)(void *)&gpu_handles[g]; }

static int mig_exists(int g, int gi, int ci) {
    struct gpu *gp = &gpus[g];
    return gp->st.enabled && gi >= 0 && gi < MAX_GI && ci >= 0 && ci < MAX_CI && gp->st.gi[gi].exists &&
           (gp->st.gi[gi].ci_mask & (1u << ci));
}

/* A device handle: g the GPU, gi and ci the MIG device's ids (-1 for a full GPU). */
static nvmlReturn_t device_of(nvmlDevice_t device, int *g, int *gi, int *ci) {
    const struct handle *h = (const struct handle *)(void *)device;
    if (IN_ARRAY(h, gpu_handles)) {
        *gi = *ci = -1;
    } else if (IN_ARRAY(h, mig_handles)) {
        *gi = h->gi;
        *ci = h->ci;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *g = h->gpu;
    if (*g >= ngpus) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    scan_lost();
    if (gpus[*g].lost) {
        return NVML_ERROR_GPU_IS_LOST;
    }
    if (*gi >= 0) {
        refresh_state();
        if (!mig_exists(*g, *gi, *ci)) {
            return NVML_ERROR_NOT_FOUND;
        }
    }
    return NVML_SUCCESS;
}

/* A full GPU's handle (a MIG device's is INVALID_ARGUMENT). */
static nvmlReturn_t full_gpu(nvmlDevice_t device, int *g) {
    int gi, ci;
    nvmlReturn_t r = device_of(device, g, &gi, &ci);
    if (r == NVML_SUCCESS && gi >= 0) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return r;
}

/* A full GPU with MIG at all (NOT_SUPPORTED otherwise). */
static nvmlReturn_t mig_gpu(nvmlDevice_t device, int *g) {
    nvmlReturn_t r = full_gpu(device, g);
    if (r == NVML_SUCCESS && !gpus[*g].mig_capable) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    return r;
}

static nvmlReturn_t gpu_instance_of(nvmlGpuInstance_t gpuInstance, int *g, int *gi) {
    const struct handle *h = (const struct handle *)(void *)gpuInstance;
    if (!IN_ARRAY(h, gi_handles) || h->gpu >= ngpus) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *g = h->gpu;
    *gi = h->gi;
    scan_lost();
    if (gpus[*g].lost) {
        return NVML_ERROR_GPU_IS_LOST;
    }
    refresh_state();
    if (!gpus[*g].st.enabled || !gpus[*g].st.gi[*gi].exists) {
        return NVML_ERROR_INVALID_ARGUMENT; /* a destroyed instance's handle */
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t compute_instance_of(nvmlComputeInstance_t computeInstance, int *g, int *gi, int *ci) {
    const struct handle *h = (const struct handle *)(void *)computeInstance;
    if (!IN_ARRAY(h, ci_handles) || h->gpu >= ngpus) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *g = h->gpu;
    *gi = h->gi;
    *ci = h->ci;
    scan_lost();
    if (gpus[*g].lost) {
        return NVML_ERROR_GPU_IS_LOST;
    }
    refresh_state();
    if (!mig_exists(*g, *gi, *ci)) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

/* The nvidia-caps minor of GPU instance gi (ci < 0) or of its compute instance ci on the
 * GPU of minor `minor`: /proc/driver/nvidia-caps/mig-minors' numbering (config 1,
 * monitor 2, then per GPU 15 GPU instances of 1 + 8 minors each). */
static unsigned cap_minor(unsigned minor, int gi, int ci) {
    unsigned base = 3 + minor * 135u + (unsigned)gi * 9u;
    return ci < 0 ? base : base + 1u + (unsigned)ci;
}

/* Whether this process may use MIG device (gi, ci) of GPU g: both its capability nodes
 * are in the dev root, where capabilities are checked at all (see the header). */
static int mig_accessible(int g, int gi, int ci) {
    if (!caps_checked) {
        return 1;
    }
    const int which[2] = {-1, ci};
    for (int k = 0; k < 2; k++) {
        char node[4200];
        snprintf(node, sizeof node, "%s/nvidia-caps/nvidia-cap%u", used_dev_root,
                 cap_minor(gpus[g].minor, gi, which[k]));
        if (access(node, F_OK) != 0) {
            return 0;
        }
    }
    return 1;
}

/* The MIG devices NVML enumerates: compute instances, by GPU then compute instance id,
 * those this process may use (mig_accessible) only. */
static int mig_slots(int g, int slots[][2], int max) {
    int n = 0;
    struct gpu *gp = &gpus[g];
    if (!gp->st.enabled) {
        return 0;
    }
    for (int gi = 0; gi < MAX_GI; gi++) {
        for (int ci = 0; ci < MAX_CI; ci++) {
            if (mig_exists(g, gi, ci) && mig_accessible(g, gi, ci) && n < max) {
                slots[n][0] = gi;
                slots[n][1] = ci;
                n++;
            }
        }
    }
    return n;
}

static struct profile *profile_of_gi(int g, int gi) {
    return profile_by_id(&gpus[g], gpus[g].st.gi[gi].profile_id);
}

static struct profile *full_profile(struct gpu *g) {
    struct profile *best = NULL;
    for (int i = 0; i < g->nprof; i++) {
        if (best == NULL || g->prof[i].slices > best->slices) {
            best = &g->prof[i];
        }
    }
    return best;
}

/* ---- locking wrappers ------------------------------------------------------------------- */

#define API(expr)                                                                          \
    do {                                                                                   \
        pthread_mutex_lock(&mu);                                                           \
        nvmlReturn_t api_r_ = init_count > 0 ? (expr) : NVML_ERROR_UNINITIALIZED;          \
        pthread_mutex_unlock(&mu);                                                         \
        return api_r_;                                                                     \
    } while (0)

/* ---- init ---------------------------------------------------------------------------- */

static nvmlReturn_t load_config(void) {
    const char *path = getenv("DRASIL_MOCK_NVML_CONFIG");
    char *text;
    if (path != NULL && *path != '\0') {
        text = read_file(path, MAX_STATE_FILE, NULL);
        if (text == NULL) {
            fprintf(stderr, "mock NVML: cannot read the config %s (DRASIL_MOCK_NVML_CONFIG): %s\n", path,
                    strerror(errno));
            return NVML_ERROR_UNKNOWN;
        }
    } else {
        text = strdup(mock_nvml_embedded_config);
        if (text == NULL) {
            return NVML_ERROR_MEMORY;
        }
    }
    if (loaded_config != NULL && strcmp(loaded_config, text) == 0) {
        free(text);
        /* The same node: keep the in-memory state (the GPUs outlive a shutdown), but
         * read the state and events files afresh. */
        seen_kind = 0;
        events_scanned = -1;
        for (int i = 0; i < ngpus; i++) {
            gpus[i].lost = 0;
        }
    } else {
        free(loaded_config);
        loaded_config = text;
        parse_config(text);
    }
    nvisible = 0;
    /* Inside a container the node's dev root is not there: the container's /dev is,
     * holding exactly the nodes its CDI spec gave it (as real NVML sees them). */
    struct stat st;
    int own_root = stat(dev_root, &st) == 0 && S_ISDIR(st.st_mode);
    const char *root = own_root ? dev_root : "/dev";
    snprintf(used_dev_root, sizeof used_dev_root, "%s", root);
    char caps[4200];
    snprintf(caps, sizeof caps, "%s/nvidia-caps", root);
    caps_checked = !own_root || (stat(caps, &st) == 0 && S_ISDIR(st.st_mode));
    for (int i = 0; i < ngpus; i++) {
        char node[4200];
        snprintf(node, sizeof node, "%s/nvidia%u", root, gpus[i].minor);
        if (access(node, F_OK) == 0) {
            visible[nvisible++] = i;
        }
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t do_init(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_handles);
    pthread_mutex_lock(&mu);
    nvmlReturn_t r = NVML_SUCCESS;
    if (init_count == 0) {
        r = load_config();
    }
    if (r == NVML_SUCCESS) {
        init_count++;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
EXPORT nvmlReturn_t nvmlInit(void) { return do_init(); }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init();
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    /* nvml.h: no error when called more times than init. */
    if (init_count > 0) {
        init_count--;
    }
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}

EXPORT int mockNvmlInitCount(void) {
    pthread_mutex_lock(&mu);
    int n = init_count;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT void mockNvmlReset(void) {
    pthread_mutex_lock(&mu);
    init_count = 0;
    free(loaded_config);
    loaded_config = NULL;
    reset_model();
    memset(event_sets, 0, sizeof event_sets);
    pthread_mutex_unlock(&mu);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version mismatch";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ---- system ------------------------------------------------------------------------- */

static nvmlReturn_t get_cuda(int *v) {
    if (v == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *v = cuda_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    API(copy_string(driver_version, version, length));
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    char v[96];
    snprintf(v, sizeof v, "13.%s", driver_version);
    API(copy_string(v, version, length));
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { API(get_cuda(v)); }
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { API(get_cuda(v)); }

static nvmlReturn_t get_count(unsigned int *count) {
    if (count == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *count = (unsigned)nvisible;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { API(get_count(count)); }
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { API(get_count(count)); }

static nvmlReturn_t handle_by_index(unsigned int index, nvmlDevice_t *device) {
    if (device == NULL || index >= (unsigned)nvisible) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = gpu_handle(visible[index]);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    API(handle_by_index(index, device));
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    API(handle_by_index(index, device));
}

static nvmlReturn_t handle_by_uuid(const char *uuid, nvmlDevice_t *device) {
    if (uuid == NULL || device == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (int k = 0; k < nvisible; k++) {
        int g = visible[k];
        if (strcmp(gpus[g].uuid, uuid) == 0) {
            *device = gpu_handle(g);
            return NVML_SUCCESS;
        }
        refresh_state();
        for (int gi = 0; gi < MAX_GI; gi++) {
            for (int ci = 0; ci < MAX_CI; ci++) {
                if (mig_exists(g, gi, ci) && strcmp(gpus[g].mig_uuid[gi][ci], uuid) == 0 &&
                    mig_accessible(g, gi, ci)) {
                    *device = (nvmlDevice_t)(void *)&mig_handles[g][gi][ci];
                    return NVML_SUCCESS;
                }
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    API(handle_by_uuid(uuid, device));
}

static nvmlReturn_t handle_by_bus(const char *bus, nvmlDevice_t *device) {
    if (bus == NULL || device == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (int k = 0; k < nvisible; k++) {
        const char *mine = gpus[visible[k]].bus;
        /* 00000000:3B:00.0 or 0000:3b:00.0 */
        size_t a = strlen(mine), b = strlen(bus);
        size_t tail = 7; /* "3B:00.0" */
        if (a >= tail && b >= tail && strcasecmp(mine + a - tail, bus + b - tail) == 0) {
            *device = gpu_handle(visible[k]);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *device) {
    API(handle_by_bus(bus, device));
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus, nvmlDevice_t *device) {
    API(handle_by_bus(bus, device));
}

/* ---- device queries ---------------------------------------------------------------------- */

static nvmlReturn_t get_index(nvmlDevice_t device, unsigned int *index) {
    int g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (index == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int k = 0; k < nvisible; k++) {
        if (visible[k] == g) {
            *index = (unsigned)k;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) { API(get_index(device, index)); }

static nvmlReturn_t get_name(nvmlDevice_t device, char *name, unsigned int length) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (gi < 0) return copy_string(gpus[g].name, name, length);
    char full[2 * NAME_LEN + 2];
    struct profile *p = profile_of_gi(g, gi);
    snprintf(full, sizeof full, "%s %s", gpus[g].name, p ? p->name : "MIG");
    return copy_string(full, name, length);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    API(get_name(device, name, length));
}

static nvmlReturn_t get_uuid(nvmlDevice_t device, char *uuid, unsigned int length) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    return copy_string(gi < 0 ? gpus[g].uuid : gpus[g].mig_uuid[gi][ci], uuid, length);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    API(get_uuid(device, uuid, length));
}

static nvmlReturn_t get_minor(nvmlDevice_t device, unsigned int *minor) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = gpus[g].minor; /* a MIG device answers its parent's */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    API(get_minor(device, minor));
}

static unsigned long long memory_mib(int g, int gi) {
    if (gi < 0) return gpus[g].mem_mib;
    struct profile *p = profile_of_gi(g, gi);
    return p ? p->mem_mib : 0;
}

static nvmlReturn_t get_memory(nvmlDevice_t device, nvmlMemory_t *memory) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = memory_mib(g, gi) << 20;
    *memory = (nvmlMemory_t){total, total, 0};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    API(get_memory(device, memory));
}

static nvmlReturn_t get_memory_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (memory == NULL || memory->version != nvmlMemory_v2) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total = memory_mib(g, gi) << 20;
    memory->total = total;
    memory->reserved = 0;
    memory->free = total;
    memory->used = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    API(get_memory_v2(device, memory));
}

static nvmlReturn_t get_pci(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    const char *bus = gpus[g].bus;
    unsigned domain = 0, b = 0, d = 0, f = 0;
    if (sscanf(bus, "%x:%x:%x.%x", &domain, &b, &d, &f) != 4) {
        return NVML_ERROR_UNKNOWN;
    }
    snprintf(pci->busId, sizeof pci->busId, "%s", bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xffff, b, d, f);
    pci->domain = domain;
    pci->bus = b;
    pci->device = d;
    pci->pciDeviceId = gpus[g].pci_id;
    pci->pciSubSystemId = gpus[g].pci_id;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) { API(get_pci(device, pci)); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { API(get_pci(device, pci)); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { API(get_pci(device, pci)); }

static nvmlReturn_t get_cc(nvmlDevice_t device, int *major, int *minor) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (major == NULL || minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *major = (int)gpus[g].cc_major;
    *minor = (int)gpus[g].cc_minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    API(get_cc(device, major, minor));
}

static nvmlReturn_t get_uint_fact(nvmlDevice_t device, unsigned int *out, int which) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *out = which == 0 ? gpus[g].brand : gpus[g].arch;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, unsigned int *type) { API(get_uint_fact(device, type, 0)); }
EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    API(get_uint_fact(device, arch, 1));
}

static nvmlReturn_t get_numa(nvmlDevice_t device, unsigned int *node) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (node == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpus[g].numa < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned)gpus[g].numa;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) { API(get_numa(device, node)); }

/* As the simulated backend answers (driver 580 on a host without HMM or ATS): None. */
static nvmlReturn_t get_addressing_mode(nvmlDevice_t device, nvmlDeviceAddressingMode_t *mode) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (mode->version != nvmlDeviceAddressingMode_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mode->value = NVML_DEVICE_ADDRESSING_MODE_NONE;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAddressingMode(nvmlDevice_t device, nvmlDeviceAddressingMode_t *mode) {
    API(get_addressing_mode(device, mode));
}

/* ---- MIG mode and MIG devices ----------------------------------------------------------- */

static nvmlReturn_t get_mig_mode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (current == NULL || pending == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    *current = (unsigned)gpus[g].st.enabled;
    *pending = (unsigned)gpus[g].st.pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    API(get_mig_mode(device, current, pending));
}

static int any_instance(struct gpu *g) {
    for (int k = 0; k < MAX_GI; k++) {
        if (g->st.gi[k].exists) return 1;
    }
    return 0;
}

static nvmlReturn_t set_mig_mode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *status) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (status == NULL || mode > 1) return NVML_ERROR_INVALID_ARGUMENT;
    int fd = lock_state();
    refresh_state();
    struct gpu *gp = &gpus[g];
    int want = (int)mode;
    if (gp->busy) {
        *status = NVML_ERROR_IN_USE;
    } else if (!want && gp->st.enabled && any_instance(gp)) {
        *status = NVML_ERROR_IN_USE; /* GPU instances exist: the GPU is not idle */
    } else if (gp->arch == ARCH_AMPERE) {
        /* Ampere: the pending mode applies at the next GPU reset. */
        gp->st.pending = want;
        *status = gp->st.pending != gp->st.enabled ? NVML_ERROR_RESET_REQUIRED : NVML_SUCCESS;
        write_state();
    } else {
        if (gp->st.enabled != want) {
            memset(gp->st.gi, 0, sizeof gp->st.gi);
        }
        gp->st.enabled = gp->st.pending = want;
        *status = NVML_SUCCESS;
        write_state();
    }
    unlock_state(fd);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    API(set_mig_mode(device, mode, activationStatus));
}

/* ---- compute mode ---------------------------------------------------------------------- */

/* A full GPU for the compute mode calls: a MIG device's handle is NOT_SUPPORTED (the
 * compute mode belongs to the whole GPU, as the simulated backend has it). */
static nvmlReturn_t compute_mode_gpu(nvmlDevice_t device, int *g) {
    int gi, ci;
    nvmlReturn_t r = device_of(device, g, &gi, &ci);
    if (r == NVML_SUCCESS && gi >= 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    return r;
}

static nvmlReturn_t get_compute_mode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    int g;
    nvmlReturn_t r = compute_mode_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    *mode = (nvmlComputeMode_t)gpus[g].st.compute_mode;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    API(get_compute_mode(device, mode));
}

/* The processes on a GPU: the mock's GPUs run none (a test's holder is a process with
 * the GPU's node open). NVML's two-call protocol: a count of 0 is NVML_SUCCESS with
 * nothing written. The info array is never touched, so its struct version is moot. */
static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *count) {
    int g;
    nvmlReturn_t r = compute_mode_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(
    nvmlDevice_t device, unsigned int *count, void *infos) {
    (void)infos;
    API(no_processes(device, count));
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(
    nvmlDevice_t device, unsigned int *count, void *infos) {
    (void)infos;
    API(no_processes(device, count));
}

static nvmlReturn_t set_compute_mode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    int g;
    nvmlReturn_t r = compute_mode_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if ((unsigned)mode >= NVML_COMPUTEMODE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    int fd = lock_state();
    refresh_state();
    gpus[g].st.compute_mode = (unsigned)mode;
    write_state();
    unlock_state(fd);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    API(set_compute_mode(device, mode));
}

static nvmlReturn_t max_mig(nvmlDevice_t device, unsigned int *count) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    *count = gpus[g].st.enabled ? gpus[g].max_mig : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    API(max_mig(device, count));
}

static nvmlReturn_t mig_by_index(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (mig == NULL || index >= gpus[g].max_mig) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    int slots[MAX_GI * MAX_CI][2];
    int n = mig_slots(g, slots, MAX_GI * MAX_CI);
    if ((int)index >= n) return NVML_ERROR_NOT_FOUND;
    *mig = (nvmlDevice_t)(void *)&mig_handles[g][slots[index][0]][slots[index][1]];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    API(mig_by_index(device, index, mig));
}

static nvmlReturn_t is_mig(nvmlDevice_t device, unsigned int *out) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *out = gi >= 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    API(is_mig(device, isMigDevice));
}

static nvmlReturn_t instance_id(nvmlDevice_t device, unsigned int *id, int compute) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (id == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (gi < 0) return NVML_ERROR_NOT_SUPPORTED;
    *id = (unsigned)(compute ? ci : gi);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) { API(instance_id(device, id, 0)); }
EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    API(instance_id(device, id, 1));
}

static nvmlReturn_t attributes(nvmlDevice_t device, nvmlDeviceAttributes_t *a) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (a == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct profile *p = gi >= 0 ? profile_of_gi(g, gi) : full_profile(&gpus[g]);
    if (p == NULL) return NVML_ERROR_NOT_SUPPORTED;
    a->multiprocessorCount = p->sms;
    a->sharedCopyEngineCount = p->ce;
    a->sharedDecoderCount = p->dec;
    a->sharedEncoderCount = p->enc;
    a->sharedJpegCount = p->jpeg;
    a->sharedOfaCount = p->ofa;
    a->gpuInstanceSliceCount = p->slices;
    a->computeInstanceSliceCount = p->slices; /* one compute instance spans its GPU instance */
    a->memorySizeMB = gi >= 0 ? p->mem_mib : gpus[g].mem_mib;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *a) { API(attributes(device, a)); }
EXPORT nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *a) { API(attributes(device, a)); }

static nvmlReturn_t parent_of(nvmlDevice_t mig, nvmlDevice_t *device) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(mig, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (device == NULL || gi < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *device = gpu_handle(g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *device) {
    API(parent_of(mig, device));
}

/* ---- GPU instance profiles and placements -------------------------------------------- */

static struct profile *profile_by_index(struct gpu *g, unsigned index) {
    for (int i = 0; i < g->nprof; i++) {
        if (g->prof[i].index == index) return &g->prof[i];
    }
    return NULL;
}

/* versioned: 0 for the unversioned call (works with MIG off), else 2 or 3. */
static nvmlReturn_t gi_profile(nvmlDevice_t device, unsigned int index, void *info, int versioned) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (info == NULL || index >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned version = versioned ? *(unsigned *)info : 0;
    if (versioned && version != nvmlGpuInstanceProfileInfo_v2 && version != nvmlGpuInstanceProfileInfo_v3) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    refresh_state();
    if (versioned && !gpus[g].st.enabled) return NVML_ERROR_NOT_SUPPORTED;
    struct profile *p = profile_by_index(&gpus[g], index);
    if (p == NULL) return NVML_ERROR_NOT_SUPPORTED;
    if (!versioned) {
        nvmlGpuInstanceProfileInfo_t *o = info;
        *o = (nvmlGpuInstanceProfileInfo_t){p->id, 0, p->slices, p->count, p->sms, p->ce, p->dec, p->enc,
                                            p->jpeg, p->ofa, p->mem_mib};
    } else if (version == nvmlGpuInstanceProfileInfo_v2) {
        nvmlGpuInstanceProfileInfo_v2_t *o = info;
        memset(o, 0, sizeof *o);
        *o = (nvmlGpuInstanceProfileInfo_v2_t){version, p->id, 0, p->slices, p->count, p->sms, p->ce, p->dec,
                                               p->enc, p->jpeg, p->ofa, p->mem_mib, {0}};
        snprintf(o->name, sizeof o->name, "%s", p->name);
    } else {
        nvmlGpuInstanceProfileInfo_v3_t *o = info;
        memset(o, 0, sizeof *o);
        *o = (nvmlGpuInstanceProfileInfo_v3_t){version, p->id, p->slices, p->count, p->sms, p->ce, p->dec,
                                               p->enc, p->jpeg, p->ofa, p->mem_mib, {0}, 0};
        snprintf(o->name, sizeof o->name, "%s", p->name);
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                        nvmlGpuInstanceProfileInfo_t *info) {
    API(gi_profile(device, profile, info, 0));
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_v2_t *info) {
    API(gi_profile(device, profile, info, 1));
}

static nvmlReturn_t placements(nvmlDevice_t device, unsigned int profileId, nvmlGpuInstancePlacement_t *out,
                               unsigned int *count) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct profile *p = profile_by_id(&gpus[g], profileId);
    if (p == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (out == NULL) {
        *count = p->nplace;
        return NVML_SUCCESS;
    }
    if (*count < p->nplace) {
        *count = p->nplace;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned k = 0; k < p->nplace; k++) {
        out[k] = (nvmlGpuInstancePlacement_t){p->place[k].start, p->place[k].size};
    }
    *count = p->nplace;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                  nvmlGpuInstancePlacement_t *out,
                                                                  unsigned int *count) {
    API(placements(device, profileId, out, count));
}
EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvmlDevice_t device, unsigned int profileId,
                                                               nvmlGpuInstancePlacement_t *out, unsigned int *count) {
    API(placements(device, profileId, out, count));
}

/* ---- GPU instances ---------------------------------------------------------------------- */

static nvmlReturn_t check_room(struct gpu *g, struct profile *p, unsigned start, unsigned size) {
    unsigned mine = 0, compute = 0;
    for (int k = 0; k < MAX_GI; k++) {
        struct gi_state *gi = &g->st.gi[k];
        if (!gi->exists) continue;
        if (gi->profile_id == p->id) mine++;
        if (gi->start < start + size && start < gi->start + gi->size) return NVML_ERROR_INSUFFICIENT_RESOURCES;
        struct profile *q = profile_by_id(g, gi->profile_id);
        compute += q ? q->slices : 0;
    }
    if (mine >= p->count) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    struct profile *full = full_profile(g);
    if (full != NULL && compute + p->slices > full->slices) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    return NVML_SUCCESS;
}

static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned int profileId, const nvmlGpuInstancePlacement_t *want,
                              nvmlGpuInstance_t *out) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int fd = lock_state();
    refresh_state();
    struct gpu *gp = &gpus[g];
    struct profile *p = profile_by_id(gp, profileId);
    const struct placement *at = NULL;
    if (!gp->st.enabled) {
        r = NVML_ERROR_NOT_SUPPORTED;
    } else if (p == NULL) {
        r = NVML_ERROR_INVALID_ARGUMENT;
    } else if (want != NULL) {
        for (unsigned k = 0; k < p->nplace; k++) {
            if (p->place[k].start == want->start && p->place[k].size == want->size) at = &p->place[k];
        }
        r = at == NULL ? NVML_ERROR_INVALID_ARGUMENT : check_room(gp, p, at->start, at->size);
    } else {
        r = NVML_ERROR_INSUFFICIENT_RESOURCES; /* the first placement that fits */
        for (unsigned k = 0; k < p->nplace && r != NVML_SUCCESS; k++) {
            r = check_room(gp, p, p->place[k].start, p->place[k].size);
            at = &p->place[k];
        }
    }
    if (r == NVML_SUCCESS) {
        gp->st.gi[at->gi_id] = (struct gi_state){1, p->id, at->start, at->size, 0};
        write_state();
        *out = (nvmlGpuInstance_t)(void *)&gi_handles[g][at->gi_id];
    }
    unlock_state(fd);
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                             const nvmlGpuInstancePlacement_t *placement,
                                                             nvmlGpuInstance_t *gpuInstance) {
    if (placement == NULL) {
        API(NVML_ERROR_INVALID_ARGUMENT);
    }
    API(create_gi(device, profileId, placement, gpuInstance));
}

EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                nvmlGpuInstance_t *gpuInstance) {
    API(create_gi(device, profileId, NULL, gpuInstance));
}

static nvmlReturn_t remaining(nvmlDevice_t device, unsigned int profileId, unsigned int *count) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    struct profile *p = profile_by_id(&gpus[g], profileId);
    if (!gpus[g].st.enabled) return NVML_ERROR_NOT_SUPPORTED;
    if (p == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    /* How many more fit, placing greedily (enough for a mock). */
    struct mig_state saved = gpus[g].st;
    unsigned n = 0;
    for (unsigned k = 0; k < p->nplace; k++) {
        if (check_room(&gpus[g], p, p->place[k].start, p->place[k].size) == NVML_SUCCESS) {
            gpus[g].st.gi[p->place[k].gi_id] = (struct gi_state){1, p->id, p->place[k].start, p->place[k].size, 0};
            n++;
        }
    }
    gpus[g].st = saved;
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                              unsigned int *count) {
    API(remaining(device, profileId, count));
}

static nvmlReturn_t list_gis(nvmlDevice_t device, unsigned int profileId, nvmlGpuInstance_t *out, unsigned int *count) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    if (!gpus[g].st.enabled) return NVML_ERROR_NOT_SUPPORTED;
    if (profile_by_id(&gpus[g], profileId) == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (int k = 0; k < MAX_GI; k++) {
        if (gpus[g].st.gi[k].exists && gpus[g].st.gi[k].profile_id == profileId) n++;
    }
    if (out == NULL || *count < n) {
        *count = n;
        return out == NULL && n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (int k = 0; k < MAX_GI; k++) {
        if (gpus[g].st.gi[k].exists && gpus[g].st.gi[k].profile_id == profileId) {
            out[n++] = (nvmlGpuInstance_t)(void *)&gi_handles[g][k];
        }
    }
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                              nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    API(list_gis(device, profileId, gpuInstances, count));
}

static nvmlReturn_t gi_by_id(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *out) {
    int g;
    nvmlReturn_t r = mig_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_state();
    if (!gpus[g].st.enabled) return NVML_ERROR_NOT_SUPPORTED;
    if (id >= MAX_GI || !gpus[g].st.gi[id].exists) return NVML_ERROR_NOT_FOUND;
    *out = (nvmlGpuInstance_t)(void *)&gi_handles[g][id];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    API(gi_by_id(device, id, gpuInstance));
}

static nvmlReturn_t gi_info(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    int g, gi;
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r != NVML_SUCCESS) return r;
    if (info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct gi_state *s = &gpus[g].st.gi[gi];
    *info = (nvmlGpuInstanceInfo_t){gpu_handle(g), (unsigned)gi, s->profile_id, {s->start, s->size}};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    API(gi_info(gpuInstance, info));
}

static nvmlReturn_t gi_destroy(nvmlGpuInstance_t gpuInstance) {
    int g, gi;
    int fd = lock_state();
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r == NVML_SUCCESS) {
        if (gpus[g].st.gi[gi].ci_mask) {
            r = NVML_ERROR_IN_USE;
        } else {
            memset(&gpus[g].st.gi[gi], 0, sizeof gpus[g].st.gi[gi]);
            write_state();
        }
    }
    unlock_state(fd);
    return r;
}

EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) { API(gi_destroy(gpuInstance)); }

/* ---- compute instances ------------------------------------------------------------------ */

/* NVML_COMPUTE_INSTANCE_PROFILE_* index → compute slices (0: none). */
static unsigned ci_index_slices(unsigned index) {
    static const unsigned slices[] = {1, 2, 3, 4, 7, 8, 6, 0, 0};
    return index < sizeof slices / sizeof slices[0] ? slices[index] : 0;
}

/* Whether a GPU instance of gi_slices offers compute instances of s slices. */
static int ci_supported(unsigned gi_slices, unsigned s) {
    if (s == 0 || s > gi_slices) return 0;
    if (s == gi_slices) return 1;
    return s == 1 || s == 2 || (gi_slices == 7 && (s == 3 || s == 4));
}

static unsigned ci_profile_id(unsigned slices) {
    for (unsigned i = 0; i < NVML_COMPUTE_INSTANCE_PROFILE_COUNT; i++) {
        if (ci_index_slices(i) == slices) return i;
    }
    return 0;
}

static nvmlReturn_t ci_profile(nvmlGpuInstance_t gpuInstance, unsigned int index, unsigned int eng, void *info,
                               int versioned) {
    int g, gi;
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r != NVML_SUCCESS) return r;
    if (info == NULL || index >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned version = versioned ? *(unsigned *)info : 0;
    if (versioned && version != nvmlComputeInstanceProfileInfo_v2 && version != nvmlComputeInstanceProfileInfo_v3) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (eng != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED) return NVML_ERROR_NOT_SUPPORTED;
    struct profile *p = profile_of_gi(g, gi);
    unsigned s = ci_index_slices(index);
    if (p == NULL || !ci_supported(p->slices, s)) return NVML_ERROR_NOT_SUPPORTED;
    unsigned sms = p->sms * s / p->slices, count = p->slices / s;
    char name[NAME_LEN];
    const char *bare = strncmp(p->name, "MIG ", 4) == 0 ? p->name + 4 : p->name;
    if (s == p->slices) {
        snprintf(name, sizeof name, "MIG %s", bare);
    } else {
        snprintf(name, sizeof name, "MIG %uc.%s", s, bare);
    }
    if (!versioned) {
        nvmlComputeInstanceProfileInfo_t *o = info;
        *o = (nvmlComputeInstanceProfileInfo_t){index, s, count, sms, p->ce, p->dec, p->enc, p->jpeg, p->ofa};
    } else {
        /* v2 and v3 share every field but v3's trailing capabilities. */
        nvmlComputeInstanceProfileInfo_v3_t *o = info;
        size_t size = version == nvmlComputeInstanceProfileInfo_v2 ? sizeof(nvmlComputeInstanceProfileInfo_v2_t)
                                                                   : sizeof(nvmlComputeInstanceProfileInfo_v3_t);
        memset(o, 0, size);
        o->version = version;
        o->id = index;
        o->sliceCount = s;
        o->instanceCount = count;
        o->multiprocessorCount = sms;
        o->sharedCopyEngineCount = p->ce;
        o->sharedDecoderCount = p->dec;
        o->sharedEncoderCount = p->enc;
        o->sharedJpegCount = p->jpeg;
        o->sharedOfaCount = p->ofa;
        snprintf(o->name, sizeof o->name, "%s", name);
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                 unsigned int engProfile,
                                                                 nvmlComputeInstanceProfileInfo_t *info) {
    API(ci_profile(gpuInstance, profile, engProfile, info, 0));
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                  unsigned int engProfile,
                                                                  nvmlComputeInstanceProfileInfo_v2_t *info) {
    API(ci_profile(gpuInstance, profile, engProfile, info, 1));
}

/* The compute instance profile id a GPU instance supports, or -1. */
static int ci_profile_slices(int g, int gi, unsigned profileId) {
    struct profile *p = profile_of_gi(g, gi);
    unsigned s = ci_index_slices(profileId);
    if (p == NULL || profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || !ci_supported(p->slices, s)) return -1;
    return (int)s;
}

static nvmlReturn_t create_ci(nvmlGpuInstance_t gpuInstance, unsigned int profileId, nvmlComputeInstance_t *out) {
    int g, gi;
    int fd = lock_state();
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r == NVML_SUCCESS) {
        int s = ci_profile_slices(g, gi, profileId);
        struct profile *p = profile_of_gi(g, gi);
        if (out == NULL || s < 0) {
            r = NVML_ERROR_INVALID_ARGUMENT;
        } else if (gpus[g].st.gi[gi].ci_mask) {
            r = NVML_ERROR_INSUFFICIENT_RESOURCES;
        } else if ((unsigned)s != p->slices) {
            r = NVML_ERROR_NOT_SUPPORTED; /* the mock only makes instances spanning the GPU instance */
        } else {
            gpus[g].st.gi[gi].ci_mask |= 1u;
            write_state();
            *out = (nvmlComputeInstance_t)(void *)&ci_handles[g][gi][0];
        }
    }
    unlock_state(fd);
    return r;
}

EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                         nvmlComputeInstance_t *computeInstance) {
    API(create_ci(gpuInstance, profileId, computeInstance));
}

static nvmlReturn_t list_cis(nvmlGpuInstance_t gpuInstance, unsigned int profileId, nvmlComputeInstance_t *out,
                             unsigned int *count) {
    int g, gi;
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL || ci_profile_slices(g, gi, profileId) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct profile *p = profile_of_gi(g, gi);
    unsigned n = 0;
    unsigned mask = ci_index_slices(profileId) == p->slices ? gpus[g].st.gi[gi].ci_mask : 0;
    for (int c = 0; c < MAX_CI; c++) {
        if (mask & (1u << c)) n++;
    }
    if (out == NULL || *count < n) {
        *count = n;
        return out == NULL && n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    n = 0;
    for (int c = 0; c < MAX_CI; c++) {
        if (mask & (1u << c)) out[n++] = (nvmlComputeInstance_t)(void *)&ci_handles[g][gi][c];
    }
    *count = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                       nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    API(list_cis(gpuInstance, profileId, computeInstances, count));
}

static nvmlReturn_t ci_by_id(nvmlGpuInstance_t gpuInstance, unsigned int id, nvmlComputeInstance_t *out) {
    int g, gi;
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r != NVML_SUCCESS) return r;
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (id >= MAX_CI || !(gpus[g].st.gi[gi].ci_mask & (1u << id))) return NVML_ERROR_NOT_FOUND;
    *out = (nvmlComputeInstance_t)(void *)&ci_handles[g][gi][id];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                          nvmlComputeInstance_t *computeInstance) {
    API(ci_by_id(gpuInstance, id, computeInstance));
}

static nvmlReturn_t ci_remaining(nvmlGpuInstance_t gpuInstance, unsigned int profileId, unsigned int *count) {
    int g, gi;
    nvmlReturn_t r = gpu_instance_of(gpuInstance, &g, &gi);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL || ci_profile_slices(g, gi, profileId) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct profile *p = profile_of_gi(g, gi);
    *count = gpus[g].st.gi[gi].ci_mask || ci_index_slices(profileId) != p->slices ? 0 : 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                       unsigned int profileId, unsigned int *count) {
    API(ci_remaining(gpuInstance, profileId, count));
}

static nvmlReturn_t ci_info(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    int g, gi, ci;
    nvmlReturn_t r = compute_instance_of(computeInstance, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    if (info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct profile *p = profile_of_gi(g, gi);
    unsigned s = p ? p->slices : 1;
    *info = (nvmlComputeInstanceInfo_t){gpu_handle(g), (nvmlGpuInstance_t)(void *)&gi_handles[g][gi], (unsigned)ci,
                                        ci_profile_id(s), {0, s}};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    API(ci_info(computeInstance, info));
}
EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    API(ci_info(computeInstance, info));
}

static nvmlReturn_t ci_destroy(nvmlComputeInstance_t computeInstance) {
    int g, gi, ci;
    int fd = lock_state();
    nvmlReturn_t r = compute_instance_of(computeInstance, &g, &gi, &ci);
    if (r == NVML_SUCCESS) {
        gpus[g].st.gi[gi].ci_mask &= ~(1u << ci);
        write_state();
    }
    unlock_state(fd);
    return r;
}

EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) { API(ci_destroy(computeInstance)); }

/* ---- events ------------------------------------------------------------------------------ */

#define SUPPORTED_EVENTS                                                                              \
    ((unsigned long long)(nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState | \
                          nvmlEventTypeXidCriticalError | nvmlEventTypeClock))

static struct event_set *event_set_of(nvmlEventSet_t set) {
    const struct event_set *s = (const struct event_set *)(void *)set;
    if ((uintptr_t)s < (uintptr_t)event_sets || (uintptr_t)s >= (uintptr_t)event_sets + sizeof event_sets ||
        ((uintptr_t)s - (uintptr_t)event_sets) % sizeof(struct event_set) != 0) {
        return NULL;
    }
    struct event_set *mine = &event_sets[((uintptr_t)s - (uintptr_t)event_sets) / sizeof(struct event_set)];
    return mine->used ? mine : NULL;
}

static long long events_size(void) {
    struct stat st;
    if (events_path[0] == '\0' || stat(events_path, &st) != 0) return 0;
    return (long long)st.st_size;
}

static nvmlReturn_t set_create(nvmlEventSet_t *set) {
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!event_sets[i].used) {
            memset(&event_sets[i], 0, sizeof event_sets[i]);
            event_sets[i].used = 1;
            event_sets[i].offset = events_size(); /* only events appended from now on */
            *set = (nvmlEventSet_t)(void *)&event_sets[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_MEMORY;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) { API(set_create(set)); }

static nvmlReturn_t supported_events(nvmlDevice_t device, unsigned long long *types) {
    int g;
    nvmlReturn_t r = full_gpu(device, &g);
    if (r != NVML_SUCCESS) return r;
    if (types == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *types = gpus[g].events_supported ? SUPPORTED_EVENTS : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    API(supported_events(device, eventTypes));
}

static nvmlReturn_t register_events(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    int g, gi, ci;
    nvmlReturn_t r = device_of(device, &g, &gi, &ci);
    if (r != NVML_SUCCESS) return r;
    struct event_set *s = event_set_of(set);
    if (s == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (gi >= 0 || !gpus[g].events_supported || (types & ~SUPPORTED_EVENTS) != 0) return NVML_ERROR_NOT_SUPPORTED;
    s->mask[g] |= types;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    API(register_events(device, eventTypes, set));
}

/* One pass over the lines appended since the set last looked: SUCCESS with an event,
 * GPU_IS_LOST for a registered GPU lost, TIMEOUT when nothing is there. */
static nvmlReturn_t poll_events(struct event_set *s, nvmlEventData_t *data) {
    if (events_path[0] == '\0') return NVML_ERROR_TIMEOUT;
    int fd = open(events_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NVML_ERROR_TIMEOUT;
    nvmlReturn_t r = NVML_ERROR_TIMEOUT;
    char buf[8192];
    while (r == NVML_ERROR_TIMEOUT) {
        ssize_t n = pread(fd, buf, sizeof buf - 1, (off_t)s->offset);
        if (n <= 0) break;
        buf[n] = '\0';
        char *nl = memchr(buf, '\n', (size_t)n);
        if (nl == NULL) break; /* an incomplete line: the writer is not done */
        *nl = '\0';
        s->offset += nl - buf + 1;
        char uuid[UUID_LEN];
        unsigned long long xid = 0;
        long long gi = -1, ci = -1;
        if (sscanf(buf, "xid %95s %llu %lld %lld", uuid, &xid, &gi, &ci) == 4) {
            int g = gpu_by_uuid(uuid);
            if (g >= 0 && (s->mask[g] & nvmlEventTypeXidCriticalError)) {
                data->device = gpu_handle(g);
                data->eventType = nvmlEventTypeXidCriticalError;
                data->eventData = xid;
                data->gpuInstanceId = (unsigned)gi;
                data->computeInstanceId = (unsigned)ci;
                r = NVML_SUCCESS;
            }
        } else if (sscanf(buf, "lost %95s", uuid) == 1) {
            int g = gpu_by_uuid(uuid);
            if (g >= 0) {
                gpus[g].lost = 1;
                if (s->mask[g]) r = NVML_ERROR_GPU_IS_LOST;
            }
        }
    }
    close(fd);
    return r;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&mu);
        nvmlReturn_t r;
        struct event_set *s = event_set_of(set);
        if (init_count == 0) {
            r = NVML_ERROR_UNINITIALIZED;
        } else if (s == NULL || data == NULL) {
            r = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            r = poll_events(s, data);
        }
        pthread_mutex_unlock(&mu);
        if (r != NVML_ERROR_TIMEOUT) return r;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long elapsed = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000LL;
        if (elapsed >= (long long)timeoutms) return NVML_ERROR_TIMEOUT;
        long long left = (long long)timeoutms - elapsed;
        struct timespec pause = {0, (left < 10 ? left : 10) * 1000000L};
        nanosleep(&pause, NULL);
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

static nvmlReturn_t set_free(nvmlEventSet_t set) {
    struct event_set *s = event_set_of(set);
    if (s == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    s->used = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { API(set_free(set)); }
