/*
 * system.c: library lifetime (refcounted nvmlInit/nvmlShutdown), error strings and the
 * system-wide queries (driver, NVML and CUDA versions).
 *
 * Owns: the global lock, the init count and the loaded node (g_node), and the entry helpers
 * every NVML call goes through (init check, control-channel ingest, handle validation). Must
 * not parse profiles itself (profile.c) or hold the lock across a blocking call.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

pthread_mutex_t g_sim_lock = PTHREAD_MUTEX_INITIALIZER;
int g_sim_init_count;
sim_node g_node;

nvmlReturn_t sim_enter(int out_ok)
{
    pthread_mutex_lock(&g_sim_lock);
    if (g_sim_init_count == 0) {
        pthread_mutex_unlock(&g_sim_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (!out_ok) {
        pthread_mutex_unlock(&g_sim_lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    sim_control_ingest();
    return NVML_SUCCESS;
}

void sim_leave(void) { pthread_mutex_unlock(&g_sim_lock); }

/* Find the GPU or MIG device `device` points at, without dereferencing foreign pointers. */
static nvmlReturn_t lookup_device(nvmlDevice_t device, sim_gpu **gpu, sim_mig **mig)
{
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)g_node.gpus;
    if (!device || p < base || p >= base + sizeof g_node.gpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t idx = (p - base) / sizeof(sim_gpu);
    sim_gpu *g = &g_node.gpus[idx];
    if ((int)idx >= g_node.ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    *gpu = g;
    *mig = NULL;
    if (device == &g->h)
        return g->h.magic == SIM_MAGIC_DEVICE ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    for (int m = 0; m < g->nmig; m++)
        if (device == &g->migs[m].h) {
            *mig = &g->migs[m];
            return g->migs[m].h.magic == SIM_MAGIC_DEVICE ? NVML_SUCCESS
                                                          : NVML_ERROR_INVALID_ARGUMENT;
        }
    return NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t sim_lookup_device(nvmlDevice_t device, sim_gpu **gpu, sim_mig **mig)
{
    nvmlReturn_t rc = lookup_device(device, gpu, mig);
    if (rc == NVML_SUCCESS && (*gpu)->lost)
        return NVML_ERROR_GPU_IS_LOST;
    return rc;
}

nvmlReturn_t sim_enter_device(nvmlDevice_t device, int out_ok, sim_gpu **gpu, sim_mig **mig)
{
    nvmlReturn_t rc = sim_enter(1);
    if (rc)
        return rc;
    rc = sim_lookup_device(device, gpu, mig);
    if (rc == NVML_SUCCESS && !out_ok)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc)
        sim_leave();
    return rc;
}

nvmlReturn_t sim_copy_string(char *dst, unsigned int len, const char *src)
{
    size_t n = strlen(src);
    if ((size_t)len < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---- lifetime ---- */

static nvmlReturn_t do_init(void)
{
    pthread_mutex_lock(&g_sim_lock);
    if (g_sim_init_count > 0) {
        g_sim_init_count++;
        pthread_mutex_unlock(&g_sim_lock);
        return NVML_SUCCESS;
    }
    char err[1024] = "";
    sim_node *node = malloc(sizeof *node);
    if (!node) {
        pthread_mutex_unlock(&g_sim_lock);
        return NVML_ERROR_MEMORY;
    }
    nvmlReturn_t rc = sim_profile_load(node, err, sizeof err);
    if (rc == NVML_SUCCESS && node->fault_init) {
        snprintf(err, sizeof err, "injected start-up fault init=%d", node->fault_init);
        rc = node->fault_init;
    }
    if (rc == NVML_SUCCESS) {
        memcpy(&g_node, node, sizeof g_node);
        if (sim_control_start(err, sizeof err) < 0) {
            memset(&g_node, 0, sizeof g_node);
            rc = NVML_ERROR_UNKNOWN;
        }
    }
    free(node);
    if (rc != NVML_SUCCESS) {
        fprintf(stderr, "gpu-agent simulated NVML: nvmlInit failed (%s): %s\n",
                nvmlErrorString(rc), err);
        pthread_mutex_unlock(&g_sim_lock);
        return rc;
    }
    g_sim_init_count = 1;
    pthread_mutex_unlock(&g_sim_lock);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return do_init(); }
SIM_EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
SIM_EXPORT nvmlReturn_t nvmlInit(void) { return do_init(); }

SIM_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_sim_lock);
    if (g_sim_init_count == 0) {
        pthread_mutex_unlock(&g_sim_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (--g_sim_init_count == 0)
        sim_control_stop();
    pthread_mutex_unlock(&g_sim_lock);
    return NVML_SUCCESS;
}

SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
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
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "vGPU ECC not supported";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}

/* ---- system queries ---- */

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = sim_enter(version != NULL);
    if (rc)
        return rc;
    rc = sim_copy_string(version, length, g_node.driver_version);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = sim_enter(version != NULL);
    if (rc)
        return rc;
    rc = sim_copy_string(version, length, g_node.nvml_version);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t rc = sim_enter(cudaDriverVersion != NULL);
    if (rc)
        return rc;
    *cudaDriverVersion = g_node.cuda_version;
    sim_leave();
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}
