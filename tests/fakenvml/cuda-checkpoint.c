/*
 * cuda-checkpoint: a fake of NVIDIA's cuda-checkpoint utility (github.com/NVIDIA/cuda-checkpoint,
 * the --help of driver 570) for the fake NVML's test bed. It suspends and resumes gpu-alloc jobs:
 * the "GPU" is the state directory $FAKE_NVML_DIR described in fakenvml.c, and a checkpointed
 * job's allocation leaves alloc/, so the fake NVML no longer counts its memory.
 *
 *   cuda-checkpoint --get-state --pid PID          prints running, locked, checkpointed or failed
 *   cuda-checkpoint --action lock|checkpoint|restore|unlock --pid PID [--timeout MS]
 *   cuda-checkpoint --toggle --pid PID             running -> checkpointed, checkpointed -> running
 *   cuda-checkpoint --get-restore-tid --pid PID    prints PID (the fake has no restore thread)
 *   cuda-checkpoint --help
 * Short forms: -p PID, -t MS, -h.
 *
 * States: running -lock-> locked -checkpoint-> checkpointed -restore-> locked -unlock-> running.
 * Toggle is lock + checkpoint from running, restore + unlock from checkpointed. Any other action
 * fails and changes nothing. A restore that runs out of memory leaves the PID `failed` for good:
 * every later action on it fails, restore with error 304 (as the real driver, NVIDIA issue #44,
 * where --get-state keeps saying checkpointed; the fake says failed).
 *
 * A PID is a CUDA process while it is alive (not a zombie) and has an allocation (a file in
 * alloc/ whose PID field is PID: `GPU_INDEX PID BYTES`) or a checkpoint state. Files:
 *   checkpoint/PID     PID's state unless running: `STATE STARTTIME` (STARTTIME is field 22 of
 *                      /proc/PID/stat, so a state left by a dead process never applies to a new
 *                      one given the same PID). Written by renaming a dot-temp file into place.
 *   checkpointed/NAME  alloc/NAME while its PID is checkpointed (moved by rename, and back on
 *                      restore). Files of dead PIDs are ignored: gpu-alloc killed while
 *                      checkpointed leaves its file here, and its own unlink of alloc/PID on
 *                      exit finds nothing, harmlessly.
 * Names starting with '.' are ignored everywhere. Restore needs, on each GPU the PID had
 * memory on, its bytes to be free: TOTAL (from `gpus`) minus the live allocations in alloc/
 * (the fake NVML's rule: dead PIDs and dot files do not count; BYTES `-` counts 0).
 *
 * Failure injection, files in $FAKE_NVML_DIR/inject/ (NAME-PID applies to that PID only):
 *   lock-timeout[-PID]  lock (alone or in --toggle) waits while this file exists, up to --timeout
 *                       MS (absent or 0: 5 s here; the real lock waits without limit), then fails
 *                       with "the operation timed out" and the PID stays running. Removing the
 *                       file during the wait lets the lock complete (the GPU work drained).
 *   refuse[-PID]        every action and --toggle fails with "operation not supported" and
 *                       changes nothing, as for a UVM, IPC or MIG process; --get-state still
 *                       answers.
 *   restore-oom[-PID]   restore fails with "out of memory" even if the memory fits, leaving the
 *                       PID failed.
 *   slow-SECONDS        each action (each half of --toggle too) first sleeps SECONDS (e.g.
 *                       slow-0.5), as a large process takes seconds per GiB to copy.
 *
 * Errors: one line on stderr, `Error <doing> CUDA in process ID PID: "<CUDA error string>"
 * (<why>)`, the form the real tool prints for --toggle, and the exit status is the CUDA error
 * code as the real tool's, so exit() keeps its low 8 bits: 1 invalid argument (no such process,
 * bad usage), 2 out of memory, 3 initialization error (not a CUDA process), 48 = 304 OS call
 * failed (restore of a failed PID), 145 = 401 illegal state (wrong state), 33 = 801 not
 * supported (refuse), 141 = 909 timeout. A broken test bed (no $FAKE_NVML_DIR, bad `gpus`)
 * prints `cuda-checkpoint: ...` and exits 1.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "size.h"

#define MAX_GPUS 64
#define DEFAULT_LOCK_TIMEOUT_MS 5000L

enum cu_error { /* CUresult values the real tool exits with */
    CU_INVALID_VALUE = 1,
    CU_OUT_OF_MEMORY = 2,
    CU_NOT_INITIALIZED = 3,
    CU_OPERATING_SYSTEM = 304,
    CU_ILLEGAL_STATE = 401,
    CU_NOT_SUPPORTED = 801,
    CU_TIMEOUT = 909,
};

