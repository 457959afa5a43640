/*
 * device.c: the per-device NVML queries: handles, identity, PCI, memory, affinity, topology,
 * NVLink, MIG, ECC counters and supported event types.
 *
 * Owns: answering each query from the loaded node (g_node) with NVML's return codes:
 * UNINITIALIZED before init, INVALID_ARGUMENT for bad handles, indices and NULL outputs,
 * GPU_IS_LOST for a lost GPU and its MIG devices, NOT_SUPPORTED where the profile has no
 * value (no serial, no NUMA node, no NVLinks, not MIG capable) or for MIG handles on queries
 * that only full GPUs answer. Must not block (but for a hung GPU: sim_enter_device and
 * sim_hang_wait sleep it out, lock released) and must not change state (control.c does).
 * The telemetry queries (utilization, temperature, power, clocks, retired pages, remapped
 * rows) are telemetry.c's; the memory queries here read the memory used it may have set.
 */
#include <stdio.h>
#include <string.h>

#include "sim.h"

#define MIB (1024ULL * 1024ULL)

/* Which handles a query answers. */
typedef enum {
    ANY_DEVICE, /* a full GPU or a MIG device */
    FULL_GPU,   /* a full GPU only: a MIG handle gets NOT_SUPPORTED */
    MIG_DEVICE, /* a MIG device only: a full GPU gets INVALID_ARGUMENT */
} handle_scope;

/* sim_enter_device, then the scope check; on failure the lock is released. */
static nvmlReturn_t enter_scope(nvmlDevice_t device, handle_scope want, int out_ok, sim_gpu **g,
                                sim_mig **m)
{
    nvmlReturn_t rc = sim_enter_device(device, out_ok, g, m);
    if (rc)
        return rc;
    if (want == FULL_GPU && *m)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else if (want == MIG_DEVICE && !*m)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc)
        sim_leave();
    return rc;
}

/* Open a device query: declare g (the GPU) and m (its MIG device; NULL for a full GPU), enter
 * for `device` within `want`, INVALID_ARGUMENT unless out_ok. Past it the lock is held. */
#define ENTER(want, device, out_ok) \
    sim_gpu *g; \
    sim_mig *m; \
    TRY_ENTER(enter_scope((device), (want), (out_ok), &g, &m))

/*
 * The queries that copy one value of the node into their one output:
 *   X(function, output type, scope, supported, value)
 * supported: NOT_SUPPORTED unless true; value: what the output gets (from g and m, as ENTER
 * declares them).
 */
#define VALUE_QUERIES(X) \
    X(nvmlDeviceGetIndex, unsigned int, FULL_GPU, 1, (unsigned int)g->h.gpu) \
    X(nvmlDeviceGetMinorNumber, unsigned int, FULL_GPU, 1, g->minor) \
    X(nvmlDeviceGetNumaNodeId, unsigned int, FULL_GPU, g->has_numa, (unsigned int)g->numa_node) \
    X(nvmlDeviceGetSupportedEventTypes, unsigned long long, FULL_GPU, 1, g->supported_events) \
    X(nvmlDeviceGetMaxMigDeviceCount, unsigned int, FULL_GPU, g->mig_capable, g->mig_max) \
    X(nvmlDeviceIsMigDeviceHandle, unsigned int, ANY_DEVICE, 1, m != NULL) \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, nvmlDevice_t, MIG_DEVICE, 1, &g->h) \
    X(nvmlDeviceGetGpuInstanceId, unsigned int, MIG_DEVICE, 1, m->gi) \
    X(nvmlDeviceGetComputeInstanceId, unsigned int, MIG_DEVICE, 1, m->ci)

#define DEFINE_VALUE_QUERY(function, type, want, supported, value) \
    SIM_EXPORT nvmlReturn_t function(nvmlDevice_t device, type *out) \
    { \
        ENTER(want, device, out != NULL); \
        if (!(supported)) \
            DONE(NVML_ERROR_NOT_SUPPORTED); \
        *out = (value); \
        DONE(NVML_SUCCESS); \
    }

