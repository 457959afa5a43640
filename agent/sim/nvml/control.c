/*
 * control.c: the fault-injection control channel, event sets and event waits.
 *
 * Owns: reading the record log `<GPU_AGENT_SIM_CONTROL>/control.log` (written by
 * `gpu-agent sim inject-xid|lose|restore|hang|ecc|mig|telemetry`, one record per line, each
 * appended with one O_APPEND write), deriving run-time state from it (lost and hung GPUs, ECC
 * counters, MIG layouts; telemetry records are handed to telemetry.c), queueing events
 * for the event sets that registered for them, and waking blocked waits through inotify on
 * the control directory plus poll(): an idle wait sleeps in the kernel. Must not write to the
 * control directory but for the `mig` records the NVML create/destroy calls commit
 * (sim_control_commit), and must not hold the global lock while blocking.
 *
 * Records (docs/simulator.md): `OP KEY=VALUE ...` with OP one of
 *   xid gpu=<index|GPU-uuid|MIG-uuid|none> xid=<n> [gi=<n>] [ci=<n>]
 *   ecc gpu=<...> type=sbe|dbe
 *   lose gpu=<...>
 *   restore gpu=<...>
 *   hang gpu=<index|GPU-uuid> until_ns=<CLOCK_MONOTONIC ns>   (0: the hang ends now)
 *   mig gpu=<index|GPU-uuid> mode=enabled|disabled
 *   mig gpu=<index|GPU-uuid> layout=<profile>:<count>[,<profile>:<count>...]
 *   mig gpu=<index|GPU-uuid> create=<profile> [placement=<start>]   (a GPU instance + its CI)
 *   mig gpu=<MIG-uuid> destroy=1                                     (the CI, and its GI if last)
 *   mig gpu=<...> gi_create=<profile> [placement=<start>] [token=<t>]
 *   mig gpu=<...> gi_destroy=<gi id> [token=<t>]
 *   mig gpu=<...> ci_create=<gi id> ci_profile=<NVML CI profile> [placement=<start>] [token=<t>]
 *   mig gpu=<...> ci_destroy=<gi id> ci=<ci id> [token=<t>]
 *   telemetry gpu=<index|GPU-uuid> KEY=VALUE...   (keys: telemetry.c)
 * At the 0->1 nvmlInit the whole log is replayed for state only (lost, ECC counts, MIG
 * layouts, telemetry); events are queued only for records appended after that init.
 *
 * Ordering: every NVML call ingests the log to its end under the global lock before it
 * answers (sim_enter), so a record whose O_APPEND write has returned is seen by the next call
 * of any process that loaded the library.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sim.h"

#define SIM_MAX_SETS 1024
#define LOG_NAME "control.log"
#define QUEUE_LIMIT (1u << 20)

enum { Q_EVENT = 0, Q_LOST = 1 };

typedef struct {
    int kind;
    int gpu; /* -1: an event that names no GPU */
    unsigned long long type, data;
    unsigned int gi, ci;
} qevent;

struct sim_eventset {
    uint32_t magic;
    int in_use;
    int efd;      /* eventfd that wakes this set's waiters when something is queued */
    int waiters;  /* threads blocked in nvmlEventSetWait on this set */
    int freeing;  /* nvmlEventSetFree came while waiters were blocked */
    unsigned long long reg[SIM_MAX_GPUS];
    qevent *q;
    size_t head, len, cap;
    int overflow_warned;
};

static struct sim_eventset g_sets[SIM_MAX_SETS];
static char g_dir[PATH_MAX];
static int g_ctl_on;
static int g_ifd = -1;     /* inotify on the control directory */
static int g_log_fd = -1;  /* control.log, once it exists */
static off_t g_log_off;
static int g_waiters;      /* all threads blocked in a wait, for fd lifetime */

/* ---- record log ---- */

static int resolve_gpu(const char *spec, int *gpu, int *mig)
{
    *mig = -1;
    if (strcmp(spec, "none") == 0) {
        *gpu = -1;
        return 0;
    }
    if (*spec >= '0' && *spec <= '9') {
        char *end;
        long x = strtol(spec, &end, 10);
        if (*end || x >= g_node.ngpus)
            return -1;
        *gpu = (int)x;
        return 0;
    }
    for (int i = 0; i < g_node.ngpus; i++) {
        if (strcmp(g_node.gpus[i].uuid, spec) == 0) {
            *gpu = i;
            return 0;
        }
        for (int m = 0; m < g_node.gpus[i].nmig; m++)
            if (strcmp(g_node.gpus[i].migs[m].uuid, spec) == 0) {
                *gpu = i;
                *mig = m;
                return 0;
            }
    }
    return -1;
}

