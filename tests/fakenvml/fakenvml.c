/*
 * fakenvml: a stand-in libnvidia-ml.so.1 so gpuslice's real NVML code path (pynvml
 * loading "libnvidia-ml.so.1" through dlopen) runs on machines without a GPU.
 * Select it with LD_LIBRARY_PATH=<build dir>; nothing in gpuslice knows it is fake.
 *
 * State lives in the directory named by $FAKE_NVML_DIR, re-read on every query
 * (except `gpus`, read at init) so tests change the "hardware" by touching files:
 *
 *   gpus          one GPU per line: `INDEX UUID TOTAL NAME...`
 *                 INDEX must be 0, 1, 2... in order (NVML enumeration order);
 *                 TOTAL is bytes, optionally with a binary suffix (24G, 24GiB, 512M);
 *                 NAME is the rest of the line. Blank lines and `#` comments are skipped.
 *                 Example: `0 GPU-00000000-0000-0000-0000-000000000000 24GiB NVIDIA Fake 24G`
 *   alloc/FILE    one simulated allocation per file: `GPU_INDEX PID BYTES [graphics]`
 *                 (written by gpu-alloc, named by its pid; names starting with '.' are
 *                 ignored so writers can rename a temp file into place). It counts only
 *                 while PID is alive and not a zombie (a stale file of a dead PID never
 *                 counts; PID reuse is not detected). BYTES `-` lists the process with
 *                 usedGpuMemory = NVML_VALUE_NOT_AVAILABLE and adds nothing to `used`.
 *   lost/INDEX    if this file exists, every call on that GPU (handle lookup included)
 *                 returns NVML_ERROR_GPU_IS_LOST, as for a GPU that fell off the bus.
 *   hang          while this file exists, every per-device call blocks (a driver call
 *                 that hangs): it returns once the file is removed.
 *   unloaded      while this file exists the driver is gone (module unloaded, `nvidia-smi
 *                 -r`): nvmlInit* and every call of an initialised session (count, handles,
 *                 per-device queries) return NVML_ERROR_DRIVER_NOT_LOADED. Remove it and
 *                 the driver is back: a fresh nvmlInit works again (re-reading `gpus`).
 *
 * Without $FAKE_NVML_DIR or its `gpus` file, nvmlInit* returns NVML_ERROR_DRIVER_NOT_LOADED:
 * the driver "not loaded yet". Writing `gpus` later is the driver loading: the next nvmlInit
 * succeeds. `gpus` is read at each nvmlInit (refcount 0 -> 1), as real NVML enumerates GPUs
 * only at init: a line appended is a GPU added, seen by a later shutdown + init.
 * A malformed `gpus` file makes init fail with NVML_ERROR_UNKNOWN and a line on stderr.
 *
 * Memory: used = sum of live allocations on the GPU (capped at total), free = total - used.
 * Processes: compute processes are the live allocations' PIDs (one entry per PID, bytes
 * summed), sorted by PID; an allocation whose 4th field is `graphics` is a graphics process
 * instead (a display server, a compositor: `gpu-alloc --graphics`); MPS lists are empty.
 *
 * Only the functions pynvml calls for discovery, memory and processes exist; anything
 * else fails lookup, which pynvml reports as NVML_ERROR_FUNCTION_NOT_FOUND.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "size.h"

#define API __attribute__((visibility("default")))

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
} nvmlReturn_t;

#define MAX_GPUS 64
#define NAME_SIZE 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */
#define UUID_SIZE 96 /* NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define VALUE_NOT_AVAILABLE_ULL ULLONG_MAX
#define VALUE_NOT_AVAILABLE_UINT UINT_MAX
#define NVML_MEMORY_V2 0x02000028u /* sizeof(nvmlMemory_v2_t) | 2 << 24 */