enum state { RUNNING, LOCKED, CHECKPOINTED, FAILED, NOT_CUDA };
static const char *const state_names[] = {"running", "locked", "checkpointed", "failed"};

enum action { LOCK, CHECKPOINT, RESTORE, UNLOCK };
static const char *const action_names[] = {"lock", "checkpoint", "restore", "unlock"};
static const char *const action_doing[] = {"locking", "checkpointing", "restoring", "unlocking"};

static char state_dir[PATH_MAX - 64]; /* room for "/checkpointed/NAME" etc. */
static pid_t target;
static unsigned long long target_start;
static const char *doing = "acting on"; /* the verb of the operation, for error messages */

static const char *cu_string(int code)
{
    switch (code) {
    case CU_INVALID_VALUE: return "invalid argument";
    case CU_OUT_OF_MEMORY: return "out of memory";
    case CU_NOT_INITIALIZED: return "initialization error";
    case CU_OPERATING_SYSTEM: return "OS call failed or operation not supported on this OS";
    case CU_ILLEGAL_STATE: return "the operation cannot be performed in the present state";
    case CU_NOT_SUPPORTED: return "operation not supported";
    case CU_TIMEOUT: return "the operation timed out";
    default: return "unknown error";
    }
}

/* A failed operation: the real tool's line plus why, exit status the CUDA error code. */
__attribute__((format(printf, 2, 3), noreturn)) static void fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "Error %s CUDA in process ID %d: \"%s\" (", doing, (int)target,
            cu_string(code));
    vfprintf(stderr, fmt, ap);
    fputs(")\n", stderr);
    va_end(ap);
    exit(code);
}

/* A broken test bed or command line, not a CUDA error. */
__attribute__((format(printf, 1, 2), noreturn)) static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("cuda-checkpoint: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(CU_INVALID_VALUE);
}

static void path_of(char *out, size_t size, const char *sub, const char *name)
{
    if (snprintf(out, size, "%s/%s%s%s", state_dir, sub, *name ? "/" : "", name) >= (int)size)
        die("path too long: %s/%s/%s", state_dir, sub, name);
}

/*
 * Alive = exists and is not a zombie (fakenvml.c's rule); *start = its start time in clock
 * ticks (field 22 of /proc/PID/stat), 0 when unknown.
 */
static int pid_alive(pid_t pid, unsigned long long *start)
{
    *start = 0;
    if (pid <= 0)
        return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) {
        if (access("/proc/self/stat", F_OK) == 0)
            return 0;
        return kill(pid, 0) == 0 || errno == EPERM; /* no /proc mounted */
    }
    char buf[1024];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');
    if (!paren || paren[1] != ' ')
        return 1;
    if (paren[2] == 'Z' || paren[2] == 'X' || paren[2] == 'x')
        return 0;
    /* paren + 2 is field 3 (state); skip to field 22 (starttime). */
    const char *p = paren + 2;
    for (int field = 3; field < 22 && p; field++)
        p = (p = strchr(p, ' ')) ? p + 1 : NULL;
    if (p)
        *start = strtoull(p, NULL, 10);
    return 1;
}

/* ---- allocation files: `GPU_INDEX PID BYTES` ---- */

struct alloc {
    unsigned gpu;
    int pid;
    unsigned long long bytes; /* `-` (unknown) counts 0 */
};