/* Wake the threads blocked in a wait on `s`. */
static void wake(struct sim_eventset *s)
{
    if (s->efd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(s->efd, &one, sizeof one);
        (void)w;
    }
}

static void push(struct sim_eventset *s, const qevent *e)
{
    if (s->len == s->cap) {
        if (s->cap >= QUEUE_LIMIT) {
            if (!s->overflow_warned)
                fprintf(stderr, "gpu-agent simulated NVML: event set queue full (%u events); "
                        "dropping new events\n", QUEUE_LIMIT);
            s->overflow_warned = 1;
            return;
        }
        size_t ncap = s->cap ? s->cap * 2 : 64;
        qevent *nq = malloc(ncap * sizeof *nq);
        if (!nq)
            return;
        for (size_t k = 0; k < s->len; k++)
            nq[k] = s->q[(s->head + k) % s->cap];
        free(s->q);
        s->q = nq;
        s->cap = ncap;
        s->head = 0;
    }
    s->q[(s->head + s->len) % s->cap] = *e;
    s->len++;
    if (s->waiters > 0)
        wake(s);
}

/* Queue `e` on every live set that registered its GPU for `need` (all sets for gpu -1). */
static void deliver(const qevent *e, unsigned long long need)
{
    for (int k = 0; k < SIM_MAX_SETS; k++) {
        struct sim_eventset *s = &g_sets[k];
        if (!s->in_use || s->freeing)
            continue;
        if (e->gpu >= 0 && !(s->reg[e->gpu] & need))
            continue;
        push(s, e);
    }
}

static const char *field(char *const *keys, char *const *vals, int n, const char *key)
{
    for (int i = 0; i < n; i++)
        if (strcmp(keys[i], key) == 0)
            return vals[i];
    return NULL;
}

