/*
 * gpu-alloc: a fake GPU job for fakenvml. It "allocates" SIZE bytes on GPU N by writing
 * $FAKE_NVML_DIR/alloc/PID (`N PID BYTES`, renamed into place so readers never see half
 * a file), prints one `ready ...` line on stdout, and holds until a signal ends it.
 *
 *   gpu-alloc --gpu N --bytes SIZE [--ignore-term SECONDS] [--graphics]
 *
 * SIZE is bytes with an optional binary suffix: 512M, 20G, 20GiB (GB/MB are rejected
 * as ambiguous). --ignore-term models a slow victim: the first SIGTERM prints
 * `ignoring SIGTERM for SECONDS s` and the process exits on it only after SECONDS
 * (SIGINT/SIGHUP still end it at once). --graphics lists it as a graphics process (a display
 * server, a compositor) instead of a compute one. It removes its file and then dies by the
 * signal that ended it, so a supervisor sees a normal signal death. After SIGKILL the
 * file stays behind; fakenvml ignores files of dead PIDs.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "size.h"

static char alloc_path[PATH_MAX];

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, "gpu-alloc: ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
    exit(2);
}

/* Fail early on a GPU the gpus file does not list: that is a test bug, not a job. */
static void check_gpu_exists(const char *dir, unsigned gpu)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/gpus", dir);
    FILE *f = fopen(path, "r");
    if (!f)
        die("cannot read %s", path);
    char line[512];
    unsigned index;
    int found = 0;
    while (!found && fgets(line, sizeof line, f))
        found = sscanf(line, " %u", &index) == 1 && index == gpu;
    fclose(f);
    if (!found)
        die("no such GPU in %s", path);
}

static void write_allocation(const char *dir, unsigned gpu, unsigned long long bytes,
                             int graphics)
{
    char alloc_dir[PATH_MAX - 32], tmp[PATH_MAX];
    if (snprintf(alloc_dir, sizeof alloc_dir, "%s/alloc", dir) >= (int)sizeof alloc_dir)
        die("%s", "FAKE_NVML_DIR is too long");
    if (mkdir(alloc_dir, 0755) != 0 && errno != EEXIST)
        die("cannot create %s", alloc_dir);
    snprintf(alloc_path, sizeof alloc_path, "%s/%d", alloc_dir, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s/.%d.tmp", alloc_dir, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        die("cannot write %s", tmp);
    fprintf(f, "%u %d %llu%s\n", gpu, (int)getpid(), bytes, graphics ? " graphics" : "");
    if (fclose(f) != 0 || rename(tmp, alloc_path) != 0) {
        unlink(tmp);
        die("cannot write %s", alloc_path);
    }
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Wait for a signal in `set`, at most `timeout` seconds (< 0: forever); 0 on timeout. */
static int wait_signal(const sigset_t *set, double timeout)
{
    for (;;) {
        int sig;
        if (timeout < 0) {
            sig = sigwaitinfo(set, NULL);
        } else {
            struct timespec ts = {(time_t)timeout,
                                  (long)((timeout - floor(timeout)) * 1e9)};
            sig = sigtimedwait(set, NULL, &ts);
            if (sig < 0 && errno == EAGAIN)
                return 0;
        }
        if (sig > 0)
            return sig;
        if (errno != EINTR)
            die("%s", strerror(errno));
    }
}

int main(int argc, char **argv)
{
    static const struct option options[] = {
        {"gpu", required_argument, NULL, 'g'},
        {"bytes", required_argument, NULL, 'b'},
        {"ignore-term", required_argument, NULL, 't'},
        {"graphics", no_argument, NULL, 'G'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *usage =
        "usage: gpu-alloc --gpu N --bytes SIZE [--ignore-term SECONDS] [--graphics]";
    long gpu = -1;
    unsigned long long bytes = 0;
    int have_bytes = 0;
    double ignore_term = 0;
    int graphics = 0;
    char *end;
    int opt;
    while ((opt = getopt_long(argc, argv, "", options, NULL)) != -1) {
        switch (opt) {
        case 'g':
            gpu = strtol(optarg, &end, 10);
            if (end == optarg || *end || gpu < 0 || gpu > INT_MAX)
                die("--gpu: expected a GPU index, got \"%s\"", optarg);
            break;
        case 'b':
            if (parse_size(optarg, &bytes) != 0)
                die("--bytes: expected a size like 512M, 20G or 20GiB, got \"%s\"", optarg);
            have_bytes = 1;
            break;
        case 't':
            ignore_term = strtod(optarg, &end);
            if (end == optarg || *end || !(ignore_term >= 0) || ignore_term > 1e6)
                die("--ignore-term: expected seconds, got \"%s\"", optarg);
            break;
        case 'G':
            graphics = 1;
            break;
        case 'h':
            puts(usage);
            return 0;
        default:
            die("%s", usage);
        }
    }
    if (gpu < 0 || !have_bytes || optind != argc)
        die("%s", usage);
    const char *dir = getenv("FAKE_NVML_DIR");
    if (!dir || !*dir)
        die("%s", "FAKE_NVML_DIR is not set");

    /* Block the signals before the file exists, so none can end us without cleanup. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigprocmask(SIG_BLOCK, &set, NULL);

    check_gpu_exists(dir, (unsigned)gpu);
    write_allocation(dir, (unsigned)gpu, bytes, graphics);
    printf("ready pid=%d gpu=%ld bytes=%llu\n", (int)getpid(), gpu, bytes);
    fflush(stdout);

    int sig = wait_signal(&set, -1);
    if (sig == SIGTERM && ignore_term > 0) {
        printf("ignoring SIGTERM for %g s\n", ignore_term);
        fflush(stdout);
        sigset_t others = set;
        sigdelset(&others, SIGTERM); /* further SIGTERMs stay pending, i.e. ignored */
        double deadline = now() + ignore_term;
        for (double left; (left = deadline - now()) > 0;) {
            int other = wait_signal(&others, left);
            if (other) {
                sig = other;
                break;
            }
        }
    }

    unlink(alloc_path);
    signal(sig, SIG_DFL);
    sigprocmask(SIG_UNBLOCK, &set, NULL); /* pending SIGTERMs may end us here: fine */
    raise(sig);
    return 128 + sig;
}