static int read_alloc(const char *path, struct alloc *a)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1; /* removed since readdir */
    char bytes_s[64];
    int fields = fscanf(f, "%u %d %63s", &a->gpu, &a->pid, bytes_s);
    fclose(f);
    if (fields != 3)
        return -1;
    a->bytes = 0;
    if (strcmp(bytes_s, "-") != 0 && parse_size(bytes_s, &a->bytes) != 0)
        return -1;
    return 0;
}

/*
 * Visit every allocation file in `sub` (alloc or checkpointed), dot files skipped; `visit`
 * gets the directory path, the file name and the parsed allocation. Returns how many parsed.
 */
typedef void visit_fn(const char *dir, const char *name, const struct alloc *a, void *arg);

static int scan(const char *sub, visit_fn *visit, void *arg)
{
    char dir_path[PATH_MAX];
    path_of(dir_path, sizeof dir_path, sub, "");
    DIR *dir = opendir(dir_path);
    if (!dir)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (e->d_name[0] == '.')
            continue;
        char file[PATH_MAX + 256];
        snprintf(file, sizeof file, "%s/%s", dir_path, e->d_name);
        struct alloc a;
        if (read_alloc(file, &a) != 0)
            continue;
        n++;
        visit(dir_path, e->d_name, &a, arg);
    }
    closedir(dir);
    return n;
}

static void count_target(const char *dir, const char *name, const struct alloc *a, void *arg)
{
    (void)dir;
    (void)name;
    if (a->pid == (int)target)
        ++*(int *)arg;
}

static int target_allocations(const char *sub)
{
    int n = 0;
    scan(sub, count_target, &n);
    return n;
}

static void move_target(const char *dir, const char *name, const struct alloc *a, void *arg)
{
    if (a->pid != (int)target)
        return;
    char from[PATH_MAX + 256], to[PATH_MAX + 256];
    snprintf(from, sizeof from, "%s/%s", dir, name);
    path_of(to, sizeof to, (const char *)arg, name);
    if (rename(from, to) != 0 && errno != ENOENT) /* ENOENT: the job exited meanwhile */
        die("cannot move %s to %s: %s", from, to, strerror(errno));
}

/* Move the target's allocation files from one directory to the other. */
static void move_allocations(const char *from, const char *to)
{
    char to_path[PATH_MAX];
    path_of(to_path, sizeof to_path, to, "");
    if (mkdir(to_path, 0755) != 0 && errno != EEXIST)
        die("cannot create %s: %s", to_path, strerror(errno));
    scan(from, move_target, (void *)to);
}

static void unlink_target(const char *dir, const char *name, const struct alloc *a, void *arg)
{
    (void)arg;
    char file[PATH_MAX + 256];
    snprintf(file, sizeof file, "%s/%s", dir, name);
    if (a->pid == (int)target)
        unlink(file);
}

/* Bytes per GPU: the target's checkpointed memory, and every live process's in alloc/. */
struct usage {
    unsigned long long bytes[MAX_GPUS];
    int live_only;
};

static void add_usage(const char *dir, const char *name, const struct alloc *a, void *arg)
{
    (void)dir;
    (void)name;
    struct usage *u = arg;
    unsigned long long start;
    if (a->gpu >= MAX_GPUS)
        return;
    if (u->live_only ? !pid_alive(a->pid, &start) : a->pid != (int)target)
        return;
    u->bytes[a->gpu] = a->bytes > ULLONG_MAX - u->bytes[a->gpu] ? ULLONG_MAX
                                                                  : u->bytes[a->gpu] + a->bytes;
}

/* TOTAL of each GPU listed in `gpus`; returns the number of GPUs. */
static unsigned load_totals(unsigned long long totals[MAX_GPUS])
{
    char path[PATH_MAX];
    path_of(path, sizeof path, "gpus", "");
    FILE *f = fopen(path, "r");
    if (!f)
        die("cannot read %s: %s", path, strerror(errno));
    char line[512];
    unsigned n = 0, lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *p = line + strspn(line, " \t");
        if (!*p || *p == '\n' || *p == '#')
            continue;
        unsigned index;
        char uuid[96], total[64];
        if (sscanf(p, "%u %95s %63s", &index, uuid, total) != 3 || index != n ||
            n == MAX_GPUS || parse_size(total, &totals[n]) != 0)
            die("%s:%u: expected `INDEX UUID TOTAL NAME...` with INDEX %u", path, lineno, n);
        n++;
    }
    fclose(f);
    return n;
}