int sim_parse_u64(const char *s, unsigned long long *out)
{
    if (!s || !*s || *s == '-')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

/* ---- run-time MIG layouts ---- */

static int profile_by_name(const sim_gpu *g, const char *name, size_t len)
{
    for (int p = 0; p < g->nprofiles; p++)
        if (strlen(g->profiles[p].name) == len && strncmp(g->profiles[p].name, name, len) == 0)
            return p;
    return -1;
}

/* `layout`: "<profile>:<count>,...". Instances of a profile already there are kept (their
 * UUIDs, IDs and, where they fit, placements too), in their order; the rest are made. A layout
 * that does not fit the GPU (unknown profile, more devices than it has, or instances that do
 * not fit its placements) changes nothing. */
static void apply_layout(sim_gpu *g, int gpu, const char *layout)
{
    sim_mig next[SIM_MAX_MIG];
    int n = 0, taken[SIM_MAX_MIG] = {0};
    const char *s = layout;
    while (*s) {
        const char *colon = strchr(s, ':');
        if (!colon)
            return;
        int p = profile_by_name(g, s, (size_t)(colon - s));
        char *end;
        long count = strtol(colon + 1, &end, 10);
        if (p < 0 || count < 0 || (*end && *end != ','))
            return;
        for (long k = 0; k < count; k++) {
            if (n >= SIM_MAX_MIG || (unsigned int)n >= g->mig_max)
                return;
            int reuse = -1;
            for (int i = 0; i < g->nmig && reuse < 0; i++)
                if (!taken[i] && g->migs[i].profile == p)
                    reuse = i;
            if (reuse >= 0) {
                taken[reuse] = 1;
                next[n++] = g->migs[reuse];
            } else {
                next[n] = (sim_mig){0};
                n++;
            }
            next[n - 1].profile = p;
        }
        s = *end ? end + 1 : end;
    }
    /* new instances get their IDs (the lowest GI ID free) once the kept ones are known */
    sim_mig built[SIM_MAX_MIG];
    int nb = 0;
    unsigned int made = g->mig_made;
    for (int i = 0; i < n; i++)
        if (next[i].uuid[0])
            built[nb++] = next[i];
    for (int i = 0; i < n; i++) {
        if (next[i].uuid[0])
            continue;
        unsigned int gi = 1;
        for (int again = 1; again;) {
            again = 0;
            for (int k = 0; k < nb; k++)
                if (built[k].gi == gi) {
                    gi++;
                    again = 1;
                }
        }
        sim_mig *m = &built[nb++];
        memset(m, 0, sizeof *m);
        m->gi = gi;
        m->profile = next[i].profile;
        sim_mig_uuid(g, gi, m->uuid, sizeof m->uuid);
    }
    if (sim_mig_place_all(g, gpu, built, nb, 0) < 0) {
        g->mig_made = made; /* nothing made: the UUID counter too */
        return;
    }
    g->mig_mode = g->mig_pending = 1;
}

/* A record's optional `placement=S`: 0 with *start set (-1 when absent), -1 when malformed. */
static int placement_field(char *const *keys, char *const *vals, int n, long *start)
{
    unsigned long long v;
    const char *text = field(keys, vals, n, "placement");
    *start = -1;
    if (!text)
        return 0;
    if (sim_parse_u64(text, &v) < 0 || v >= SIM_MAX_MEM_SLICES)
        return -1;
    *start = (long)v;
    return 0;
}

/* Apply a `mig` record to GPU g (mig: the MIG device it names, or -1). Returns what it made
 * (a GPU instance slot for gi_create, a MIG device index for create and ci_create, 0 for the
 * destroys and the rest), or -1 when it changed nothing. */
static int apply_mig(sim_gpu *g, int gpu, int mig, char *const *keys, char *const *vals, int n)
{
    const char *mode = field(keys, vals, n, "mode");
    const char *layout = field(keys, vals, n, "layout");
    const char *create = field(keys, vals, n, "create");
    const char *gi_create = field(keys, vals, n, "gi_create");
    const char *gi_destroy = field(keys, vals, n, "gi_destroy");
    const char *ci_create = field(keys, vals, n, "ci_create");
    const char *ci_destroy = field(keys, vals, n, "ci_destroy");
    unsigned long long gi, ci;
    long start;
    if (!g->mig_capable || placement_field(keys, vals, n, &start) < 0)
        return -1;
    if (mig >= 0 && field(keys, vals, n, "destroy"))
        return sim_mig_ci_destroy(g, gpu, g->migs[mig].gi, g->migs[mig].ci, 1);
    if (mig >= 0)
        return -1;
    if (mode && strcmp(mode, "disabled") == 0) {
        g->mig_mode = g->mig_pending = 0;
        memset(g->gis, 0, sizeof g->gis);
        g->nmig = 0;
        sim_set_mig_handles(g, gpu);
        return 0;
    }
    if (mode && strcmp(mode, "enabled") == 0) {
        g->mig_mode = g->mig_pending = 1;
        return 0;
    }
    if (layout) {
        apply_layout(g, gpu, layout);
        return 0;
    }
    if (!g->mig_mode)
        return -1;
    if (create || gi_create) {
        const char *name = create ? create : gi_create;
        int p = profile_by_name(g, name, strlen(name));
        if (p < 0)
            return -1;
        /* `create`: a GPU instance with one compute instance of all its slices (a MIG device) */
        if (create && ((unsigned int)g->nmig >= g->mig_max || g->nmig >= SIM_MAX_MIG))
            return -1;
        int slot = sim_mig_gi_create(g, gpu, p, start);
        if (slot < 0 || !create)
            return slot;
        return sim_mig_ci_create(g, gpu, g->gis[slot].id,
                                 sim_ci_profile_of(g->profiles[p].slices), -1);
    }
    if (gi_destroy)
        return sim_parse_u64(gi_destroy, &gi) < 0 ? -1
                                                  : sim_mig_gi_destroy(g, gpu, (unsigned int)gi);
    if (ci_create) {
        unsigned long long profile;
        if (sim_parse_u64(ci_create, &gi) < 0 ||
            sim_parse_u64(field(keys, vals, n, "ci_profile"), &profile) < 0 ||
            profile >= SIM_NUM_CI_PROFILES)
            return -1;
        return sim_mig_ci_create(g, gpu, (unsigned int)gi, (unsigned int)profile, start);
    }
    if (ci_destroy) {
        if (sim_parse_u64(ci_destroy, &gi) < 0 || sim_parse_u64(field(keys, vals, n, "ci"), &ci) < 0)
            return -1;
        return sim_mig_ci_destroy(g, gpu, (unsigned int)gi, (unsigned int)ci, 0);
    }
    return -1;
}

/* The token of the record this process is committing (sim_control_commit), and what applying it
 * made. */
static char g_token[64];
static int g_token_seen, g_token_result;

#define MAX_FIELDS 32 /* KEY=VALUE fields a record may have; later ones are dropped */

static void apply_record(char *line, int replay)
{
    char *keys[MAX_FIELDS], *vals[MAX_FIELDS];
    int n = 0;
    char *save = NULL;
    char *op = strtok_r(line, " \t", &save);
    if (!op)
        return;
    for (char *tok = strtok_r(NULL, " \t", &save); tok && n < MAX_FIELDS;
         tok = strtok_r(NULL, " \t", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq)
            continue;
        *eq = '\0';
        keys[n] = tok;
        vals[n] = eq + 1;
        n++;
    }
    const char *spec = field(keys, vals, n, "gpu");
    int gpu, mig;
    if (!spec || resolve_gpu(spec, &gpu, &mig) < 0)
        return; /* a GPU this profile does not have: not for us */
    if (gpu < 0 && strcmp(op, "xid") != 0)
        return;
    sim_gpu *g = gpu >= 0 ? &g_node.gpus[gpu] : NULL;

    if (strcmp(op, "xid") == 0) {
        unsigned long long xid, gi = 0xFFFFFFFFu, ci = 0xFFFFFFFFu;
        if (sim_parse_u64(field(keys, vals, n, "xid"), &xid) < 0)
            return;
        if (mig >= 0) {
            gi = g->migs[mig].gi;
            ci = g->migs[mig].ci;
        }
        if (field(keys, vals, n, "gi") && sim_parse_u64(field(keys, vals, n, "gi"), &gi) < 0)
            return;
        if (field(keys, vals, n, "ci") && sim_parse_u64(field(keys, vals, n, "ci"), &ci) < 0)
            return;
        if (replay || (g && g->lost))
            return;
        qevent e = {Q_EVENT, gpu, SIM_EVENT_XID, xid, (unsigned int)gi, (unsigned int)ci};
        deliver(&e, SIM_EVENT_XID);
    } else if (strcmp(op, "ecc") == 0) {
        const char *type = field(keys, vals, n, "type");
        unsigned long long bit;
        if (type && strcmp(type, "dbe") == 0) {
            bit = SIM_EVENT_DBE;
            g->ecc_dbe++;
        } else if (type && strcmp(type, "sbe") == 0) {
            bit = SIM_EVENT_SBE;
            g->ecc_sbe++;
        } else {
            return;
        }
        if (replay || g->lost)
            return;
        qevent e = {Q_EVENT, gpu, bit, 0, 0xFFFFFFFFu, 0xFFFFFFFFu};
        if (mig >= 0) {
            e.gi = g->migs[mig].gi;
            e.ci = g->migs[mig].ci;
        }
        deliver(&e, bit);
    } else if (strcmp(op, "lose") == 0) {
        if (g->lost)
            return;
        g->lost = 1;
        if (replay)
            return;
        qevent e = {Q_LOST, gpu, 0, 0, 0xFFFFFFFFu, 0xFFFFFFFFu};
        deliver(&e, ~0ULL);
    } else if (strcmp(op, "restore") == 0) {
        g->lost = 0;
    } else if (strcmp(op, "hang") == 0 && mig < 0) {
        unsigned long long until;
        if (sim_parse_u64(field(keys, vals, n, "until_ns"), &until) == 0)
            g->hang_until_ns = until;
    } else if (strcmp(op, "mig") == 0) {
        int made = apply_mig(g, gpu, mig, keys, vals, n);
        const char *token = field(keys, vals, n, "token");
        if (g_token[0] && token && strcmp(token, g_token) == 0) {
            g_token_seen = 1;
            g_token_result = made;
        }
    } else if (strcmp(op, "telemetry") == 0 && mig < 0) {
        sim_telemetry_apply(g, keys, vals, n);
    }
}

static void ingest(int replay)
{
    if (!g_ctl_on)
        return;
    if (g_log_fd < 0) {
        char path[PATH_MAX + 16];
        snprintf(path, sizeof path, "%s/" LOG_NAME, g_dir);
        g_log_fd = open(path, O_RDONLY | O_CLOEXEC);
        if (g_log_fd < 0)
            return;
        g_log_off = 0;
    }
    static char buf[65536 + 1];
    for (;;) {
        ssize_t got = pread(g_log_fd, buf, sizeof buf - 1, g_log_off);
        if (got <= 0)
            return;
        buf[got] = '\0';
        char *last_nl = memrchr(buf, '\n', (size_t)got);
        if (!last_nl) {
            if (got == (ssize_t)sizeof buf - 1)
                g_log_off += got; /* an absurdly long line: skip it */
            return;            /* an incomplete record: wait for the rest */
        }
        size_t used = (size_t)(last_nl - buf) + 1;
        char *s = buf;
        while (s < buf + used) {
            char *nl = memchr(s, '\n', (size_t)(buf + used - s));
            *nl = '\0';
            apply_record(s, replay);
            s = nl + 1;
        }
        g_log_off += (off_t)used;
    }
}

void sim_control_ingest(void) { ingest(0); }

int sim_control_commit(const char *record)
{
    static unsigned int counter;
    char line[512];
    snprintf(g_token, sizeof g_token, "%ld-%u", (long)getpid(), ++counter);
    int len = snprintf(line, sizeof line, "%s token=%s\n", record, g_token);
    g_token_seen = 0;
    g_token_result = -1;
    if (len <= 0 || (size_t)len >= sizeof line) {
        g_token[0] = '\0';
        return -1;
    }
    if (!g_ctl_on) {
        line[len - 1] = '\0';
        apply_record(line, 0);
    } else {
        char path[PATH_MAX + 16];
        snprintf(path, sizeof path, "%s/" LOG_NAME, g_dir);
        int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) {
            g_token[0] = '\0';
            return -1;
        }
        ssize_t w = write(fd, line, (size_t)len); /* one O_APPEND write: one whole record */
        close(fd);
        if (w == len)
            ingest(0);
    }
    g_token[0] = '\0';
    return g_token_seen ? g_token_result : -1;
}

