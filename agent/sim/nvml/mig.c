/*
 * mig.c: MIG GPU instances, compute instances and their placements.
 *
 * Owns: the placements of each GPU instance profile (derived from the profiles, below), placing
 * the instances a profile or a `mig` record lists, the state changes of the `mig` records that
 * create and destroy GPU and compute instances (control.c parses the records and calls these),
 * and the NVML calls that create and destroy instances and answer placements and remaining
 * capacity. Those calls never change state themselves: each writes a `mig` record
 * (sim_control_commit) that every process applies from the log, and answers with what applying
 * it made. Must not block.
 *
 * Placements (docs/simulator.md): a GPU has mem_slices memory slices (the smallest power of two
 * >= its largest profile's compute slices: 8 on A100/H100, 4 on A30). A profile's placement
 * size is the smallest power of two >= both its compute slices and its share of the memory in
 * slices (memory_mb * mem_slices / the largest profile's memory_mb, rounded); its starts are the
 * multiples of that size where the instance fits both the memory slices and the compute slices
 * (start + slices <= compute slices). That reproduces NVIDIA's tables for A100, H100 and A30
 * (`nvidia-smi mig -lgipp`): 1g.10gb {0..6}:1, 1g.20gb {0,2,4,6}:2, 2g.20gb {0,2,4}:2,
 * 3g.40gb {0,4}:4, 4g.40gb {0}:4, 7g.80gb {0}:8; A30 1g.6gb {0..3}:1, 2g.12gb {0,2}:2,
 * 4g.24gb {0}:4. Compute instances are placed the same way inside their GPU instance's compute
 * slices: starts at multiples of the next power of two >= their size (1c {0..6}, 2c {0,2,4},
 * 3c {0,4}, 4c {0}, 7c {0} in a 7-slice GPU instance).
 */
#include <stdio.h>
#include <string.h>

#include "sim.h"

/* The compute slices of each NVML_COMPUTE_INSTANCE_PROFILE_* (6, 8 and the rev1 / NVL
 * variants are never offered: no shipped GPU has them). */
static const unsigned int CI_PROFILE_SLICES[SIM_NUM_CI_PROFILES] = {1, 2, 3, 4, 7, 8, 6, 1, 7};

/* The largest GPU instance id the driver numbers capabilities for (nvidia-caps mig-minors:
 * gi0-gi14), so every instance made has its capability minors. */
#define SIM_MAX_GI_ID 14

static unsigned int pow2_at_least(unsigned int x)
{
    unsigned int p = 1;
    while (p < x)
        p <<= 1;
    return p;
}

void sim_mig_placements(sim_gpu *g)
{
    unsigned int cs = 0;
    unsigned long long mem = 0;
    for (int p = 0; p < g->nprofiles; p++) {
        if (g->profiles[p].slices > cs)
            cs = g->profiles[p].slices;
        if (g->profiles[p].memory_mb > mem)
            mem = g->profiles[p].memory_mb;
    }
    unsigned int ms = pow2_at_least(cs ? cs : 1);
    if (ms > SIM_MAX_MEM_SLICES)
        ms = SIM_MAX_MEM_SLICES;
    g->compute_slices = cs;
    g->mem_slices = ms;
    for (int p = 0; p < g->nprofiles; p++) {
        sim_mig_profile *mp = &g->profiles[p];
        unsigned int share = mem ? (unsigned int)((mp->memory_mb * ms + mem / 2) / mem) : 1;
        unsigned int size = pow2_at_least(mp->slices > share ? mp->slices : share);
        if (size > ms)
            size = ms;
        mp->place_size = size;
        mp->nplace = 0;
        for (unsigned int s = 0; s + size <= ms && s + mp->slices <= cs; s += size)
            mp->place[mp->nplace++] = s;
    }
}

unsigned int sim_ci_placements(unsigned int size, unsigned int gi_slices, unsigned int *starts)
{
    unsigned int n = 0, step = pow2_at_least(size ? size : 1);
    for (unsigned int s = 0; size && s + size <= gi_slices && n < SIM_MAX_CI; s += step)
        starts[n++] = s;
    return n;
}

