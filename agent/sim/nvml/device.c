/*
 * device.c: the per-device NVML queries: handles, identity, PCI, memory, affinity, topology,
 * NVLink, MIG and ECC counters.
 *
 * Owns: answering each query from the loaded node (g_node) with NVML's return codes:
 * UNINITIALIZED before init, INVALID_ARGUMENT for bad handles, indices and NULL outputs,
 * GPU_IS_LOST for a lost GPU and its MIG devices, NOT_SUPPORTED where the profile has no
 * value (no serial, no NUMA node, no NVLinks, not MIG capable) or for MIG handles on queries
 * that only full GPUs answer. Must not block and must not change state (control.c does).
 */
#include <stdio.h>
#include <string.h>

#include "sim.h"

#define MIB (1024ULL * 1024ULL)

/* Enter for a query that only a full GPU answers (MIG handles get NOT_SUPPORTED). */
static nvmlReturn_t enter_gpu(nvmlDevice_t device, int out_ok, sim_gpu **g)
{
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, out_ok, g, &m);
    if (rc)
        return rc;
    if (m) {
        sim_leave();
        return NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

#define DONE(rc) do { sim_leave(); return (rc); } while (0)

/* ---- handles ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t rc = sim_enter(deviceCount != NULL);
    if (rc)
        return rc;
    *deviceCount = (unsigned int)g_node.ngpus;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = sim_enter(device != NULL);
    if (rc)
        return rc;
    if (index >= (unsigned int)g_node.ngpus)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (g_node.gpus[index].lost)
        DONE(NVML_ERROR_GPU_IS_LOST);
    *device = &g_node.gpus[index].h;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = sim_enter(uuid != NULL && device != NULL);
    if (rc)
        return rc;
    for (int i = 0; i < g_node.ngpus; i++) {
        sim_gpu *g = &g_node.gpus[i];
        nvmlDevice_t found = NULL;
        if (strcmp(g->uuid, uuid) == 0)
            found = &g->h;
        for (int m = 0; m < g->nmig && !found; m++)
            if (strcmp(g->migs[m].uuid, uuid) == 0)
                found = &g->migs[m].h;
        if (found) {
            if (g->lost)
                DONE(NVML_ERROR_GPU_IS_LOST);
            *device = found;
            DONE(NVML_SUCCESS);
        }
    }
    DONE(NVML_ERROR_NOT_FOUND);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId,
                                                         nvmlDevice_t *device)
{
    nvmlReturn_t rc = sim_enter(pciBusId != NULL && device != NULL);
    if (rc)
        return rc;
    sim_pci want;
    if (sim_parse_bus_id(pciBusId, &want) < 0)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_node.ngpus; i++) {
        sim_gpu *g = &g_node.gpus[i];
        if (g->pci.domain == want.domain && g->pci.bus == want.bus
            && g->pci.device == want.device && g->pci.function == want.function) {
            if (g->lost)
                DONE(NVML_ERROR_GPU_IS_LOST);
            *device = &g->h;
            DONE(NVML_SUCCESS);
        }
    }
    DONE(NVML_ERROR_NOT_FOUND);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- identity ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, index != NULL, &g);
    if (rc)
        return rc;
    *index = (unsigned int)g->h.gpu;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, name != NULL, &g, &m);
    if (rc)
        return rc;
    if (!m)
        DONE(sim_copy_string(name, length, g->name));
    char buf[SIM_LEN_NAME + SIM_LEN_MIG_NAME + 8];
    snprintf(buf, sizeof buf, "%s MIG %s", g->name, g->profiles[m->profile].name);
    DONE(sim_copy_string(name, length, buf));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, uuid != NULL, &g, &m);
    if (rc)
        return rc;
    DONE(sim_copy_string(uuid, length, m ? m->uuid : g->uuid));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial,
                                            unsigned int length)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, serial != NULL, &g);
    if (rc)
        return rc;
    if (!g->has_serial)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    DONE(sim_copy_string(serial, length, g->serial));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, minorNumber != NULL, &g);
    if (rc)
        return rc;
    *minorNumber = g->minor;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                           int *minor)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, major != NULL && minor != NULL, &g, &m);
    if (rc)
        return rc;
    *major = g->cc_major;
    *minor = g->cc_minor;
    DONE(NVML_SUCCESS);
}

/* ---- PCI ---- */

static void fill_pci(const sim_pci *pci, nvmlPciInfo_t *out)
{
    memset(out, 0, sizeof *out);
    sim_format_bus_id(pci, out->busIdLegacy, sizeof out->busIdLegacy, 1);
    sim_format_bus_id(pci, out->busId, sizeof out->busId, 0);
    out->domain = pci->domain;
    out->bus = pci->bus;
    out->device = pci->device;
    out->pciDeviceId = pci->device_id;
    out->pciSubSystemId = pci->subsystem_id;
}

static void fill_pci_legacy(const sim_pci *pci, nvmlPciInfoLegacy_t *out)
{
    memset(out, 0, sizeof *out);
    sim_format_bus_id(pci, out->busId, sizeof out->busId, 1);
    out->domain = pci->domain;
    out->bus = pci->bus;
    out->device = pci->device;
    out->pciDeviceId = pci->device_id;
    out->pciSubSystemId = pci->subsystem_id;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, pci != NULL, &g);
    if (rc)
        return rc;
    fill_pci(&g->pci, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, pci != NULL, &g);
    if (rc)
        return rc;
    fill_pci_legacy(&g->pci, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    return nvmlDeviceGetPciInfo_v2(device, pci);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, pci != NULL, &g);
    if (rc)
        return rc;
    if (pci->version != (unsigned int)(sizeof *pci | (1u << 24)))
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    pci->domain = g->pci.domain;
    pci->bus = g->pci.bus;
    pci->device = g->pci.device;
    pci->pciDeviceId = g->pci.device_id;
    pci->pciSubSystemId = g->pci.subsystem_id;
    pci->baseClass = 0x3; /* display controller */
    pci->subClass = 0x2;  /* 3D controller */
    sim_format_bus_id(&g->pci, pci->busId, sizeof pci->busId, 0);
    DONE(NVML_SUCCESS);
}

