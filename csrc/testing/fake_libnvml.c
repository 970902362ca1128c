/* A stand-in libnvidia-ml.so.1 for testing kvctl's GPU memory figures without a GPU or a driver.
 *
 * The real nvidia-ml-py loads it: pynvml dlopens "libnvidia-ml.so.1" by that
 * name, so a test puts the directory holding this library (built with that
 * soname) on LD_LIBRARY_PATH of the kvctl it starts. It implements only the
 * entry points kvcached/node/gpu/nvml.py reaches through pynvml, as strict as
 * NVML's documentation where it matters to a caller:
 *
 * - Nothing works before nvmlInitWithFlags or after the matching nvmlShutdown
 *   (NVML_ERROR_UNINITIALIZED); init and shutdown are reference counted.
 * - Device handles are not indexes (a pointer into a table), and an index at or
 *   past the count is NVML_ERROR_INVALID_ARGUMENT.
 * - nvmlDeviceGetComputeRunningProcesses_v3 follows NVML's two-call protocol:
 *   a count too small (or a NULL array) returns NVML_ERROR_INSUFFICIENT_SIZE
 *   with the count needed, unless there is nothing to list (NVML_SUCCESS, 0).
 * - A process is listed only while it is alive and not a zombie: the real NVML
 *   drops a process once its CUDA contexts are gone, which happens when it
 *   exits, not when it is signalled.
 *
 * Environment, read at each call so a test can change what it says:
 *   FAKE_NVML_FILE: a file of lines "<minor> <pid> <bytes>", one per process and GPU;
 *   FAKE_NVML_DEVICES: how many GPUs (default 2; GPU i has minor i);
 *   FAKE_NVML_INIT_ERROR: an NVML return code nvmlInitWithFlags fails with
 *     (9 is NVML_ERROR_DRIVER_NOT_LOADED).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define MAX_DEVICES 16
#define MAX_ROWS 256

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

struct fake_device { unsigned int minor; };
static struct fake_device devices[MAX_DEVICES];
static int refs;

static unsigned int device_count(void) {
    const char *n = getenv("FAKE_NVML_DEVICES");
    int v = n ? atoi(n) : 2;
    return (unsigned int)(v < 0 ? 0 : v > MAX_DEVICES ? MAX_DEVICES : v);
}

static int valid(const struct fake_device *d) {
    return refs > 0 && d >= devices && d < devices + device_count();
}

static int alive(unsigned int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *rpar = strrchr(buf, ')');
    return rpar && rpar[1] == ' ' && rpar[2] != 'Z' && rpar[2] != 'X';
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    const char *err = getenv("FAKE_NVML_INIT_ERROR");
    (void)flags;
    if (err && atoi(err)) return atoi(err);
    for (unsigned int i = 0; i < MAX_DEVICES; i++) devices[i].minor = i;
    refs++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    refs--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, struct fake_device **device) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(struct fake_device *device, unsigned int *minor) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = device->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(struct fake_device *device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t rows[MAX_ROWS];
    unsigned int n = 0, minor, pid;
    unsigned long long bytes;
    const char *path = getenv("FAKE_NVML_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    while (f && n < MAX_ROWS && fscanf(f, "%u %u %llu", &minor, &pid, &bytes) == 3) {
        if (minor == device->minor && alive(pid)) {
            rows[n].pid = pid;
            rows[n].usedGpuMemory = bytes;
            rows[n].gpuInstanceId = rows[n].computeInstanceId = 0xFFFFFFFFu;
            n++;
        }
    }
    if (f) fclose(f);
    if (n == 0) { *count = 0; return NVML_SUCCESS; }
    if (!infos || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    memcpy(infos, rows, n * sizeof rows[0]);
    *count = n;
    return NVML_SUCCESS;
}