sim_gi *sim_gi_by_id(sim_gpu *g, unsigned int id)
{
    for (int s = 0; s < SIM_MAX_MIG; s++)
        if (g->gis[s].live && g->gis[s].id == id)
            return &g->gis[s];
    return NULL;
}

unsigned int sim_ci_slices(const sim_gpu *g, const sim_mig *m)
{
    unsigned int gs = g->profiles[m->profile].slices;
    return m->ci_slices && m->ci_slices < gs ? m->ci_slices : gs;
}

/* The compute slices of compute instance profile `profile` in a GPU instance of `gs` slices, or 0
 * when the GPU instance does not offer it (1, 2, 3, 4 or 7 slices that fit; 3 only in a 3- or
 * 7-slice instance, 4 only in a 4- or 7-slice one, as an A100 or H100 lists them). */
unsigned int sim_ci_profile_slices(unsigned int profile, unsigned int gs)
{
    if (profile > 4)
        return 0;
    unsigned int slices = CI_PROFILE_SLICES[profile];
    if (slices > gs || (slices == 3 && gs != 3 && gs != 7) || (slices == 4 && gs != 4 && gs != 7))
        return 0;
    return slices;
}

/* The compute instance profile constant with `slices` compute slices. */
unsigned int sim_ci_profile_of(unsigned int slices)
{
    for (unsigned int p = 0; p < 5; p++)
        if (CI_PROFILE_SLICES[p] == slices)
            return p;
    return 0;
}

static unsigned int span(unsigned int start, unsigned int size)
{
    return size >= 32 ? ~0u : ((1u << size) - 1u) << start;
}

/*
 * Place n items of size[i] each at one of their candidate starts cand[i][0..ncand[i]) (tried in
 * order) without overlap, given the slices `used` already taken: depth-first, so the result is
 * the first fit in that order (the lowest starts, earlier items first) and a fit is found
 * whenever there is one. Returns 0 with out[i] set, or -1.
 */
static int place(int n, const unsigned int *size, unsigned int cand[][SIM_MAX_MEM_SLICES + 1],
                 const unsigned int *ncand, unsigned int used, unsigned int *out)
{
    if (n == 0)
        return 0;
    for (unsigned int k = 0; k < ncand[0]; k++) {
        unsigned int m = span(cand[0][k], size[0]);
        if (used & m)
            continue;
        out[0] = cand[0][k];
        if (place(n - 1, size + 1, cand + 1, ncand + 1, used | m, out + 1) == 0)
            return 0;
    }
    return -1;
}

/* Candidate starts of profile p, the preferred one (a start it had; -1: none) first. */
static unsigned int candidates(const sim_mig_profile *p, long prefer, unsigned int *cand)
{
    unsigned int n = 0;
    for (unsigned int k = 0; k < p->nplace; k++)
        if ((long)p->place[k] == prefer)
            cand[n++] = p->place[k];
    for (unsigned int k = 0; k < p->nplace; k++)
        if ((long)p->place[k] != prefer)
            cand[n++] = p->place[k];
    return n;
}

/* Place the compute instances of GPU instance `gi` (profile gp) among migs[0..n): set their
 * ci_start (keeping the one they have when it fits). 0, or -1 when they do not fit. */