VALUE_QUERIES(DEFINE_VALUE_QUERY)

/* ---- handles ---- */

/* Hand out handle `h` of GPU `g`, found by a lookup; a lost GPU's handles are not. */
static nvmlReturn_t hand_out(const sim_gpu *g, nvmlDevice_t h, nvmlDevice_t *device)
{
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    *device = h;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    TRY_ENTER(sim_enter(deviceCount != NULL));
    *deviceCount = (unsigned int)g_node.ngpus;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    TRY_ENTER(sim_enter(device != NULL));
    if (index >= (unsigned int)g_node.ngpus)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (sim_hang_wait(&g_node.gpus[index]))
        return nvmlDeviceGetHandleByIndex_v2(index, device);
    DONE(hand_out(&g_node.gpus[index], &g_node.gpus[index].h, device));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    TRY_ENTER(sim_enter(uuid != NULL && device != NULL));
    for (int i = 0; i < g_node.ngpus; i++) {
        sim_gpu *g = &g_node.gpus[i];
        int mine = strcmp(g->uuid, uuid) == 0;
        for (int m = 0; m < g->nmig && !mine; m++)
            mine = strcmp(g->migs[m].uuid, uuid) == 0;
        if (!mine)
            continue;
        if (sim_hang_wait(g))
            return nvmlDeviceGetHandleByUUID(uuid, device);
        if (strcmp(g->uuid, uuid) == 0)
            DONE(hand_out(g, &g->h, device));
        for (int m = 0; m < g->nmig; m++)
            if (strcmp(g->migs[m].uuid, uuid) == 0)
                DONE(hand_out(g, &g->migs[m].h, device));
    }
    DONE(NVML_ERROR_NOT_FOUND);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId,
                                                         nvmlDevice_t *device)
{
    TRY_ENTER(sim_enter(pciBusId != NULL && device != NULL));
    sim_pci want;
    if (sim_parse_bus_id(pciBusId, &want) < 0)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_node.ngpus; i++) {
        sim_gpu *g = &g_node.gpus[i];
        if (g->pci.domain == want.domain && g->pci.bus == want.bus
            && g->pci.device == want.device && g->pci.function == want.function) {
            if (sim_hang_wait(g))
                return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
            DONE(hand_out(g, &g->h, device));
        }
    }
    DONE(NVML_ERROR_NOT_FOUND);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- identity ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER(ANY_DEVICE, device, name != NULL);
    if (!m)
        DONE(sim_copy_string(name, length, g->name));
    char buf[SIM_LEN_NAME + SIM_LEN_MIG_NAME + 16];
    const sim_mig_profile *p = &g->profiles[m->profile];
    if (m->ci_slices && m->ci_slices < p->slices) /* a compute instance smaller than its GI */
        snprintf(buf, sizeof buf, "%s MIG %uc.%s", g->name, m->ci_slices, p->name);
    else
        snprintf(buf, sizeof buf, "%s MIG %s", g->name, p->name);
    DONE(sim_copy_string(name, length, buf));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER(ANY_DEVICE, device, uuid != NULL);
    DONE(sim_copy_string(uuid, length, m ? m->uuid : g->uuid));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial,
                                            unsigned int length)
{
    ENTER(FULL_GPU, device, serial != NULL);
    if (!g->has_serial)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    DONE(sim_copy_string(serial, length, g->serial));
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                           int *minor)
{
    ENTER(ANY_DEVICE, device, major != NULL && minor != NULL);
    *major = g->cc_major;
    *minor = g->cc_minor;
    DONE(NVML_SUCCESS);
}

/* The architecture of a GPU, from its compute capability (the chip family decides both):
 * nvmlDeviceArchitecture_t's values, as pynvml names them (NVML_DEVICE_ARCH_*). */
