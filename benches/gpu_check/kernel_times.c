// LD_PRELOAD shim that records every kernel's device time through CUPTI's activity API and, at
// exit, prints the total a kernel name took, most first: where a whole training step's GPU time
// goes, with no profiler on the GPU machine (it has no Nsight Systems). Two runs of different step
// counts, differenced, give a step's share (the warm-up's autotuning cancels out).
//
// Built on the GPU machine against CUPTI's headers by kernel_times.sh, which also runs the command:
// KILN_KERNEL_T names the newest kernel record the headers define (CUpti_ActivityKernel10 in CUDA
// 13.0's; older toolkits stop at lower numbers).
//   gpu/kernel_times.sh gpu/kiln-qat-step --steps 8
// KERNEL_TIMES_TOP (default 40) limits the lines printed.
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (8u << 20)
#define MAX_NAMES 4096

struct entry {
    char *name;
    unsigned long long launches;
    double total_us;
};
static struct entry entries[MAX_NAMES];
static int used;
static double all_us;

// The entry of `name`, added when new; names past MAX_NAMES share the last entry.
static struct entry *find(const char *name) {
    for (int i = 0; i < used; ++i)
        if (strcmp(entries[i].name, name) == 0) return &entries[i];
    if (used == MAX_NAMES) return &entries[MAX_NAMES - 1];
    entries[used].name = strdup(name ? name : "(unnamed)");
    return &entries[used++];
}

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KILN_KERNEL_T *k = (const KILN_KERNEL_T *)record;
        const double us = (double)(k->end - k->start) * 1e-3;
        struct entry *e = find(k->name);
        e->launches++;
        e->total_us += us;
        all_us += us;
    }
    free(buffer);
}

static int by_total(const void *a, const void *b) {
    const double x = ((const struct entry *)a)->total_us, y = ((const struct entry *)b)->total_us;
    return (x < y) - (x > y);
}

__attribute__((constructor)) static void start(void) {
    if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
        fprintf(stderr, "kernel_times: CUPTI's activity API is unavailable\n");
}

__attribute__((destructor)) static void report(void) {
    cuptiActivityFlushAll(1);
    qsort(entries, used, sizeof entries[0], by_total);
    const char *top = getenv("KERNEL_TIMES_TOP");
    const int lines = top ? atoi(top) : 40;
    printf("kernel_times all kernels %.1f us, %d names\n", all_us, used);
    for (int i = 0; i < used && i < lines; ++i)
        printf("kernel_times %12.1f us %8llu launches  %.150s\n", entries[i].total_us, entries[i].launches, entries[i].name);
    fflush(stdout);
}