/* ---- memory ---- */

static void memory_of(const sim_gpu *g, const sim_mig *m, unsigned long long *total,
                      unsigned long long *reserved, unsigned long long *used)
{
    if (m) {
        *total = g->profiles[m->profile].memory_mb * MIB;
        *reserved = 0;
        *used = 0;
    } else {
        *total = g->mem_total;
        *reserved = g->mem_reserved;
        *used = g->mem_used;
    }
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, memory != NULL, &g, &m);
    if (rc)
        return rc;
    unsigned long long total, reserved, used;
    memory_of(g, m, &total, &reserved, &used);
    memory->total = total;
    memory->used = reserved + used; /* the v1 struct counts reserved memory as used */
    memory->free = total - reserved - used;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, memory != NULL, &g, &m);
    if (rc)
        return rc;
    if (memory->version != SIM_MEMORY_V2_VERSION)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory_of(g, m, &memory->total, &memory->reserved, &memory->used);
    memory->free = memory->total - memory->reserved - memory->used;
    DONE(NVML_SUCCESS);
}

/* ---- NUMA and affinity ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, node != NULL, &g);
    if (rc)
        return rc;
    if (!g->has_numa)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *node = (unsigned int)g->numa_node;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                                 unsigned long *cpuSet)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, cpuSet != NULL && cpuSetSize > 0, &g);
    if (rc)
        return rc;
    for (unsigned int k = 0; k < cpuSetSize; k++)
        cpuSet[k] = k < SIM_CPU_WORDS ? (unsigned long)g->cpu_mask[k] : 0;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device,
                                                            unsigned int cpuSetSize,
                                                            unsigned long *cpuSet,
                                                            unsigned int scope)
{
    if (scope > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    return nvmlDeviceGetCpuAffinity(device, cpuSetSize, cpuSet);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                    unsigned long *nodeSet, unsigned int scope)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, nodeSet != NULL && nodeSetSize > 0 && scope <= 1, &g);
    if (rc)
        return rc;
    if (!g->has_numa)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    for (unsigned int k = 0; k < nodeSetSize; k++)
        nodeSet[k] = 0;
    unsigned int word = (unsigned int)g->numa_node / 64;
    if (word < nodeSetSize)
        nodeSet[word] = 1UL << (g->numa_node % 64);
    DONE(NVML_SUCCESS);
}

/* ---- topology and NVLink ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1,
                                                            nvmlDevice_t device2,
                                                            unsigned int *pathInfo)
{
    sim_gpu *a, *b;
    sim_mig *mb;
    nvmlReturn_t rc = enter_gpu(device1, pathInfo != NULL, &a);
    if (rc)
        return rc;
    rc = sim_lookup_device(device2, &b, &mb);
    if (rc)
        DONE(rc);
    if (mb)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *pathInfo = (unsigned int)a->topo[b->h.gpu];
    DONE(NVML_SUCCESS);
}

/* Enter for a per-link query; on success the lock is held and `link` is a listed link. */
static nvmlReturn_t enter_link(nvmlDevice_t device, unsigned int link, int out_ok, sim_gpu **g)
{
    nvmlReturn_t rc = enter_gpu(device, out_ok, g);
    if (rc)
        return rc;
    if ((*g)->nlinks == 0)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else if (link >= SIM_MAX_LINKS)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (link >= (unsigned int)(*g)->nlinks)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc)
        sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                                 unsigned int *isActive)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_link(device, link, isActive != NULL, &g);
    if (rc)
        return rc;
    *isActive = g->link_kind[link] != SIM_LINK_NONE;
    DONE(NVML_SUCCESS);
}