static unsigned int sim_architecture(int major, int minor)
{
    if (major == 3)
        return 2; /* KEPLER */
    if (major == 5)
        return 3; /* MAXWELL */
    if (major == 6)
        return 4; /* PASCAL */
    if (major == 7)
        return minor >= 5 ? 6 : 5; /* TURING (7.5) : VOLTA (7.0, 7.2) */
    if (major == 8)
        return minor == 9 ? 8 : 7; /* ADA (8.9) : AMPERE (8.0, 8.6, 8.7) */
    if (major == 9)
        return 9; /* HOPPER */
    if (major == 10 || major == 12)
        return 10; /* BLACKWELL */
    return 0xffffffff; /* NVML_DEVICE_ARCH_UNKNOWN */
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    ENTER(ANY_DEVICE, device, arch != NULL);
    *arch = sim_architecture(g->cc_major, g->cc_minor);
    DONE(NVML_SUCCESS);
}

/* The brand (nvmlBrandType_t): NVML_BRAND_TESLA (2) for the "Tesla ..." names the driver
 * gives data-centre GPUs before Ampere, NVML_BRAND_NVIDIA (14) for the "NVIDIA ..." names of
 * A100, H100 and later; NVML_BRAND_GEFORCE (5) for "... GeForce ...". */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, unsigned int *brand)
{
    ENTER(ANY_DEVICE, device, brand != NULL);
    if (strncmp(g->name, "Tesla ", 6) == 0)
        *brand = 2;
    else if (strstr(g->name, "GeForce") != NULL)
        *brand = 5;
    else
        *brand = 14;
    DONE(NVML_SUCCESS);
}

/* ---- PCI ---- */

/* Copy one field of SIM_PCI_ID_FIELDS or SIM_GI_PROFILE_FIELDS from `src` into `out`. */
#define COPY_FIELD(type, field, member) out->field = src->member;

static void fill_pci(const sim_pci *src, nvmlPciInfo_t *out)
{
    memset(out, 0, sizeof *out);
    SIM_PCI_ID_FIELDS(COPY_FIELD)
    sim_format_bus_id(src, out->busIdLegacy, sizeof out->busIdLegacy, 1);
    sim_format_bus_id(src, out->busId, sizeof out->busId, 0);
}