int sim_control_start(char *err, size_t errlen)
{
    const char *dir = getenv("GPU_AGENT_SIM_CONTROL");
    if (g_log_fd >= 0) {
        close(g_log_fd);
        g_log_fd = -1;
    }
    g_log_off = 0;
    if (!dir || !*dir) {
        g_ctl_on = 0;
        return 0;
    }
    if (strlen(dir) >= sizeof g_dir - 1) {
        snprintf(err, errlen, "GPU_AGENT_SIM_CONTROL path is too long");
        return -1;
    }
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno != ENOENT || mkdir(dir, 0755) != 0) {
            snprintf(err, errlen, "GPU_AGENT_SIM_CONTROL=%s: cannot use or create it: %s", dir,
                     strerror(errno));
            return -1;
        }
    } else if (!S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "GPU_AGENT_SIM_CONTROL=%s is not a directory", dir);
        return -1;
    }
    if (g_ifd >= 0 && strcmp(g_dir, dir) != 0 && g_waiters == 0) {
        close(g_ifd);
        g_ifd = -1;
    }
    if (g_ifd < 0) {
        g_ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
        if (g_ifd < 0
            || inotify_add_watch(g_ifd, dir, IN_MODIFY | IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE)
                   < 0) {
            snprintf(err, errlen, "GPU_AGENT_SIM_CONTROL=%s: inotify: %s", dir, strerror(errno));
            if (g_ifd >= 0)
                close(g_ifd);
            g_ifd = -1;
            return -1;
        }
    }
    snprintf(g_dir, sizeof g_dir, "%s", dir);
    g_ctl_on = 1;
    ingest(1);
    return 0;
}