static int place_cis(const sim_mig_profile *gp, unsigned int gi, sim_mig *migs, int n)
{
    unsigned int size[SIM_MAX_MIG] = {0}, cand[SIM_MAX_MIG][SIM_MAX_MEM_SLICES + 1];
    unsigned int ncand[SIM_MAX_MIG] = {0};
    unsigned int out[SIM_MAX_MIG];
    int idx[SIM_MAX_MIG], k = 0;
    for (int i = 0; i < n; i++) {
        if (migs[i].gi != gi)
            continue;
        unsigned int cs = migs[i].ci_slices && migs[i].ci_slices < gp->slices ? migs[i].ci_slices
                                                                               : gp->slices;
        unsigned int starts[SIM_MAX_CI], ns = sim_ci_placements(cs, gp->slices, starts), c = 0;
        for (unsigned int j = 0; j < ns; j++)
            if (starts[j] == migs[i].ci_start)
                cand[k][c++] = starts[j];
        for (unsigned int j = 0; j < ns; j++)
            if (starts[j] != migs[i].ci_start)
                cand[k][c++] = starts[j];
        size[k] = cs;
        ncand[k] = c;
        idx[k++] = i;
    }
    if (place(k, size, cand, ncand, 0, out) < 0)
        return -1;
    for (int j = 0; j < k; j++)
        migs[idx[j]].ci_start = out[j];
    return 0;
}

int sim_mig_place_all(sim_gpu *g, int gpu, sim_mig *migs, int n, int keep_empty)
{
    sim_gi next[SIM_MAX_MIG];
    int ngi = 0;
    memset(next, 0, sizeof next);
    /* the GPU instances: those of the MIG devices, in order, then the empty ones kept */
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int j = 0; j < ngi; j++)
            seen |= next[j].id == migs[i].gi;
        if (seen)
            continue;
        if (ngi >= SIM_MAX_MIG)
            return -1;
        next[ngi].id = migs[i].gi;
        next[ngi].profile = migs[i].profile;
        ngi++;
    }
    for (int s = 0; keep_empty && s < SIM_MAX_MIG; s++) {
        const sim_gi *old = &g->gis[s];
        int has = 0;
        for (int i = 0; old->live && i < n; i++)
            has |= migs[i].gi == old->id;
        if (!old->live || has)
            continue;
        if (ngi >= SIM_MAX_MIG)
            return -1;
        next[ngi].id = old->id;
        next[ngi].profile = old->profile;
        ngi++;
    }
    /* slots: a GPU instance that was there keeps its slot (and prefers its start) */
    int slot[SIM_MAX_MIG], taken[SIM_MAX_MIG] = {0};
    long prefer[SIM_MAX_MIG];
    for (int j = 0; j < ngi; j++) {
        slot[j] = -1;
        prefer[j] = -1;
        for (int s = 0; s < SIM_MAX_MIG; s++)
            if (g->gis[s].live && g->gis[s].id == next[j].id &&
                g->gis[s].profile == next[j].profile) {
                slot[j] = s;
                prefer[j] = g->gis[s].start;
                taken[s] = 1;
            }
    }
    for (int j = 0; j < ngi; j++)
        for (int s = 0; slot[j] < 0 && s < SIM_MAX_MIG; s++)
            if (!taken[s]) {
                slot[j] = s;
                taken[s] = 1;
            }
    unsigned int size[SIM_MAX_MIG] = {0}, cand[SIM_MAX_MIG][SIM_MAX_MEM_SLICES + 1];
    unsigned int ncand[SIM_MAX_MIG] = {0};
    unsigned int out[SIM_MAX_MIG];
    for (int j = 0; j < ngi; j++) {
        const sim_mig_profile *p = &g->profiles[next[j].profile];
        size[j] = p->place_size;
        ncand[j] = candidates(p, prefer[j], cand[j]);
    }
    if (place(ngi, size, cand, ncand, 0, out) < 0)
        return -1;
    sim_mig placed[SIM_MAX_MIG];
    memcpy(placed, migs, sizeof(sim_mig) * (size_t)n);
    for (int j = 0; j < ngi; j++)
        if (place_cis(&g->profiles[next[j].profile], next[j].id, placed, n) < 0)
            return -1;
    /* commit */
    memset(g->gis, 0, sizeof g->gis);
    for (int j = 0; j < ngi; j++) {
        sim_gi *t = &g->gis[slot[j]];
        t->live = 1;
        t->id = next[j].id;
        t->profile = next[j].profile;
        t->start = out[j];
    }
    for (int i = 0; i < n; i++)
        g->migs[i] = placed[i];
    g->nmig = n;
    sim_set_mig_handles(g, gpu);
    return 0;
}