/* ---- per-PID state ---- */

static void state_path(char *out, size_t size, int temp)
{
    char name[32];
    snprintf(name, sizeof name, temp ? ".%d.tmp" : "%d", (int)target);
    path_of(out, size, "checkpoint", name);
}

static enum state read_state(void)
{
    char path[PATH_MAX];
    state_path(path, sizeof path, 0);
    FILE *f = fopen(path, "r");
    enum state s = RUNNING;
    if (f) {
        char word[32];
        unsigned long long start;
        int fields = fscanf(f, "%31s %llu", word, &start);
        fclose(f);
        if (fields != 2)
            die("%s: expected `STATE STARTTIME`", path);
        for (s = LOCKED; s <= FAILED && strcmp(word, state_names[s]) != 0; s++)
            ;
        if (s > FAILED)
            die("%s: unknown state \"%s\"", path, word);
        if (start != target_start)
            s = RUNNING; /* left by a dead process that had the same PID */
    }
    if (s == RUNNING && !target_allocations("alloc"))
        return NOT_CUDA;
    return s;
}

static void write_state(enum state s)
{
    char path[PATH_MAX], tmp[PATH_MAX];
    state_path(path, sizeof path, 0);
    if (s == RUNNING) {
        if (unlink(path) != 0 && errno != ENOENT)
            die("cannot remove %s: %s", path, strerror(errno));
        return;
    }
    state_path(tmp, sizeof tmp, 1);
    FILE *f = fopen(tmp, "w");
    if (!f)
        die("cannot write %s: %s", tmp, strerror(errno));
    fprintf(f, "%s %llu\n", state_names[s], target_start);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        die("cannot write %s: %s", path, strerror(errno));
    }
}

/*
 * Serialise state changes (two restores must not both count the same free memory): LOCK_EX
 * or LOCK_UN on checkpoint/.lock, opened once (flock locks belong to the open file).
 */
static void lock_state(int how)
{
    static int fd = -1;
    char dir_path[PATH_MAX], path[PATH_MAX];
    path_of(path, sizeof path, "checkpoint", ".lock");
    if (fd < 0) {
        path_of(dir_path, sizeof dir_path, "checkpoint", "");
        if (mkdir(dir_path, 0755) != 0 && errno != EEXIST)
            die("cannot create %s: %s", dir_path, strerror(errno));
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    }
    if (fd < 0 || flock(fd, how) != 0)
        die("cannot lock %s: %s", path, strerror(errno));
}

/* ---- failure injection ---- */

static int injected(const char *name)
{
    char path[PATH_MAX], file[64];
    path_of(path, sizeof path, "inject", name);
    if (access(path, F_OK) == 0)
        return 1;
    snprintf(file, sizeof file, "%s-%d", name, (int)target);
    path_of(path, sizeof path, "inject", file);
    return access(path, F_OK) == 0;
}

static void sleep_for(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* inject/slow-SECONDS: the first such file found sets the delay. */
static void slow_down(void)
{
    char path[PATH_MAX];
    path_of(path, sizeof path, "inject", "");
    DIR *dir = opendir(path);
    if (!dir)
        return;
    double seconds = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        char *end;
        if (strncmp(e->d_name, "slow-", 5) != 0)
            continue;
        seconds = strtod(e->d_name + 5, &end);
        if (end == e->d_name + 5 || *end || !(seconds >= 0) || seconds > 3600)
            die("%s/%s: expected slow-SECONDS", path, e->d_name);
        break;
    }
    closedir(dir);
    sleep_for(seconds);
}

/* ---- operations ---- */

static const char *need_state[] = {"running", "locked", "checkpointed", "locked"};
static const enum state from_state[] = {RUNNING, LOCKED, CHECKPOINTED, LOCKED};