static void release_set(struct sim_eventset *s)
{
    if (s->efd >= 0)
        close(s->efd);
    free(s->q);
    memset(s, 0, sizeof *s);
    s->efd = -1;
}

/* Free `s` now, or, while threads wait on it, mark it and wake them: the last one out frees it. */
static void retire_set(struct sim_eventset *s)
{
    if (s->waiters > 0) {
        s->freeing = 1;
        wake(s);
    } else {
        release_set(s);
    }
}

void sim_control_stop(void)
{
    for (int k = 0; k < SIM_MAX_SETS; k++) {
        if (g_sets[k].in_use)
            retire_set(&g_sets[k]);
    }
    if (g_log_fd >= 0) {
        close(g_log_fd);
        g_log_fd = -1;
    }
    g_ctl_on = 0;
}

/* ---- event sets ---- */

static struct sim_eventset *lookup_set(nvmlEventSet_t set)
{
    uintptr_t p = (uintptr_t)set, base = (uintptr_t)g_sets;
    if (!set || p < base || p >= base + sizeof g_sets || (p - base) % sizeof *g_sets)
        return NULL;
    if (!set->in_use || set->freeing || set->magic != SIM_MAGIC_SET)
        return NULL;
    return set;
}

/* sim_enter, then `set` must be a live event set: on success the lock is held and *s is it. */
static nvmlReturn_t enter_set(nvmlEventSet_t set, int out_ok, struct sim_eventset **s)
{
    nvmlReturn_t rc = sim_enter(out_ok);
    if (rc)
        return rc;
    *s = lookup_set(set);
    if (*s)
        return NVML_SUCCESS;
    sim_leave();
    return NVML_ERROR_INVALID_ARGUMENT;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t rc = sim_enter(set != NULL);
    if (rc)
        return rc;
    for (int k = 0; k < SIM_MAX_SETS; k++) {
        struct sim_eventset *s = &g_sets[k];
        if (s->in_use)
            continue;
        memset(s, 0, sizeof *s);
        s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (s->efd < 0) {
            sim_leave();
            return NVML_ERROR_OPERATING_SYSTEM;
        }
        s->magic = SIM_MAGIC_SET;
        s->in_use = 1;
        *set = s;
        sim_leave();
        return NVML_SUCCESS;
    }
    sim_leave();
    return NVML_ERROR_MEMORY;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    struct sim_eventset *s;
    nvmlReturn_t rc = enter_set(set, 1, &s);
    if (rc)
        return rc;
    retire_set(s);
    sim_leave();
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device,
                                                 unsigned long long eventTypes,
                                                 nvmlEventSet_t set)
{
    sim_gpu *g;
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, 1, &g, &m);
    if (rc)
        return rc;
    struct sim_eventset *s = lookup_set(set);
    if (!s)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (m || g->events_unsupported || (eventTypes & ~g->supported_events))
        rc = NVML_ERROR_NOT_SUPPORTED;
    else
        s->reg[g->h.gpu] |= eventTypes;
    sim_leave();
    return rc;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void drain(int fd)
{
    char buf[4096];
    while (fd >= 0 && read(fd, buf, sizeof buf) > 0) {
    }
}