/* ---- the state changes of `mig` records (control.c) ---- */

void sim_mig_uuid(sim_gpu *g, unsigned int gi, char *out, size_t len)
{
    unsigned long long h = 1469598103934665603ULL; /* FNV-1a of uuid, gi and the counter */
    char key[SIM_LEN_NAME + 32];
    snprintf(key, sizeof key, "%s/%u/%u", g->uuid, gi, g->mig_made++);
    for (const char *c = key; *c; c++)
        h = (h ^ (unsigned char)*c) * 1099511628211ULL;
    snprintf(out, len, "MIG-%08x-%04x-5%03x-8%03x-%012llx", (unsigned int)(h >> 32),
             (unsigned int)(h >> 16) & 0xffffu, (unsigned int)(h >> 4) & 0xfffu,
             (unsigned int)h & 0xfffu, (h * 31ULL) & 0xffffffffffffULL);
}

/* The memory slices GPU instances take now. */
static unsigned int used_memory(const sim_gpu *g)
{
    unsigned int used = 0;
    for (int s = 0; s < SIM_MAX_MIG; s++)
        if (g->gis[s].live)
            used |= span(g->gis[s].start, g->profiles[g->gis[s].profile].place_size);
    return used;
}

static int live_gis(const sim_gpu *g, int profile)
{
    int n = 0;
    for (int s = 0; s < SIM_MAX_MIG; s++)
        n += g->gis[s].live && (profile < 0 || g->gis[s].profile == profile);
    return n;
}

