/*
 * probe_json.h: the one JSON object a probe program prints (gpu-probe, gpu-kernel).
 *
 * put_string / put_number collect the fields in order; finish(code) prints them as one
 * line and returns code; fail(step, error) and fail_code(call, rc) add "step" and
 * "error" and finish with 1. Included by the probes of e2e/harness/probe/ (static
 * functions: one program, one object).
 */
#ifndef DRASIL_PROBE_JSON_H
#define DRASIL_PROBE_JSON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FIELDS 20

struct field {
    const char *key;
    char *string; /* a JSON string when not NULL, else `number` */
    long long number;
};

static struct field fields[MAX_FIELDS];
static int nfields;

static void put_string(const char *key, const char *value) {
    if (nfields < MAX_FIELDS) {
        fields[nfields].key = key;
        fields[nfields].string = strdup(value != NULL ? value : "");
        nfields++;
    }
}

static void put_number(const char *key, long long value) {
    if (nfields < MAX_FIELDS) {
        fields[nfields].key = key;
        fields[nfields].string = NULL;
        fields[nfields].number = value;
        nfields++;
    }
}

static void print_json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p != '\0'; p++) {
        switch (*p) {
        case '"':
            fputs("\\\"", stdout);
            break;
        case '\\':
            fputs("\\\\", stdout);
            break;
        case '\n':
            fputs("\\n", stdout);
            break;
        case '\r':
            fputs("\\r", stdout);
            break;
        case '\t':
            fputs("\\t", stdout);
            break;
        default:
            if (*p < 0x20) {
                printf("\\u%04x", *p);
            } else {
                putchar(*p);
            }
        }
    }
    putchar('"');
}

static int finish(int code) {
    putchar('{');
    for (int i = 0; i < nfields; i++) {
        if (i > 0) {
            fputs(", ", stdout);
        }
        print_json_string(fields[i].key);
        fputs(": ", stdout);
        if (fields[i].string != NULL) {
            print_json_string(fields[i].string);
        } else {
            printf("%lld", fields[i].number);
        }
    }
    fputs("}\n", stdout);
    fflush(stdout);
    return code;
}

static int fail(const char *step, const char *error) {
    put_string("step", step);
    put_string("error", error != NULL ? error : "(no dlerror text)");
    return finish(1);
}

static int fail_code(const char *call, int code) {
    char text[128];
    snprintf(text, sizeof(text), "%s returned %d", call, code);
    return fail(call, text);
}

#endif