static void check_state(enum action a, enum state s)
{
    if (s == FAILED)
        fail(a == RESTORE ? CU_OPERATING_SYSTEM : CU_ILLEGAL_STATE,
             "cannot %s: process %d failed an earlier restore; only killing it helps",
             action_names[a], (int)target);
    if (s != from_state[a])
        fail(CU_ILLEGAL_STATE, "cannot %s: process %d is %s, not %s", action_names[a],
             (int)target, state_names[s], need_state[a]);
}

/* The checks every operation starts with; returns the current state. */
static enum state cuda_process(void)
{
    if (!pid_alive(target, &target_start))
        fail(CU_INVALID_VALUE, "no such process %d", (int)target);
    enum state s = read_state();
    if (s == NOT_CUDA)
        fail(CU_NOT_INITIALIZED, "process %d is not a CUDA process", (int)target);
    return s;
}

static void wait_for_lock(long timeout_ms)
{
    if (!injected("lock-timeout"))
        return;
    long ms = timeout_ms > 0 ? timeout_ms : DEFAULT_LOCK_TIMEOUT_MS;
    double deadline = now() + (double)ms / 1000;
    while (injected("lock-timeout")) {
        if (now() >= deadline)
            fail(CU_TIMEOUT, "lock of process %d timed out after %ld ms (inject/lock-timeout)",
                 (int)target, ms);
        sleep_for(0.02);
    }
}

static void act(enum action a, long timeout_ms)
{
    enum state s = cuda_process();
    if (injected("refuse"))
        fail(CU_NOT_SUPPORTED, "process %d cannot be checkpointed (inject/refuse)", (int)target);
    check_state(a, s);
    slow_down();
    if (a == LOCK)
        wait_for_lock(timeout_ms);

    lock_state(LOCK_EX);
    check_state(a, cuda_process()); /* another cuda-checkpoint may have acted meanwhile */
    switch (a) {
    case LOCK:
        write_state(LOCKED);
        break;
    case CHECKPOINT:
        scan("checkpointed", unlink_target, NULL); /* left by a dead process with this PID */
        move_allocations("alloc", "checkpointed");
        write_state(CHECKPOINTED);
        break;
    case RESTORE: {
        struct usage need = {{0}, 0}, used = {{0}, 1};
        unsigned long long totals[MAX_GPUS];
        unsigned ngpus = load_totals(totals);
        scan("checkpointed", add_usage, &need);
        scan("alloc", add_usage, &used);
        if (injected("restore-oom")) {
            write_state(FAILED);
            fail(CU_OUT_OF_MEMORY, "restore of process %d ran out of GPU memory "
                 "(inject/restore-oom); the process is now failed", (int)target);
        }
        for (unsigned gpu = 0; gpu < MAX_GPUS; gpu++) {
            unsigned long long total = gpu < ngpus ? totals[gpu] : 0;
            unsigned long long free_ = used.bytes[gpu] < total ? total - used.bytes[gpu] : 0;
            if (need.bytes[gpu] > free_) {
                write_state(FAILED);
                fail(CU_OUT_OF_MEMORY, "restore of process %d needs %llu bytes on GPU %u, "
                     "%llu free; the process is now failed", (int)target, need.bytes[gpu],
                     gpu, free_);
            }
        }
        move_allocations("checkpointed", "alloc");
        write_state(LOCKED);
        break;
    }
    case UNLOCK:
        write_state(RUNNING);
        break;
    }
    lock_state(LOCK_UN);
}

static void toggle(long timeout_ms)
{
    doing = "toggling";
    enum state s = cuda_process();
    if (s == RUNNING) {
        act(LOCK, timeout_ms);
        act(CHECKPOINT, 0);
    } else if (s == CHECKPOINTED) {
        act(RESTORE, 0);
        act(UNLOCK, 0);
    } else if (s == FAILED) {
        check_state(RESTORE, s);
    } else {
        fail(CU_ILLEGAL_STATE, "cannot toggle: process %d is %s, not running or checkpointed",
             (int)target, state_names[s]);
    }
}