struct nvmlDevice_st {
    unsigned int index;
    char uuid[UUID_SIZE];
    char name[NAME_SIZE];
    unsigned long long total;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

/* Layouts match pynvml's ctypes structures field for field. */
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct { /* c_nvmlProcessInfo_v2_t, also used for _v3 */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int refcount;
static char state_dir[PATH_MAX - 64]; /* room for "/lost/INDEX" etc. */
static struct nvmlDevice_st devices[MAX_GPUS];
static unsigned int ndevices;

static void copy_field(char *dst, size_t size, const char *src)
{
    snprintf(dst, size, "%s", src);
}

static nvmlReturn_t load_gpus(void)
{
    const char *dir = getenv("FAKE_NVML_DIR");
    if (!dir || !*dir)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (strlen(dir) >= sizeof state_dir) {
        fprintf(stderr, "fakenvml: FAKE_NVML_DIR is too long\n");
        return NVML_ERROR_UNKNOWN;
    }
    copy_field(state_dir, sizeof state_dir, dir);

    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/gpus", state_dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return NVML_ERROR_DRIVER_NOT_LOADED;

    char line[512];
    unsigned lineno = 0;
    nvmlReturn_t ret = NVML_SUCCESS;
    ndevices = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        line[strcspn(line, "\r\n")] = '\0';
        char *p = line + strspn(line, " \t");
        if (!*p || *p == '#')
            continue;
        unsigned index;
        char uuid[UUID_SIZE], total[64];
        int name_at = 0;
        unsigned long long bytes;
        if (sscanf(p, "%u %95s %63s %n", &index, uuid, total, &name_at) < 3 || !name_at ||
            !p[name_at] || parse_size(total, &bytes) != 0) {
            fprintf(stderr, "fakenvml: %s:%u: expected `INDEX UUID TOTAL NAME...`\n", path,
                    lineno);
            ret = NVML_ERROR_UNKNOWN;
            break;
        }
        if (index != ndevices || ndevices == MAX_GPUS) {
            fprintf(stderr, "fakenvml: %s:%u: expected GPU index %u, got %u\n", path, lineno,
                    ndevices, index);
            ret = NVML_ERROR_UNKNOWN;
            break;
        }
        struct nvmlDevice_st *d = &devices[ndevices++];
        d->index = index;
        d->total = bytes;
        copy_field(d->uuid, sizeof d->uuid, uuid);
        copy_field(d->name, sizeof d->name, p + name_at);
    }
    fclose(f);
    if (ret != NVML_SUCCESS)
        ndevices = 0;
    return ret;
}

/* Alive = exists and is not a zombie: a dead process's GPU memory is already freed. */
static int pid_alive(pid_t pid)
{
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
    return paren[2] != 'Z' && paren[2] != 'X' && paren[2] != 'x';
}

static int by_pid(const void *a, const void *b)
{
    unsigned pa = ((const nvmlProcessInfo_t *)a)->pid, pb = ((const nvmlProcessInfo_t *)b)->pid;
    return (pa > pb) - (pa < pb);
}

/* Which allocations a scan returns: a process list's kind, or all of them (for memory). */
enum { LIST_ALL = -1, LIST_NONE = 0, LIST_COMPUTE = 1, LIST_GRAPHICS = 2 };

/*
 * Live allocations on GPU `index` of one kind (LIST_ALL: any), one entry per PID, sorted by
 * PID. Returns the number of entries (-1 on out of memory); *procs is malloc'ed, *used their
 * known bytes.
 */
static int scan_allocations(unsigned index, nvmlProcessInfo_t **procs, unsigned long long *used,
                            int kind)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/alloc", state_dir);
    *procs = NULL;
    *used = 0;
    DIR *dir = opendir(path);
    if (!dir)
        return 0;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (e->d_name[0] == '.')
            continue;
        char file[PATH_MAX + 256];
        snprintf(file, sizeof file, "%s/%s", path, e->d_name);
        FILE *f = fopen(file, "r");
        if (!f)
            continue; /* removed since readdir: the allocation is gone */
        unsigned gpu;
        int pid;
        char bytes_s[64], kind_s[16];
        int fields = fscanf(f, "%u %d %63s %15s", &gpu, &pid, bytes_s, kind_s);
        fclose(f);
        unsigned long long bytes = VALUE_NOT_AVAILABLE_ULL;
        if (fields == 4 && strcmp(kind_s, "graphics") != 0)
            continue; /* malformed */
        int is = fields == 4 ? LIST_GRAPHICS : LIST_COMPUTE;
        if (fields < 3 || gpu != index || (kind != LIST_ALL && kind != is) || !pid_alive(pid))
            continue;
        if (strcmp(bytes_s, "-") != 0 && parse_size(bytes_s, &bytes) != 0)
            continue;
        int i;
        for (i = 0; i < n && (*procs)[i].pid != (unsigned)pid; i++)
            ;
        if (i == n) {
            if (n == cap) {
                cap = cap ? cap * 2 : 16;
                nvmlProcessInfo_t *grown = realloc(*procs, (size_t)cap * sizeof **procs);
                if (!grown) {
                    free(*procs);
                    *procs = NULL;
                    closedir(dir);
                    return -1;
                }
                *procs = grown;
            }
            (*procs)[n++] = (nvmlProcessInfo_t){(unsigned)pid, VALUE_NOT_AVAILABLE_ULL,
                                                VALUE_NOT_AVAILABLE_UINT,
                                                VALUE_NOT_AVAILABLE_UINT};
        }
        if (bytes != VALUE_NOT_AVAILABLE_ULL) {
            nvmlProcessInfo_t *p = &(*procs)[i];
            p->usedGpuMemory =
                p->usedGpuMemory == VALUE_NOT_AVAILABLE_ULL ? bytes : p->usedGpuMemory + bytes;
            *used += bytes;
        }
    }
    closedir(dir);
    if (n > 1)
        qsort(*procs, (size_t)n, sizeof **procs, by_pid);
    return n;
}

/* The `unloaded` file: the driver is gone. Read from the environment, so that it also
 * answers before the first successful init. */
static int driver_unloaded(void)
{
    const char *dir = getenv("FAKE_NVML_DIR");
    if (!dir || !*dir)
        return 0;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/unloaded", dir);
    return access(path, F_OK) == 0;
}

static int is_lost(unsigned index)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/lost/%u", state_dir, index);
    return access(path, F_OK) == 0;
}

