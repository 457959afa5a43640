/*
 * system.c: library lifetime (refcounted nvmlInit/nvmlShutdown), error strings and the
 * system-wide queries (driver, NVML and CUDA versions).
 *
 * Owns: the global lock, the init count and the loaded node (g_node), and the entry helpers
 * every NVML call goes through (init check, control-channel ingest, handle validation, the
 * wait of a hung GPU). Must not parse profiles itself (profile.c) or hold the lock across a
 * blocking call.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

void sim_set_mig_handles(sim_gpu *g, int gpu)
{
    for (int m = 0; m < SIM_MAX_MIG; m++) {
        sim_mig *mig = &g->migs[m];
        mig->h = (struct sim_handle){m < g->nmig ? SIM_MAGIC_DEVICE : 0, gpu, m};
        sim_gi *gi = &g->gis[m];
        gi->h = (struct sim_handle){gi->live ? SIM_MAGIC_GI : 0, gpu, m};
        for (int c = 0; c < SIM_MAX_CI; c++)
            gi->ci_h[c] = (struct sim_handle){0, gpu, m * SIM_MAX_CI + c};
    }
    for (int m = 0; m < g->nmig; m++) {
        sim_gi *gi = sim_gi_by_id(g, g->migs[m].gi);
        if (gi && g->migs[m].ci < SIM_MAX_CI)
            gi->ci_h[g->migs[m].ci].magic = SIM_MAGIC_CI;
    }
}

/* Find what handle `h` of kind `magic` points at, without dereferencing foreign pointers: a
 * GPU or MIG device (SIM_MAGIC_DEVICE; *mig NULL for a full GPU), a GPU instance (SIM_MAGIC_GI:
 * *gi) or a compute instance (SIM_MAGIC_CI: *gi its GPU instance, *mig the MIG device). */
static nvmlReturn_t lookup_handle(const struct sim_handle *h, uint32_t magic, sim_gpu **gpu,
                                  sim_gi **gi, sim_mig **mig)
{
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_node.gpus;
    if (!h || p < base || p >= base + sizeof g_node.gpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t idx = (p - base) / sizeof(sim_gpu);
    sim_gpu *g = &g_node.gpus[idx];
    if ((int)idx >= g_node.ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    *gpu = g;
    *mig = NULL;
    *gi = NULL;
    if (magic == SIM_MAGIC_DEVICE) {
        if (h == &g->h)
            return g->h.magic == magic ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
        for (int m = 0; m < g->nmig; m++)
            if (h == &g->migs[m].h) {
                *mig = &g->migs[m];
                return h->magic == magic ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
            }
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (int s = 0; s < SIM_MAX_MIG; s++) {
        sim_gi *c = &g->gis[s];
        if (magic == SIM_MAGIC_GI && h == &c->h) {
            *gi = c;
            return c->live && h->magic == magic ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
        }
        for (unsigned int k = 0; magic == SIM_MAGIC_CI && k < SIM_MAX_CI; k++) {
            if (h != &c->ci_h[k])
                continue;
            *gi = c;
            for (int m = 0; c->live && h->magic == magic && m < g->nmig; m++)
                if (g->migs[m].gi == c->id && g->migs[m].ci == k) {
                    *mig = &g->migs[m];
                    return NVML_SUCCESS;
                }
            return NVML_ERROR_INVALID_ARGUMENT;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t sim_lookup_device(nvmlDevice_t device, sim_gpu **gpu, sim_mig **mig)
{
    sim_gi *gi;
    nvmlReturn_t rc = lookup_handle(device, SIM_MAGIC_DEVICE, gpu, &gi, mig);
    if (rc == NVML_SUCCESS && (*gpu)->lost)
        return NVML_ERROR_GPU_IS_LOST;
    return rc;
}

nvmlReturn_t sim_enter_instance(struct sim_handle *h, uint32_t magic, int out_ok, sim_gpu **gpu,
                                sim_gi **gi, sim_mig **mig)
{
    sim_gi *gi_buf;
    if (!gi)
        gi = &gi_buf;
    for (;;) {
        nvmlReturn_t rc = sim_enter(1);
        if (rc)
            return rc;
        rc = lookup_handle(h, magic, gpu, gi, mig);
        if (rc == NVML_SUCCESS && (*gpu)->lost)
            rc = NVML_ERROR_GPU_IS_LOST;
        if (rc == NVML_SUCCESS && !out_ok)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        if (rc) {
            sim_leave();
            return rc;
        }
        if (!sim_hang_wait(*gpu))
            return NVML_SUCCESS;
    }
}

nvmlReturn_t sim_enter_device(nvmlDevice_t device, int out_ok, sim_gpu **gpu, sim_mig **mig)
{
    return sim_enter_instance(device, SIM_MAGIC_DEVICE, out_ok, gpu, NULL, mig);
}

unsigned long long sim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

void sim_sleep_until_ns(unsigned long long until_ns)
{
    struct timespec until = {(time_t)(until_ns / 1000000000ULL),
                             (long)(until_ns % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
    }
}

/* A hung call wakes this often to read the log again: a record that ends or extends the hang
 * takes effect on the calls already waiting. */
#define HANG_SLICE_NS 20000000ULL

int sim_hang_wait(const sim_gpu *g)
{
    unsigned long long until = g->hang_until_ns, now = sim_now_ns();
    if (until == 0 || until <= now)
        return 0;
    sim_leave();
    sim_sleep_until_ns(until - now > HANG_SLICE_NS ? now + HANG_SLICE_NS : until);
    return 1;
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
        for (int i = 0; i < node->ngpus; i++)
            sim_telemetry_defaults(&node->gpus[i]);
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
#define ERROR_TEXT(name, value, text) case NVML_ERROR_##name: return text;
    switch (result) {
    case NVML_SUCCESS: return "Success";
    SIM_NVML_ERRORS(ERROR_TEXT)
    }
    return "Unknown Error";
}

/* ---- system queries ---- */

/* Answer a version string query with `value`, a string of g_node (read under the lock). */
static nvmlReturn_t version_string(char *version, unsigned int length, const char *value)
{
    nvmlReturn_t rc = sim_enter(version != NULL);
    if (rc)
        return rc;
    rc = sim_copy_string(version, length, value);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    return version_string(version, length, g_node.driver_version);
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return version_string(version, length, g_node.nvml_version);
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