static const char help[] =
    "CUDA checkpoint and restore utility (a fake for the gpuslice test bed: it acts on the\n"
    "fake GPU state in $FAKE_NVML_DIR; see the header of tests/fakenvml/cuda-checkpoint.c).\n"
    "Mirrors the interface of NVIDIA's cuda-checkpoint, version 570.\n"
    "\n"
    "Operations:\n"
    "--get-state --pid <pid>\n"
    "\tPrints the checkpoint state of <pid>: running, locked, checkpointed or failed\n"
    "\n"
    "--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]\n"
    "\tPerforms the action on <pid>; the lock action waits at most <ms> milliseconds\n"
    "\n"
    "--toggle --pid <pid>\n"
    "\tToggles <pid> between the running and checkpointed states\n"
    "\n"
    "--get-restore-tid --pid <pid>\n"
    "\tPrints the restore thread ID of <pid> (the fake prints <pid>)\n"
    "\n"
    "Options:\n"
    "--pid|-p <pid>\n"
    "\tThe pid to act on\n"
    "\n"
    "--timeout|-t <timeout>\n"
    "\tTimeout of the lock action in milliseconds\n"
    "\n"
    "--help|-h\n"
    "\tPrint this help message\n";

int main(int argc, char **argv)
{
    enum { GET_STATE = 256, ACTION, TOGGLE, RESTORE_TID };
    static const struct option options[] = {
        {"get-state", no_argument, NULL, GET_STATE},
        {"action", required_argument, NULL, ACTION},
        {"toggle", no_argument, NULL, TOGGLE},
        {"get-restore-tid", no_argument, NULL, RESTORE_TID},
        {"pid", required_argument, NULL, 'p'},
        {"timeout", required_argument, NULL, 't'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *usage = "usage: cuda-checkpoint --get-state | --action lock|checkpoint|restore|"
                        "unlock | --toggle | --get-restore-tid --pid PID [--timeout MS]";
    int op = 0;
    enum action action = LOCK;
    long pid = 0, timeout_ms = 0;
    char *end;
    int opt;
    while ((opt = getopt_long(argc, argv, "p:t:h", options, NULL)) != -1) {
        switch (opt) {
        case GET_STATE:
        case TOGGLE:
        case RESTORE_TID:
        case ACTION:
            if (op)
                die("give one operation\n%s", usage);
            op = opt;
            if (opt == ACTION) {
                unsigned a;
                for (a = 0; a < 4 && strcmp(optarg, action_names[a]) != 0; a++)
                    ;
                if (a == 4)
                    die("--action: expected lock, checkpoint, restore or unlock, got \"%s\"",
                        optarg);
                action = (enum action)a;
            }
            break;
        case 'p':
            errno = 0;
            pid = strtol(optarg, &end, 10);
            if (end == optarg || *end || errno || pid <= 0 || pid > INT_MAX)
                die("--pid: expected a process ID, got \"%s\"", optarg);
            break;
        case 't':
            errno = 0;
            timeout_ms = strtol(optarg, &end, 10);
            if (end == optarg || *end || errno || timeout_ms < 0 || timeout_ms > INT_MAX)
                die("--timeout: expected milliseconds, got \"%s\"", optarg);
            break;
        case 'h':
            fputs(help, stdout);
            return 0;
        default:
            die("%s", usage);
        }
    }
    if (!op || !pid || optind != argc)
        die("%s", usage);
    const char *dir = getenv("FAKE_NVML_DIR");
    if (!dir || !*dir)
        die("FAKE_NVML_DIR is not set");
    if (strlen(dir) >= sizeof state_dir)
        die("FAKE_NVML_DIR is too long");
    snprintf(state_dir, sizeof state_dir, "%s", dir);
    target = (pid_t)pid;

    switch (op) {
    case GET_STATE:
        doing = "getting the state of";
        puts(state_names[cuda_process()]);
        break;
    case RESTORE_TID:
        doing = "getting the restore thread of";
        cuda_process();
        printf("%d\n", (int)target);
        break;
    case TOGGLE:
        toggle(timeout_ms);
        break;
    case ACTION:
        doing = action_doing[action];
        act(action, timeout_ms);
        break;
    }
    return 0;
}