static void hang_while_asked(void)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/hang", state_dir);
    while (access(path, F_OK) == 0)
        usleep(20000);
}

/* Common checks for every per-device call: initialized, a handle we issued, not lost. */
static nvmlReturn_t check_device(nvmlDevice_t device)
{
    hang_while_asked();
    if (!refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (driver_unloaded())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    uintptr_t at = (uintptr_t)device, first = (uintptr_t)devices;
    if (at < first || at >= first + ndevices * sizeof *devices || (at - first) % sizeof *devices)
        return NVML_ERROR_INVALID_ARGUMENT;
    return is_lost(device->index) ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---- init / shutdown / errors ---- */

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    if (driver_unloaded())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount ? NVML_SUCCESS : load_gpus();
    if (ret == NVML_SUCCESS)
        refcount++;
    pthread_mutex_unlock(&lock);
    return ret;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&lock);
    nvmlReturn_t ret = refcount ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refcount)
        refcount--;
    pthread_mutex_unlock(&lock);
    return ret;
}

API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch ((int)result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    case 28: return "GPU not found";
    default: return "Unknown Error";
    }
}

/* ---- system ---- */

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    return refcount ? copy_string(version, length, "550.54.15") : NVML_ERROR_UNINITIALIZED;
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return refcount ? copy_string(version, length, "12.550.54.15") : NVML_ERROR_UNINITIALIZED;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    if (!refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = 12040;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return nvmlSystemGetCudaDriverVersion(version);
}

/* ---- device discovery ---- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (driver_unloaded())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    *count = ndevices;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= ndevices)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (driver_unloaded())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (is_lost(index))
        return NVML_ERROR_GPU_IS_LOST;
    *device = &devices[index];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < ndevices; i++) {
        if (strcmp(devices[i].uuid, uuid) == 0) {
            if (is_lost(i))
                return NVML_ERROR_GPU_IS_LOST;
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t ret = check_device(device);
    if (ret == NVML_SUCCESS && !index)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *index = device->index;
    return ret;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t ret = check_device(device);
    return ret == NVML_SUCCESS ? copy_string(name, length, device->name) : ret;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t ret = check_device(device);
    return ret == NVML_SUCCESS ? copy_string(uuid, length, device->uuid) : ret;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlReturn_t ret = check_device(device);
    if (ret == NVML_SUCCESS && !pci)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    memset(pci, 0, sizeof *pci);
    pci->bus = device->index + 1;
    pci->pciDeviceId = 0x20b510de;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

/* ---- memory ---- */

static nvmlReturn_t memory(nvmlDevice_t device, unsigned long long *total,
                           unsigned long long *free_, unsigned long long *used)
{
    nvmlReturn_t ret = check_device(device);
    if (ret != NVML_SUCCESS)
        return ret;
    nvmlProcessInfo_t *procs;
    if (scan_allocations(device->index, &procs, used, LIST_ALL) < 0)
        return NVML_ERROR_MEMORY;
    free(procs);
    *total = device->total;
    if (*used > *total)
        *used = *total;
    *free_ = *total - *used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem)
{
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    return memory(device, &mem->total, &mem->free, &mem->used);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *mem)
{
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->reserved = 0;
    return memory(device, &mem->total, &mem->free, &mem->used);
}

/* ---- processes: NVML's size-query protocol ---- */

/*
 * Too small a buffer (count 0 and NULL infos included) sets *count to the number
 * needed and returns NVML_ERROR_INSUFFICIENT_SIZE; no processes is plain success.
 */
static nvmlReturn_t processes(nvmlDevice_t device, unsigned int *count, void *infos,
                              int kind, int v1)
{
    nvmlReturn_t ret = check_device(device);
    if (ret == NVML_SUCCESS && !count)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret != NVML_SUCCESS)
        return ret;
    nvmlProcessInfo_t *procs = NULL;
    unsigned long long used;
    int n = kind != LIST_NONE ? scan_allocations(device->index, &procs, &used, kind) : 0;
    if (n < 0)
        return NVML_ERROR_MEMORY;
    if ((unsigned)n > *count || (n && !infos)) {
        *count = (unsigned)n;
        free(procs);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        if (v1)
            ((nvmlProcessInfo_v1_t *)infos)[i] =
                (nvmlProcessInfo_v1_t){procs[i].pid, procs[i].usedGpuMemory};
        else
            ((nvmlProcessInfo_t *)infos)[i] = procs[i];
    }
    *count = (unsigned)n;
    free(procs);
    return NVML_SUCCESS;
}

#define PROCESS_LIST(fn, kind, v1)                                                         \
    API nvmlReturn_t fn(nvmlDevice_t device, unsigned int *count, void *infos)            \
    {                                                                                      \
        return processes(device, count, infos, kind, v1);                                  \
    }

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, LIST_COMPUTE, 0)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, LIST_COMPUTE, 0)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, LIST_COMPUTE, 1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, LIST_GRAPHICS, 0)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, LIST_GRAPHICS, 0)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, LIST_GRAPHICS, 1)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, LIST_NONE, 0)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, LIST_NONE, 0)