int sim_mig_gi_check(const sim_gpu *g, int p, long start)
{
    const sim_mig_profile *mp = &g->profiles[p];
    if (start >= 0) {
        int listed = 0;
        for (unsigned int k = 0; k < mp->nplace; k++)
            listed |= (long)mp->place[k] == start;
        if (!listed)
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    if ((unsigned int)live_gis(g, -1) >= g->mig_max || live_gis(g, -1) >= SIM_MAX_MIG ||
        (unsigned int)live_gis(g, p) >= mp->instance_count)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned int used = used_memory(g);
    for (unsigned int k = 0; k < mp->nplace; k++)
        if ((start < 0 || (long)mp->place[k] == start) && !(used & span(mp->place[k], mp->place_size)))
            return NVML_SUCCESS;
    return NVML_ERROR_INSUFFICIENT_RESOURCES;
}

int sim_mig_gi_create(sim_gpu *g, int gpu, int p, long start)
{
    if (!g->mig_mode || sim_mig_gi_check(g, p, start) != NVML_SUCCESS)
        return -1;
    const sim_mig_profile *mp = &g->profiles[p];
    unsigned int used = used_memory(g), at = 0;
    int found = 0;
    for (unsigned int k = 0; k < mp->nplace && !found; k++)
        if ((start < 0 || (long)mp->place[k] == start) && !(used & span(mp->place[k], mp->place_size))) {
            at = mp->place[k];
            found = 1;
        }
    unsigned int id = 1;
    while (id <= SIM_MAX_GI_ID && sim_gi_by_id(g, id))
        id++;
    int slot = -1;
    for (int s = 0; s < SIM_MAX_MIG && slot < 0; s++)
        if (!g->gis[s].live)
            slot = s;
    if (!found || id > SIM_MAX_GI_ID || slot < 0)
        return -1;
    sim_gi *t = &g->gis[slot];
    memset(t, 0, sizeof *t);
    t->live = 1;
    t->id = id;
    t->profile = p;
    t->start = at;
    sim_set_mig_handles(g, gpu);
    return slot;
}

int sim_mig_gi_destroy(sim_gpu *g, int gpu, unsigned int id)
{
    sim_gi *t = sim_gi_by_id(g, id);
    if (!t)
        return -1;
    for (int i = 0; i < g->nmig; i++)
        if (g->migs[i].gi == id)
            return -1; /* in use: it has compute instances */
    t->live = 0;
    sim_set_mig_handles(g, gpu);
    return 0;
}

/* The compute slices the compute instances of GPU instance `id` take now. */
static unsigned int used_compute(const sim_gpu *g, unsigned int id)
{
    unsigned int used = 0;
    for (int i = 0; i < g->nmig; i++)
        if (g->migs[i].gi == id)
            used |= span(g->migs[i].ci_start, sim_ci_slices(g, &g->migs[i]));
    return used;
}

int sim_mig_ci_check(const sim_gpu *g, const sim_gi *t, unsigned int profile, long start)
{
    const sim_mig_profile *gp = &g->profiles[t->profile];
    unsigned int cs = sim_ci_profile_slices(profile, gp->slices);
    if (!cs)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned int starts[SIM_MAX_CI], ns = sim_ci_placements(cs, gp->slices, starts);
    if (start >= 0) {
        int listed = 0;
        for (unsigned int k = 0; k < ns; k++)
            listed |= (long)starts[k] == start;
        if (!listed)
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    int cis = 0;
    for (int i = 0; i < g->nmig; i++)
        cis += g->migs[i].gi == t->id;
    if (g->nmig >= SIM_MAX_MIG || (unsigned int)g->nmig >= g->mig_max || cis >= SIM_MAX_CI)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned int used = used_compute(g, t->id);
    for (unsigned int k = 0; k < ns; k++)
        if ((start < 0 || (long)starts[k] == start) && !(used & span(starts[k], cs)))
            return NVML_SUCCESS;
    return NVML_ERROR_INSUFFICIENT_RESOURCES;
}

int sim_mig_ci_create(sim_gpu *g, int gpu, unsigned int gi, unsigned int profile, long start)
{
    sim_gi *t = sim_gi_by_id(g, gi);
    if (!t || sim_mig_ci_check(g, t, profile, start) != NVML_SUCCESS)
        return -1;
    const sim_mig_profile *gp = &g->profiles[t->profile];
    unsigned int cs = sim_ci_profile_slices(profile, gp->slices);
    unsigned int starts[SIM_MAX_CI], ns = sim_ci_placements(cs, gp->slices, starts);
    unsigned int used = used_compute(g, gi), at = 0, ci = 0;
    int found = 0;
    for (unsigned int k = 0; k < ns && !found; k++)
        if ((start < 0 || (long)starts[k] == start) && !(used & span(starts[k], cs))) {
            at = starts[k];
            found = 1;
        }
    for (int again = 1; again;) {
        again = 0;
        for (int i = 0; i < g->nmig; i++)
            if (g->migs[i].gi == gi && g->migs[i].ci == ci) {
                ci++;
                again = 1;
            }
    }
    if (!found || ci >= SIM_MAX_CI)
        return -1;
    sim_mig *m = &g->migs[g->nmig];
    memset(m, 0, sizeof *m);
    m->gi = gi;
    m->ci = ci;
    m->profile = t->profile;
    m->ci_slices = cs < gp->slices ? cs : 0;
    m->ci_start = at;
    sim_mig_uuid(g, gi, m->uuid, sizeof m->uuid);
    g->nmig++;
    sim_set_mig_handles(g, gpu);
    return g->nmig - 1;
}

int sim_mig_ci_destroy(sim_gpu *g, int gpu, unsigned int gi, unsigned int ci, int with_gi)
{
    for (int i = 0; i < g->nmig; i++) {
        if (g->migs[i].gi != gi || g->migs[i].ci != ci)
            continue;
        memmove(&g->migs[i], &g->migs[i + 1], sizeof(sim_mig) * (size_t)(g->nmig - i - 1));
        g->nmig--;
        int left = 0;
        for (int k = 0; k < g->nmig; k++)
            left |= g->migs[k].gi == gi;
        sim_gi *t = sim_gi_by_id(g, gi);
        if (with_gi && !left && t)
            t->live = 0;
        sim_set_mig_handles(g, gpu);
        return 0;
    }
    return -1;
}

/* ---- NVML calls ---- */

/* Enter for a MIG call on a full GPU: declare g; NOT_SUPPORTED unless MIG capable (and, with
 * need_mode, MIG enabled). Past it the lock is held. */
#define ENTER_MIG_GPU(device, out_ok, need_mode) \
    sim_gpu *g; \
    sim_mig *enter_m; \
    TRY_ENTER(sim_enter_device((device), (out_ok), &g, &enter_m)); \
    if (enter_m) \
        DONE(NVML_ERROR_NOT_SUPPORTED); \
    if (!g->mig_capable || ((need_mode) && !g->mig_mode)) \
        DONE(NVML_ERROR_NOT_SUPPORTED)

/* Enter for a call on a GPU instance handle: declare g and gi. */
#define ENTER_GI(handle, out_ok) \
    sim_gpu *g; \
    sim_gi *gi; \
    sim_mig *enter_m; \
    TRY_ENTER(sim_enter_instance((handle), SIM_MAGIC_GI, (out_ok), &g, &gi, &enter_m)); \
    (void)enter_m

/* The index of the profile whose NVML profile ID (nvmlGpuInstanceProfileInfo_t.id, what the
 * create, placement and capacity calls take) is `id`; -1 for none. */
static int profile_by_id(const sim_gpu *g, unsigned int id)
{
    for (int p = 0; p < g->nprofiles; p++)
        if (g->profiles[p].id == id)
            return p;
    return -1;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    nvmlDevice_t device, unsigned int profileId, nvmlGpuInstancePlacement_t *placements,
    unsigned int *count)
{
    ENTER_MIG_GPU(device, count != NULL, 0);
    int p = profile_by_id(g, profileId);
    if (p < 0)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    const sim_mig_profile *mp = &g->profiles[p];
    for (unsigned int k = 0; placements && k < mp->nplace; k++)
        placements[k] = (nvmlGpuInstancePlacement_t){mp->place[k], mp->place_size};
    *count = mp->nplace;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(
    nvmlDevice_t device, unsigned int profileId, nvmlGpuInstancePlacement_t *placements,
    unsigned int *count)
{
    return nvmlDeviceGetGpuInstancePossiblePlacements_v2(device, profileId, placements, count);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device,
                                                                  unsigned int profileId,
                                                                  unsigned int *count)
{
    ENTER_MIG_GPU(device, count != NULL, 1);
    int p = profile_by_id(g, profileId);
    if (p < 0)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    /* as many more as fit at once: the free placements taken lowest first (optimal for
     * placements of one size), within the profile's instance count and the GPU's maximum */
    const sim_mig_profile *mp = &g->profiles[p];
    unsigned int used = used_memory(g), n = 0;
    for (unsigned int k = 0; k < mp->nplace; k++) {
        unsigned int m = span(mp->place[k], mp->place_size);
        if (!(used & m)) {
            used |= m;
            n++;
        }
    }
    unsigned int left = mp->instance_count > (unsigned int)live_gis(g, p)
                            ? mp->instance_count - (unsigned int)live_gis(g, p) : 0;
    unsigned int room = g->mig_max > (unsigned int)live_gis(g, -1)
                            ? g->mig_max - (unsigned int)live_gis(g, -1) : 0;
    *count = n < left ? (n < room ? n : room) : (left < room ? left : room);
    DONE(NVML_SUCCESS);
}

/* Both GPU instance creates: `start` -1 for the lowest free placement. */
static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned int profileId, long start,
                              int placement_ok, nvmlGpuInstance_t *gpuInstance)
{
    ENTER_MIG_GPU(device, gpuInstance != NULL && placement_ok, 1);
    int p = profile_by_id(g, profileId);
    if (p < 0)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc = sim_mig_gi_check(g, p, start);
    if (rc)
        DONE(rc);
    char record[256];
    int len = snprintf(record, sizeof record, "mig gpu=%s gi_create=%s", g->uuid,
                       g->profiles[p].name);
    if (start >= 0)
        snprintf(record + len, sizeof record - (size_t)len, " placement=%ld", start);
    int slot = sim_control_commit(record);
    if (slot < 0)
        DONE(NVML_ERROR_INSUFFICIENT_RESOURCES); /* another process took the room first */
    *gpuInstance = &g->gis[slot].h;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                    nvmlGpuInstance_t *gpuInstance)
{
    return create_gi(device, profileId, -1, 1, gpuInstance);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(
    nvmlDevice_t device, unsigned int profileId, const nvmlGpuInstancePlacement_t *placement,
    nvmlGpuInstance_t *gpuInstance)
{
    long start = -1;
    int ok = placement != NULL;
    if (ok) {
        /* a placement of another size, or past the memory slices, is not one of the profile's:
         * sim_mig_gi_check answers INVALID_ARGUMENT for start SIM_MAX_MEM_SLICES */
        start = placement->start < SIM_MAX_MEM_SLICES ? (long)placement->start
                                                      : SIM_MAX_MEM_SLICES;
    }
    nvmlReturn_t rc = NVML_SUCCESS;
    if (ok) {
        /* the size must be the profile's: checked under the lock below */
        sim_gpu *g;
        sim_mig *m;
        rc = sim_enter_device(device, gpuInstance != NULL, &g, &m);
        if (rc)
            return rc;
        int p = m || !g->mig_capable || !g->mig_mode ? -1 : profile_by_id(g, profileId);
        if (p >= 0 && placement->size != g->profiles[p].place_size)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        sim_leave();
        if (rc)
            return rc;
    }
    return create_gi(device, profileId, start, ok, gpuInstance);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    ENTER_GI(gpuInstance, 1);
    for (int i = 0; i < g->nmig; i++)
        if (g->migs[i].gi == gi->id)
            DONE(NVML_ERROR_IN_USE); /* it has compute instances */
    char record[128];
    snprintf(record, sizeof record, "mig gpu=%s gi_destroy=%u", g->uuid, gi->id);
    DONE(sim_control_commit(record) < 0 ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                                  nvmlGpuInstance_t *gpuInstances,
                                                  unsigned int *count)
{
    ENTER_MIG_GPU(device, gpuInstances != NULL && count != NULL, 1);
    int p = profile_by_id(g, profileId);
    if (p < 0)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = 0;
    for (int s = 0; s < SIM_MAX_MIG; s++)
        if (g->gis[s].live && g->gis[s].profile == p)
            gpuInstances[n++] = &g->gis[s].h;
    *count = n;
    DONE(NVML_SUCCESS);
}

/* ---- compute instances ---- */

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId,
    nvmlComputeInstancePlacement_t *placements, unsigned int *count)
{
    ENTER_GI(gpuInstance, count != NULL);
    if (profileId >= SIM_NUM_CI_PROFILES)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int gs = g->profiles[gi->profile].slices, cs = sim_ci_profile_slices(profileId, gs);
    if (!cs)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    unsigned int starts[SIM_MAX_CI], n = sim_ci_placements(cs, gs, starts);
    for (unsigned int k = 0; placements && k < n; k++)
        placements[k] = (nvmlComputeInstancePlacement_t){starts[k], cs};
    *count = n;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId, unsigned int *count)
{
    ENTER_GI(gpuInstance, count != NULL);
    if (profileId >= SIM_NUM_CI_PROFILES)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int gs = g->profiles[gi->profile].slices, cs = sim_ci_profile_slices(profileId, gs);
    if (!cs)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    unsigned int starts[SIM_MAX_CI], ns = sim_ci_placements(cs, gs, starts);
    unsigned int used = used_compute(g, gi->id), n = 0;
    for (unsigned int k = 0; k < ns; k++)
        if (!(used & span(starts[k], cs))) {
            used |= span(starts[k], cs);
            n++;
        }
    unsigned int room = g->mig_max > (unsigned int)g->nmig ? g->mig_max - (unsigned int)g->nmig
                                                            : 0;
    *count = n < room ? n : room;
    DONE(NVML_SUCCESS);
}

/* Both compute instance creates: `start` -1 for the lowest free placement. */
static nvmlReturn_t create_ci(nvmlGpuInstance_t gpuInstance, unsigned int profileId, long start,
                              int placement_ok, nvmlComputeInstance_t *computeInstance)
{
    ENTER_GI(gpuInstance, computeInstance != NULL && placement_ok);
    if (profileId >= SIM_NUM_CI_PROFILES)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t rc = sim_mig_ci_check(g, gi, profileId, start);
    if (rc)
        DONE(rc);
    char record[256];
    int len = snprintf(record, sizeof record, "mig gpu=%s ci_create=%u ci_profile=%u", g->uuid,
                       gi->id, profileId);
    if (start >= 0)
        snprintf(record + len, sizeof record - (size_t)len, " placement=%ld", start);
    int index = sim_control_commit(record);
    if (index < 0)
        DONE(NVML_ERROR_INSUFFICIENT_RESOURCES);
    /* gi's slot holds while it lives, and nothing destroyed it: it had no record in between
     * that could (a GPU instance with a compute instance is only destroyed with its MIG
     * device's `destroy` or a layout, which another process may have written: look it up) */
    sim_gi *t = sim_gi_by_id(g, g->migs[index].gi);
    if (!t)
        DONE(NVML_ERROR_INSUFFICIENT_RESOURCES);
    *computeInstance = &t->ci_h[g->migs[index].ci];
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance,
                                                             unsigned int profileId,
                                                             nvmlComputeInstance_t *computeInstance)
{
    return create_ci(gpuInstance, profileId, -1, 1, computeInstance);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId,
    const nvmlComputeInstancePlacement_t *placement, nvmlComputeInstance_t *computeInstance)
{
    long start = -1;
    if (placement) {
        unsigned int gs = 0;
        sim_gpu *g;
        sim_gi *gi;
        sim_mig *m;
        nvmlReturn_t rc = sim_enter_instance(gpuInstance, SIM_MAGIC_GI, computeInstance != NULL,
                                             &g, &gi, &m);
        if (rc)
            return rc;
        gs = g->profiles[gi->profile].slices;
        if (profileId < SIM_NUM_CI_PROFILES && sim_ci_profile_slices(profileId, gs) &&
            placement->size != sim_ci_profile_slices(profileId, gs))
            rc = NVML_ERROR_INVALID_ARGUMENT;
        sim_leave();
        if (rc)
            return rc;
        start = placement->start < SIM_MAX_CI ? (long)placement->start : SIM_MAX_CI;
    }
    return create_ci(gpuInstance, profileId, start, placement != NULL, computeInstance);
}

SIM_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    sim_gpu *g;
    sim_gi *gi;
    sim_mig *m;
    TRY_ENTER(sim_enter_instance(computeInstance, SIM_MAGIC_CI, 1, &g, &gi, &m));
    char record[128];
    snprintf(record, sizeof record, "mig gpu=%s ci_destroy=%u ci=%u", g->uuid, gi->id, m->ci);
    DONE(sim_control_commit(record) < 0 ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance,
                                                           unsigned int profileId,
                                                           nvmlComputeInstance_t *computeInstances,
                                                           unsigned int *count)
{
    ENTER_GI(gpuInstance, computeInstances != NULL && count != NULL);
    if (profileId >= SIM_NUM_CI_PROFILES)
        DONE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = 0;
    for (int i = 0; i < g->nmig; i++)
        if (g->migs[i].gi == gi->id && g->migs[i].ci < SIM_MAX_CI &&
            sim_ci_profile_of(sim_ci_slices(g, &g->migs[i])) == profileId)
            computeInstances[n++] = &gi->ci_h[g->migs[i].ci];
    *count = n;
    DONE(NVML_SUCCESS);
}