static const sim_pci *remote_pci(const sim_gpu *g, unsigned int link)
{
    if (g->link_kind[link] == SIM_LINK_GPU)
        return &g_node.gpus[g->link_target[link]].pci;
    if (g->link_kind[link] == SIM_LINK_SWITCH)
        return &g_node.switches[g->link_target[link]];
    return NULL;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device,
                                                            unsigned int link,
                                                            nvmlPciInfo_t *pci)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_link(device, link, pci != NULL, &g);
    if (rc)
        return rc;
    const sim_pci *r = remote_pci(g, link);
    if (!r)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    fill_pci(r, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
                                                         nvmlPciInfoLegacy_t *pci)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_link(device, link, pci != NULL, &g);
    if (rc)
        return rc;
    const sim_pci *r = remote_pci(g, link);
    if (!r)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    fill_pci_legacy(r, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device,
                                                            unsigned int link,
                                                            unsigned int *type)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_link(device, link, type != NULL, &g);
    if (rc)
        return rc;
    if (g->link_kind[link] == SIM_LINK_NONE)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *type = g->link_kind[link] == SIM_LINK_GPU ? SIM_NVLINK_DEVICE_GPU : SIM_NVLINK_DEVICE_SWITCH;
    DONE(NVML_SUCCESS);
}

