/*
 * mps-client: connect to an MPS control daemon as a CUDA process does, for the
 * simulated backend's stand-in (drasil.driver.simulated.mpsstandin), and say what
 * it granted. It needs the same things real CUDA needs from a container: the pipe
 * directory's control socket and the daemon's shared memory under /dev/shm.
 *
 *   CUDA_MPS_PIPE_DIRECTORY            where the socket `control` is (/tmp/nvidia-mps)
 *   CUDA_MPS_PINNED_DEVICE_MEM_LIMIT   sent as asked for (`-` when unset)
 *   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE  sent as asked for (`-` when unset)
 *
 * Handshake, one line each way: `client <pinned> <threads>` -> `shm <name>`;
 * `token <contents of /dev/shm/<name>>` -> `ok memory=<M> threads=<P>`; any reply
 * may be `error: <why>`.
 *
 * Prints one line: `MPS: connected memory=<M> threads=<P>` (exit 0) or
 * `MPS: error <why>` (exit 1). With --hold it then stays connected and pings the
 * daemon every second: `MPS: lost connection` (exit 2) when that fails, exit 0 on
 * SIGTERM. Built by e2e/harness/node_images.py into the probe image (/usr/local/bin/mps-client).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_LINE 4096
#define IO_TIMEOUT_S 5

static volatile sig_atomic_t stopping;

static void on_sigterm(int sig) {
    (void)sig;
    stopping = 1;
}

/* One line on stdout, flushed: a test or `kubectl logs` reads it as it comes. */
static void say(const char *format, ...) {
    va_list args;
    va_start(args, format);
    fputs("MPS: ", stdout);
    vprintf(format, args);
    fputc('\n', stdout);
    fflush(stdout);
    va_end(args);
}

static int send_line(int fd, const char *line) {
    char buf[MAX_LINE + 2];
    int n = snprintf(buf, sizeof buf, "%s\n", line);
    if (n < 0 || (size_t)n >= sizeof buf) {
        errno = EMSGSIZE;
        return -1;
    }
    for (size_t sent = 0; sent < (size_t)n;) {
        ssize_t w = write(fd, buf + sent, (size_t)n - sent);
        if (w < 0) {
            return -1; /* EINTR included: SIGTERM means stop */
        }
        sent += (size_t)w;
    }
    return 0;
}

/* The next line without its newline; -1 at EOF, on an error or a timeout. Byte by
 * byte: replies are short, and nothing past the newline is taken from the socket. */
static int read_line(int fd, char *line, size_t size) {
    size_t len = 0;
    for (;;) {
        char c;
        ssize_t r = read(fd, &c, 1);
        if (r <= 0) {
            if (r == 0) {
                errno = ECONNRESET;
            }
            return -1;
        }
        if (c == '\n') {
            line[len] = '\0';
            return 0;
        }
        if (len + 1 >= size) {
            errno = EMSGSIZE;
            return -1;
        }
        line[len++] = c;
    }
}

/* Send `request`, read the reply into `reply`; on failure print why and return -1. */
static int exchange(int fd, const char *request, char *reply, size_t size) {
    if (send_line(fd, request) != 0 || read_line(fd, reply, size) != 0) {
        say("error no reply from the MPS control daemon: %s", strerror(errno));
        return -1;
    }
    if (strncmp(reply, "error: ", 7) == 0) {
        say("error %s", reply + 7);
        return -1;
    }
    return 0;
}

static const char *env_or(const char *name, const char *fallback) {
    const char *value = getenv(name);
    return value && *value ? value : fallback;
}

static int connect_daemon(void) {
    const char *dir = env_or("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s/control", dir);
    if (n < 0 || (size_t)n >= sizeof addr.sun_path) {
        say("error %s/control: the socket path is too long", dir);
        return -1;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        say("error cannot connect to %s: %s", addr.sun_path, strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    /* A daemon that hangs must not hang us: reads and writes time out. */
    struct timeval timeout = {.tv_sec = IO_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    return fd;
}

/* The token in /dev/shm/<name>, into `token`; -1 (said why) if it cannot be read. */
static int read_token(const char *name, char *token, size_t size) {
    char path[MAX_LINE + 16];
    if (strchr(name, '/') != NULL || snprintf(path, sizeof path, "/dev/shm/%s", name) < 0) {
        say("error the daemon named a bad shared memory segment: %s", name);
        return -1;
    }
    FILE *segment = fopen(path, "r");
    if (segment == NULL) {
        say("error cannot open the shared memory segment %s: %s", path, strerror(errno));
        return -1;
    }
    if (fgets(token, (int)size, segment) == NULL) {
        token[0] = '\0';
    }
    fclose(segment);
    token[strcspn(token, "\r\n")] = '\0';
    return 0;
}

static int handshake(int fd) {
    char line[MAX_LINE + 1], request[MAX_LINE + 1], token[256];
    snprintf(request, sizeof request, "client %s %s",
             env_or("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "-"),
             env_or("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "-"));
    if (exchange(fd, request, line, sizeof line) != 0) {
        return -1;
    }
    if (strncmp(line, "shm ", 4) != 0) {
        say("error unexpected reply: %s", line);
        return -1;
    }
    if (read_token(line + 4, token, sizeof token) != 0) {
        return -1;
    }
    snprintf(request, sizeof request, "token %s", token);
    if (exchange(fd, request, line, sizeof line) != 0) {
        return -1;
    }
    if (strncmp(line, "ok ", 3) != 0) {
        say("error unexpected reply: %s", line);
        return -1;
    }
    say("connected %s", line + 3);
    return 0;
}

/* Ping every second until SIGTERM (exit 0) or the daemon stops answering (exit 2). */
static int hold(int fd) {
    struct sigaction term = {.sa_handler = on_sigterm}; /* no SA_RESTART: wake up */
    sigemptyset(&term.sa_mask);
    sigaction(SIGTERM, &term, NULL);
    char reply[MAX_LINE + 1];
    while (!stopping) {
        struct timespec second = {.tv_sec = 1};
        nanosleep(&second, NULL);
        if (stopping) {
            break;
        }
        if (send_line(fd, "ping") != 0 || read_line(fd, reply, sizeof reply) != 0 ||
            strcmp(reply, "pong") != 0) {
            if (stopping) {
                break;
            }
            say("lost connection");
            return 2;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    int holding = argc == 2 && strcmp(argv[1], "--hold") == 0;
    if (argc > 2 || (argc == 2 && !holding)) {
        say("error usage: mps-client [--hold]");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN); /* a daemon gone mid-write is an error, not a death */
    int fd = connect_daemon();
    if (fd < 0 || handshake(fd) != 0) {
        return 1;
    }
    int code = holding ? hold(fd) : 0;
    close(fd);
    return code;
}
