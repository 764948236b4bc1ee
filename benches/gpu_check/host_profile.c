// LD_PRELOAD sampling profiler for the host side of kiln's calls (the machine has no perf, gdb or
// strace). `host-profile` mode looks up kiln_profile_start/stop here and brackets each timed loop
// with them; in between, every 1/KILN_PROFILE_HZ seconds of the process's CPU time (ITIMER_PROF,
// default 2000 Hz) the thread that used it records its call stack (glibc's backtrace(), which
// unwinds through .eh_frame, so stripped binaries work). At stop, the window's stacks go to
// $KILN_PROFILE_OUT/<label>.txt, one sample a line: thread id, then return addresses, innermost
// first; /proc/self/maps goes beside them (maps.txt) so host_profile.py can symbolize offline
// against the unstripped build of the same binary.
//   gcc -O2 -shared -fPIC -o host_profile.so host_profile.c
//   KILN_PROFILE_OUT=out LD_PRELOAD=./host_profile.so ./kiln-gpu-check host-profile
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

enum { DEPTH = 64, MAX_SAMPLES = 40000, SLOT = DEPTH + 2 };

// Slot layout: [thread id, frame count, frames...]; filled by the handler, read after stop.
static void **samples;
static atomic_int taken;
static atomic_int running;
static char label[128];

static void on_prof(int sig, siginfo_t *info, void *ctx) {
    (void)sig, (void)info, (void)ctx;
    if (!atomic_load(&running)) return;
    int i = atomic_fetch_add(&taken, 1);
    if (i >= MAX_SAMPLES) return;
    void **slot = samples + (size_t)i * SLOT;
    slot[1] = 0;
    int n = backtrace(slot + 2, DEPTH);
    slot[0] = (void *)(long)syscall(SYS_gettid);
    slot[1] = (void *)(long)n;
}

__attribute__((constructor)) static void setup(void) {
    samples = mmap(NULL, sizeof(void *) * (size_t)MAX_SAMPLES * SLOT, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    // backtrace() loads libgcc_s on its first call, which is not safe inside a signal handler.
    void *warm[4];
    backtrace(warm, 4);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_prof;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigaction(SIGPROF, &sa, NULL);
}

static void set_timer(long usec) {
    struct itimerval t = {{0, usec}, {0, usec}};
    setitimer(ITIMER_PROF, &t, NULL);
}

void kiln_profile_start(const char *name) {
    snprintf(label, sizeof label, "%s", name);
    atomic_store(&taken, 0);
    atomic_store(&running, 1);
    const char *hz = getenv("KILN_PROFILE_HZ");
    long rate = hz ? atol(hz) : 2000;
    set_timer(1000000 / (rate > 0 ? rate : 2000));
}

static void copy_maps(const char *dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/maps.txt", dir);
    FILE *in = fopen("/proc/self/maps", "r"), *out = fopen(path, "w");
    char line[1024];
    while (in && out && fgets(line, sizeof line, in)) fputs(line, out);
    if (in) fclose(in);
    if (out) fclose(out);
}

// Returns the number of samples written (those past MAX_SAMPLES are dropped).
int kiln_profile_stop(void) {
    set_timer(0);
    atomic_store(&running, 0);
    const char *dir = getenv("KILN_PROFILE_OUT");
    if (!dir) dir = ".";
    int n = atomic_load(&taken);
    if (n > MAX_SAMPLES) n = MAX_SAMPLES;
    char path[512];
    snprintf(path, sizeof path, "%s/%s.txt", dir, label);
    FILE *out = fopen(path, "w");
    for (int i = 0; out && i < n; i++) {
        void **slot = samples + (size_t)i * SLOT;
        fprintf(out, "%ld", (long)slot[0]);
        for (long f = 0; f < (long)slot[1]; f++) fprintf(out, " %lx", (unsigned long)slot[2 + f]);
        fputc('\n', out);
    }
    if (out) fclose(out);
    copy_maps(dir);
    return n;
}