/* ---- MIG ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                             unsigned int *pendingMode)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, currentMode != NULL && pendingMode != NULL, &g);
    if (rc)
        return rc;
    if (!g->mig_capable)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = (unsigned int)g->mig_mode;
    *pendingMode = (unsigned int)g->mig_pending;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, count != NULL, &g);
    if (rc)
        return rc;
    if (!g->mig_capable)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *count = g->mig_max;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device,
                                                            unsigned int index,
                                                            nvmlDevice_t *migDevice)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, migDevice != NULL, &g);
    if (rc)
        return rc;
    if (!g->mig_capable)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    if (index >= g->mig_max)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->mig_mode || index >= (unsigned int)g->nmig)
        DONE(NVML_ERROR_NOT_FOUND);
    *migDevice = &g->migs[index].h;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                     nvmlDevice_t *device)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(migDevice, device != NULL, &g, &m);
    if (rc)
        return rc;
    if (!m)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    *device = &g->h;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMig)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, isMig != NULL, &g, &m);
    if (rc)
        return rc;
    *isMig = m != NULL;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, id != NULL, &g, &m);
    if (rc)
        return rc;
    if (!m)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    *id = m->gi;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, id != NULL, &g, &m);
    if (rc)
        return rc;
    if (!m)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    *id = m->ci;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device,
                                                   nvmlDeviceAttributes_t *attributes)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, attributes != NULL, &g, &m);
    if (rc)
        return rc;
    memset(attributes, 0, sizeof *attributes);
    if (m) {
        const sim_mig_profile *p = &g->profiles[m->profile];
        attributes->multiprocessorCount = p->multiprocessors;
        attributes->sharedCopyEngineCount = p->copy_engines;
        attributes->sharedDecoderCount = p->decoders;
        attributes->sharedEncoderCount = p->encoders;
        attributes->sharedJpegCount = p->jpegs;
        attributes->sharedOfaCount = p->ofas;
        attributes->gpuInstanceSliceCount = p->slices;
        attributes->computeInstanceSliceCount = p->slices;
        attributes->memorySizeMB = p->memory_mb;
        DONE(NVML_SUCCESS);
    }
    if (!g->has_mp)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    attributes->multiprocessorCount = g->multiprocessors;
    attributes->memorySizeMB = g->mem_total / MIB;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device,
                                                nvmlDeviceAttributes_t *attributes)
{
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

static nvmlReturn_t gi_profile(nvmlDevice_t device, unsigned int profile, int out_ok,
                               const sim_mig_profile **out)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, out_ok, &g);
    if (rc)
        return rc;
    if (!g->mig_capable)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else if (profile >= SIM_NUM_GI_PROFILES)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else {
        rc = NVML_ERROR_NOT_SUPPORTED;
        for (int k = 0; k < g->nprofiles; k++)
            if (g->profiles[k].nvml_profile == (int)profile) {
                *out = &g->profiles[k];
                rc = NVML_SUCCESS;
            }
    }
    if (rc)
        sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device,
                                                            unsigned int profile,
                                                            nvmlGpuInstanceProfileInfo_t *info)
{
    const sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile(device, profile, info != NULL, &p);
    if (rc)
        return rc;
    info->id = p->id;
    info->isP2pSupported = p->p2p;
    info->sliceCount = p->slices;
    info->instanceCount = p->instance_count;
    info->multiprocessorCount = p->multiprocessors;
    info->copyEngineCount = p->copy_engines;
    info->decoderCount = p->decoders;
    info->encoderCount = p->encoders;
    info->jpegCount = p->jpegs;
    info->ofaCount = p->ofas;
    info->memorySizeMB = p->memory_mb;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device,
                                                             unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const sim_mig_profile *p;
    nvmlReturn_t rc = gi_profile(device, profile, info != NULL, &p);
    if (rc)
        return rc;
    if (info->version != SIM_GI_PROFILE_INFO_V2_VERSION)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    info->id = p->id;
    info->isP2pSupported = p->p2p;
    info->sliceCount = p->slices;
    info->instanceCount = p->instance_count;
    info->multiprocessorCount = p->multiprocessors;
    info->copyEngineCount = p->copy_engines;
    info->decoderCount = p->decoders;
    info->encoderCount = p->encoders;
    info->jpegCount = p->jpegs;
    info->ofaCount = p->ofas;
    info->memorySizeMB = p->memory_mb;
    snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    DONE(NVML_SUCCESS);
}

/* ---- ECC ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                                    unsigned int counterType,
                                                    unsigned long long *eccCounts)
{
    sim_gpu *g;
    nvmlReturn_t rc = enter_gpu(device, eccCounts != NULL && errorType <= 1 && counterType <= 1,
                                &g);
    if (rc)
        return rc;
    /* Volatile and aggregate counts are the same: the simulator never reboots. */
    *eccCounts = errorType == 1 ? g->ecc_dbe : g->ecc_sbe;
    DONE(NVML_SUCCESS);
}
