// LD_PRELOAD shim that counts and times CUDA driver calls made through dlsym (cudarc loads the
// driver with libloading), to see where a CubeCL launch waits for the GPU. At exit it prints one
// line per watched function: calls, total and longest time in the call. With CUDA_TRACE_KERNELS
// set it also prints launches per kernel (named where cuModuleGetFunction made the handle), most
// launched first.
//   gcc -O2 -shared -fPIC -o cuda_trace.so cuda_trace.c -ldl
//   LD_PRELOAD=./cuda_trace.so ./kiln-gpu-check gemm-skinny 1
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void *H;
typedef unsigned long long P;

enum { STREAM_SYNC, EVENT_SYNC, CTX_SYNC, STREAM_WAIT_EVENT, EVENT_QUERY, STREAM_QUERY, LAUNCH,
       HTOD_ASYNC, DTOH_ASYNC, MEM_ALLOC, MEM_ALLOC_ASYNC, EVENT_RECORD, HOST_ALLOC, N_FNS };
static const char *names[N_FNS] = {"cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize",
    "cuStreamWaitEvent", "cuEventQuery", "cuStreamQuery", "cuLaunchKernel", "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2", "cuMemAlloc_v2", "cuMemAllocAsync", "cuEventRecord", "cuMemHostAlloc"};
static void *real[N_FNS];
static unsigned long long calls[N_FNS];
static double total[N_FNS], longest[N_FNS];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}
static void account(int f, double start) {
    double d = now() - start;
    calls[f]++;
    total[f] += d;
    if (d > longest[f]) longest[f] = d;
}
#define WRAP(f, ret_args, call_args) \
    static CUresult w_##f ret_args { double t0_ = now(); CUresult r = ((CUresult(*) ret_args) real[f]) call_args; account(f, t0_); return r; }
WRAP(STREAM_SYNC, (H a), (a))
WRAP(EVENT_SYNC, (H a), (a))
WRAP(CTX_SYNC, (void), ())
WRAP(STREAM_WAIT_EVENT, (H a, H b, unsigned c), (a, b, c))
WRAP(EVENT_QUERY, (H a), (a))
WRAP(STREAM_QUERY, (H a), (a))
// Launches per function handle (open addressing; handles are never freed while kiln runs).
#define N_KERNELS 4096
static H kernel_fn[N_KERNELS];
static unsigned long long kernel_calls[N_KERNELS];
static char kernel_name[N_KERNELS][96];
static int slot_of(H f) {
    unsigned long long h = ((unsigned long long)f >> 4) % N_KERNELS;
    for (int i = 0; i < N_KERNELS; i++, h = (h + 1) % N_KERNELS)
        if (kernel_fn[h] == f || !kernel_fn[h]) { kernel_fn[h] = f; return (int)h; }
    return -1;
}
static void count_kernel(H f) {
    int h = slot_of(f);
    if (h >= 0) kernel_calls[h]++;
}
static void *real_get_function;
static CUresult w_get_function(H *f, H module, const char *name) {
    CUresult r = ((CUresult(*)(H *, H, const char *))real_get_function)(f, module, name);
    int h = r == 0 ? slot_of(*f) : -1;
    if (h >= 0) snprintf(kernel_name[h], sizeof kernel_name[h], "%s", name);
    return r;
}
static CUresult w_LAUNCH(H f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned sm, H st, void **p, void **x) {
    count_kernel(f);
    double t0_ = now();
    CUresult r = ((CUresult(*)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, H, void **, void **))real[LAUNCH])(f, a, b, c, d, e, g, sm, st, p, x);
    account(LAUNCH, t0_);
    return r;
}
WRAP(HTOD_ASYNC, (P d, const void *s, size_t n, H st), (d, s, n, st))
WRAP(DTOH_ASYNC, (void *d, P s, size_t n, H st), (d, s, n, st))
WRAP(MEM_ALLOC, (P *d, size_t n), (d, n))
WRAP(MEM_ALLOC_ASYNC, (P *d, size_t n, H st), (d, n, st))
WRAP(EVENT_RECORD, (H e, H st), (e, st))
WRAP(HOST_ALLOC, (void **p, size_t n, unsigned fl), (p, n, fl))
static void *wrappers[N_FNS] = {w_STREAM_SYNC, w_EVENT_SYNC, w_CTX_SYNC, w_STREAM_WAIT_EVENT, w_EVENT_QUERY,
    w_STREAM_QUERY, w_LAUNCH, w_HTOD_ASYNC, w_DTOH_ASYNC, w_MEM_ALLOC, w_MEM_ALLOC_ASYNC, w_EVENT_RECORD, w_HOST_ALLOC};

void *dlsym(void *handle, const char *symbol) {
    static void *(*next)(void *, const char *);
    if (!next) next = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!next) next = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    void *p = next(handle, symbol);
    for (int f = 0; p && f < N_FNS; f++)
        if (!strcmp(symbol, names[f])) { real[f] = p; return wrappers[f]; }
    if (p && !strcmp(symbol, "cuModuleGetFunction")) { real_get_function = p; return w_get_function; }
    return p;
}

static int by_calls(const void *a, const void *b) {
    unsigned long long x = kernel_calls[*(const int *)a], y = kernel_calls[*(const int *)b];
    return x < y ? 1 : x > y ? -1 : 0;
}

static void report_kernels(void) {
    static int order[N_KERNELS];
    int n = 0;
    for (int i = 0; i < N_KERNELS; i++)
        if (kernel_fn[i]) order[n++] = i;
    qsort(order, n, sizeof(int), by_calls);
    for (int i = 0; i < n; i++)
        fprintf(stderr, "cuda_trace kernel %9llu  %s\n", kernel_calls[order[i]], kernel_name[order[i]][0] ? kernel_name[order[i]] : "?");
}

__attribute__((destructor)) static void report(void) {
    if (getenv("CUDA_TRACE_KERNELS")) report_kernels();
    for (int f = 0; f < N_FNS; f++)
        if (calls[f])
            fprintf(stderr, "cuda_trace %-22s calls %9llu  total %12.1f us  mean %8.2f us  longest %10.1f us\n",
                    names[f], calls[f], total[f], total[f] / calls[f], longest[f]);
}