/* Shared by the v1 and v2 waits; `full` says whether data has the GI/CI fields. */
static nvmlReturn_t wait_common(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms,
                                int full)
{
    struct sim_eventset *s;
    nvmlReturn_t rc = enter_set(set, data != NULL, &s);
    if (rc)
        return rc;
    s->waiters++;
    g_waiters++;
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        if (s->freeing) {
            rc = NVML_ERROR_UNINITIALIZED;
            break;
        }
        ingest(0);
        if (s->len) {
            qevent e = s->q[s->head];
            s->head = (s->head + 1) % s->cap;
            s->len--;
            data->device = e.gpu >= 0 ? &g_node.gpus[e.gpu].h : NULL;
            data->eventType = e.type;
            data->eventData = e.data;
            if (full) {
                data->gpuInstanceId = e.gi;
                data->computeInstanceId = e.ci;
            }
            rc = e.kind == Q_LOST ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
            break;
        }
        long long left = deadline - now_ms();
        if (left <= 0) {
            rc = NVML_ERROR_TIMEOUT;
            break;
        }
        struct pollfd fds[2] = {{s->efd, POLLIN, 0}, {g_ctl_on ? g_ifd : -1, POLLIN, 0}};
        sim_leave();
        poll(fds, 2, left > INT_MAX ? INT_MAX : (int)left);
        pthread_mutex_lock(&g_sim_lock);
        /* Whoever drains inotify ingests right after (loop top), under the same lock. */
        if (fds[1].revents & POLLIN)
            drain(g_ifd);
        if (fds[0].revents & POLLIN)
            drain(s->efd);
    }
    s->waiters--;
    g_waiters--;
    if (s->freeing && s->waiters == 0)
        release_set(s);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                            unsigned int timeoutms)
{
    return wait_common(set, data, timeoutms, 1);
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data,
                                         unsigned int timeoutms)
{
    return wait_common(set, data, timeoutms, 0);
}