static void fill_pci_legacy(const sim_pci *src, nvmlPciInfoLegacy_t *out)
{
    memset(out, 0, sizeof *out);
    SIM_PCI_ID_FIELDS(COPY_FIELD)
    sim_format_bus_id(src, out->busId, sizeof out->busId, 1);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER(FULL_GPU, device, pci != NULL);
    fill_pci(&g->pci, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    ENTER(FULL_GPU, device, pci != NULL);
    fill_pci_legacy(&g->pci, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfoLegacy_t *pci)
{
    return nvmlDeviceGetPciInfo_v2(device, pci);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci)
{
    ENTER(FULL_GPU, device, pci != NULL);
    if (pci->version != (unsigned int)(sizeof *pci | (1u << 24)))
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    nvmlPciInfoExt_v1_t *out = pci;
    const sim_pci *src = &g->pci;
    SIM_PCI_ID_FIELDS(COPY_FIELD)
    out->baseClass = 0x3; /* display controller */
    out->subClass = 0x2;  /* 3D controller */
    sim_format_bus_id(src, out->busId, sizeof out->busId, 0);
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
    ENTER(ANY_DEVICE, device, memory != NULL);
    unsigned long long total, reserved, used;
    memory_of(g, m, &total, &reserved, &used);
    memory->total = total;
    memory->used = reserved + used; /* the v1 struct counts reserved memory as used */
    memory->free = total - reserved - used;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER(ANY_DEVICE, device, memory != NULL);
    if (memory->version != SIM_MEMORY_V2_VERSION)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory_of(g, m, &memory->total, &memory->reserved, &memory->used);
    memory->free = memory->total - memory->reserved - memory->used;
    DONE(NVML_SUCCESS);
}

/* ---- NUMA and affinity ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                                 unsigned long *cpuSet)
{
    ENTER(FULL_GPU, device, cpuSet != NULL && cpuSetSize > 0);
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
    ENTER(FULL_GPU, device, nodeSet != NULL && nodeSetSize > 0 && scope <= 1);
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
    ENTER(FULL_GPU, device1, pathInfo != NULL);
    sim_gpu *b;
    sim_mig *mb;
    nvmlReturn_t rc = sim_lookup_device(device2, &b, &mb);
    if (rc)
        DONE(rc);
    if (mb)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *pathInfo = (unsigned int)g->topo[b->h.gpu];
    DONE(NVML_SUCCESS);
}

/* Open a per-link query: ENTER for a full GPU, then `link` must be one the GPU lists. */
#define ENTER_LINK(device, link, out_ok) \
    ENTER(FULL_GPU, device, out_ok); \
    if (g->nlinks == 0) \
        DONE(NVML_ERROR_NOT_SUPPORTED); \
    if ((link) >= SIM_MAX_LINKS) \
        DONE(NVML_ERROR_INVALID_ARGUMENT); \
    if ((link) >= (unsigned int)g->nlinks) \
        DONE(NVML_ERROR_NOT_SUPPORTED)

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                                 unsigned int *isActive)
{
    ENTER_LINK(device, link, isActive != NULL);
    *isActive = g->link_kind[link] != SIM_LINK_NONE;
    DONE(NVML_SUCCESS);
}

/* Enter for a query about the far end of `link`: on success the lock is held and *remote is
 * the PCI identity of the GPU or switch there (NOT_SUPPORTED for a link that is down). */
static nvmlReturn_t enter_remote(nvmlDevice_t device, unsigned int link, int out_ok,
                                 const sim_pci **remote)
{
    ENTER_LINK(device, link, out_ok);
    if (g->link_kind[link] == SIM_LINK_GPU)
        *remote = &g_node.gpus[g->link_target[link]].pci;
    else if (g->link_kind[link] == SIM_LINK_SWITCH)
        *remote = &g_node.switches[g->link_target[link]];
    else
        DONE(NVML_ERROR_NOT_SUPPORTED);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device,
                                                            unsigned int link,
                                                            nvmlPciInfo_t *pci)
{
    const sim_pci *remote;
    TRY_ENTER(enter_remote(device, link, pci != NULL, &remote));
    fill_pci(remote, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
                                                         nvmlPciInfoLegacy_t *pci)
{
    const sim_pci *remote;
    TRY_ENTER(enter_remote(device, link, pci != NULL, &remote));
    fill_pci_legacy(remote, pci);
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device,
                                                            unsigned int link,
                                                            unsigned int *type)
{
    ENTER_LINK(device, link, type != NULL);
    if (g->link_kind[link] == SIM_LINK_NONE)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *type = g->link_kind[link] == SIM_LINK_GPU ? SIM_NVLINK_DEVICE_GPU : SIM_NVLINK_DEVICE_SWITCH;
    DONE(NVML_SUCCESS);
}

/* ---- MIG ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                             unsigned int *pendingMode)
{
    ENTER(FULL_GPU, device, currentMode != NULL && pendingMode != NULL);
    if (!g->mig_capable)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = (unsigned int)g->mig_mode;
    *pendingMode = (unsigned int)g->mig_pending;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device,
                                                            unsigned int index,
                                                            nvmlDevice_t *migDevice)
{
    ENTER(FULL_GPU, device, migDevice != NULL);
    if (!g->mig_capable)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    if (index >= g->mig_max)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->mig_mode || index >= (unsigned int)g->nmig)
        DONE(NVML_ERROR_NOT_FOUND);
    *migDevice = &g->migs[index].h;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device,
                                                   nvmlDeviceAttributes_t *attributes)
{
    ENTER(ANY_DEVICE, device, attributes != NULL);
    memset(attributes, 0, sizeof *attributes);
    if (m) {
        const sim_mig_profile *p = &g->profiles[m->profile];
        unsigned int cs = m->ci_slices && m->ci_slices < p->slices ? m->ci_slices : p->slices;
        attributes->multiprocessorCount = p->slices ? p->multiprocessors * cs / p->slices : 0;
        attributes->sharedCopyEngineCount = p->copy_engines;
        attributes->sharedDecoderCount = p->decoders;
        attributes->sharedEncoderCount = p->encoders;
        attributes->sharedJpegCount = p->jpegs;
        attributes->sharedOfaCount = p->ofas;
        attributes->gpuInstanceSliceCount = p->slices;
        attributes->computeInstanceSliceCount = cs;
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

/* Both GPU instance profile info queries: into *v1 (nvmlDeviceGetGpuInstanceProfileInfo) or *v2
 * (the versioned ...InfoV), whichever is not NULL. */
static nvmlReturn_t gi_profile_info(nvmlDevice_t device, unsigned int profile,
                                    nvmlGpuInstanceProfileInfo_t *v1,
                                    nvmlGpuInstanceProfileInfo_v2_t *v2)
{
    ENTER(FULL_GPU, device, v1 != NULL || v2 != NULL);
    if (!g->mig_capable)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    if (profile >= SIM_NUM_GI_PROFILES)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    const sim_mig_profile *src = NULL;
    for (int k = 0; k < g->nprofiles; k++)
        if (g->profiles[k].nvml_profile == (int)profile)
            src = &g->profiles[k];
    if (!src)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    if (v2 && v2->version != SIM_GI_PROFILE_INFO_V2_VERSION)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (v1) {
        nvmlGpuInstanceProfileInfo_t *out = v1;
        SIM_GI_PROFILE_FIELDS(COPY_FIELD)
    } else {
        nvmlGpuInstanceProfileInfo_v2_t *out = v2;
        SIM_GI_PROFILE_FIELDS(COPY_FIELD)
        snprintf(out->name, sizeof out->name, "MIG %s", src->name);
    }
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device,
                                                            unsigned int profile,
                                                            nvmlGpuInstanceProfileInfo_t *info)
{
    return gi_profile_info(device, profile, info, NULL);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device,
                                                             unsigned int profile,
                                                             nvmlGpuInstanceProfileInfo_v2_t *info)
{
    return gi_profile_info(device, profile, NULL, info);
}

/* ---- GPU and compute instances ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                     nvmlGpuInstance_t *gpuInstance)
{
    ENTER(FULL_GPU, device, gpuInstance != NULL);
    if (!g->mig_capable || !g->mig_mode)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    sim_gi *gi = sim_gi_by_id(g, id);
    if (!gi)
        DONE(NVML_ERROR_NOT_FOUND);
    *gpuInstance = &gi->h;
    DONE(NVML_SUCCESS);
}

/* Open a query on a GPU instance (GI) or compute instance (CI) handle: declare g, gi (the GPU
 * instance) and m (for a CI: the MIG device it is). Past it the lock is held. */
#define ENTER_INSTANCE(kind, handle, out_ok) \
    sim_gpu *g; \
    sim_gi *gi; \
    sim_mig *m; \
    TRY_ENTER(sim_enter_instance((handle), SIM_MAGIC_##kind, (out_ok), &g, &gi, &m))

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance,
                                               nvmlGpuInstanceInfo_t *info)
{
    ENTER_INSTANCE(GI, gpuInstance, info != NULL);
    const sim_mig_profile *p = &g->profiles[gi->profile];
    info->device = &g->h;
    info->id = gi->id;
    info->profileId = p->id;
    info->placement.start = gi->start;
    info->placement.size = p->place_size;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance,
                                                              unsigned int id,
                                                              nvmlComputeInstance_t *computeInstance)
{
    ENTER_INSTANCE(GI, gpuInstance, computeInstance != NULL);
    for (int k = 0; k < g->nmig; k++)
        if (g->migs[k].gi == gi->id && g->migs[k].ci == id && id < SIM_MAX_CI) {
            *computeInstance = &gi->ci_h[id];
            DONE(NVML_SUCCESS);
        }
    DONE(NVML_ERROR_NOT_FOUND);
}

SIM_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                      nvmlComputeInstanceInfo_t *info)
{
    ENTER_INSTANCE(CI, computeInstance, info != NULL);
    unsigned int cs = sim_ci_slices(g, m);
    info->device = &g->h;
    info->gpuInstance = &gi->h;
    info->id = m->ci;
    info->profileId = sim_ci_profile_of(cs);
    info->placement.start = m->ci_start;
    info->placement.size = cs;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                                   nvmlComputeInstanceInfo_t *info)
{
    return nvmlComputeInstanceGetInfo_v2(computeInstance, info);
}

/* The compute instance profiles a GPU instance offers: a compute instance of 1, 2, 3, 4 or 7
 * slices that fits in it (3 only in a 3- or 7-slice instance, 4 only in a 4- or 7-slice one,
 * as an A100 or H100 lists them), with the SHARED engine profile. Into *v1, *v2 or *v3. */
static nvmlReturn_t ci_profile_info(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                    unsigned int engine, nvmlComputeInstanceProfileInfo_t *v1,
                                    nvmlComputeInstanceProfileInfo_v2_t *v2,
                                    nvmlComputeInstanceProfileInfo_v3_t *v3)
{
    ENTER_INSTANCE(GI, gpuInstance, v1 != NULL || v2 != NULL || v3 != NULL);
    (void)m;
    if (profile >= SIM_NUM_CI_PROFILES || engine >= SIM_NUM_CI_ENGINE_PROFILES)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    const sim_mig_profile *gp = &g->profiles[gi->profile];
    unsigned int slices = sim_ci_profile_slices(profile, gp->slices), gs = gp->slices;
    if (!slices)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    if ((v2 && v2->version != SIM_CI_PROFILE_INFO_V2_VERSION) ||
        (v3 && v3->version != SIM_CI_PROFILE_INFO_V3_VERSION))
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    struct {
        unsigned int id, slices, instance_count, multiprocessors;
        unsigned int copy_engines, decoders, encoders, jpegs, ofas;
    } ci = {profile, slices, gs / slices, gs ? gp->multiprocessors * slices / gs : 0,
            gp->copy_engines, gp->decoders, gp->encoders, gp->jpegs, gp->ofas},
      *src = &ci;
    char name[96];
    if (slices == gs)
        snprintf(name, sizeof name, "MIG %s", gp->name);
    else
        snprintf(name, sizeof name, "MIG %uc.%s", slices, gp->name);
    if (v1) {
        nvmlComputeInstanceProfileInfo_t *out = v1;
        SIM_CI_PROFILE_FIELDS(COPY_FIELD)
    } else if (v2) {
        nvmlComputeInstanceProfileInfo_v2_t *out = v2;
        SIM_CI_PROFILE_FIELDS(COPY_FIELD)
        snprintf(out->name, sizeof out->name, "%s", name);
    } else {
        nvmlComputeInstanceProfileInfo_v3_t *out = v3;
        SIM_CI_PROFILE_FIELDS(COPY_FIELD)
        snprintf(out->name, sizeof out->name, "%s", name);
        out->capabilities = 0;
    }
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(
    nvmlGpuInstance_t gpuInstance, unsigned int profile, unsigned int engProfile,
    nvmlComputeInstanceProfileInfo_t *info)
{
    return ci_profile_info(gpuInstance, profile, engProfile, info, NULL, NULL);
}

/* The versioned query: the layout follows info->version (2 or 3). */
SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    nvmlGpuInstance_t gpuInstance, unsigned int profile, unsigned int engProfile,
    nvmlComputeInstanceProfileInfo_v2_t *info)
{
    if (info && info->version == SIM_CI_PROFILE_INFO_V3_VERSION)
        return ci_profile_info(gpuInstance, profile, engProfile, NULL, NULL,
                               (nvmlComputeInstanceProfileInfo_v3_t *)info);
    return ci_profile_info(gpuInstance, profile, engProfile, NULL, info, NULL);
}

/* ---- ECC ---- */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                                    unsigned int counterType,
                                                    unsigned long long *eccCounts)
{
    ENTER(FULL_GPU, device, eccCounts != NULL && errorType <= 1 && counterType <= 1);
    /* Volatile and aggregate counts are the same: the simulator never reboots. */
    *eccCounts = errorType == 1 ? g->ecc_dbe : g->ecc_sbe;
    DONE(NVML_SUCCESS);
}
