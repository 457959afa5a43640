/*
 * profile.c: which profile to load, and the profile schema (YAML tree -> sim_node).
 *
 * Owns: resolving GPU_AGENT_SIM_PROFILE (a name under <library dir>/../profiles/ or a path),
 * validating every key of the profile schema (docs/simulator.md; agent/sim/profile.py checks
 * the same rules with PyYAML), and parsing the start-up faults (profile `faults:` and
 * GPU_AGENT_SIM_FAULTS). Must not touch run-time state (control.c) or answer NVML calls.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "sim.h"

#define DEFAULT_PROFILE "dgx1-v100"

typedef struct {
    const char *file;
    char *err;
    size_t errlen;
    int failed;
} vctx;

static void vfail(vctx *v, const char *path, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sim_vfail(v->err, v->errlen, &v->failed, fmt, ap, "%s: %s", v->file, path);
    va_end(ap);
}

/* snprintf for key paths; truncating a long path in a message is fine. */
static void pathf(char *out, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, len, fmt, ap);
    va_end(ap);
}

static void join(char *out, size_t len, const char *base, const char *key)
{
    if (!base || !*base)
        pathf(out, len, "%s", key);
    else if (key[0] == '[')
        pathf(out, len, "%s%s", base, key);
    else
        pathf(out, len, "%s.%s", base, key);
}

/* Every key of `map` must be in the NULL-terminated `allowed` list. */
static int check_keys(vctx *v, const ynode *map, const char *path, const char *const *allowed)
{
    for (int i = 0; i < map->n; i++) {
        int ok = 0;
        for (const char *const *a = allowed; *a; a++)
            if (strcmp(*a, map->keys[i]) == 0)
                ok = 1;
        if (!ok) {
            char p[256];
            join(p, sizeof p, path, map->keys[i]);
            vfail(v, p, "unknown key");
            return -1;
        }
    }
    return 0;
}

/* `n` (at `path`) must be of type `type`, and a mapping's keys all in `allowed` (NULL: any). */
static int check_node(vctx *v, const ynode *n, const char *path, ytype type,
                      const char *const *allowed)
{
    if (n->type != type) {
        vfail(v, path, "expected %s, found %s", yaml_type_name(type), yaml_type_name(n->type));
        return -1;
    }
    return allowed ? check_keys(v, n, path, allowed) : 0;
}

/* Item `i` of `seq`, the sequence at `path`, as a mapping whose keys are all in `allowed`; its
 * own path goes to item_path. NULL when it is not one. */
static const ynode *map_item(vctx *v, const ynode *seq, const char *path, int i,
                             const char *const *allowed, char *item_path, size_t len)
{
    pathf(item_path, len, "%s[%d]", path, i);
    return check_node(v, seq->items[i], item_path, Y_MAP, allowed) < 0 ? NULL : seq->items[i];
}

static const ynode *need(vctx *v, const ynode *map, const char *path, const char *key,
                         ytype type, int required)
{
    char p[256];
    join(p, sizeof p, path, key);
    const ynode *n = yaml_get(map, key);
    if (!n) {
        if (required)
            vfail(v, p, "missing (required)");
        return NULL;
    }
    return check_node(v, n, p, type, NULL) < 0 ? NULL : n;
}

/* need() for a sequence of at most `max` entries (`what` names them in the message). */
static const ynode *need_seq(vctx *v, const ynode *map, const char *path, const char *key,
                             int required, int max, const char *what)
{
    const ynode *n = need(v, map, path, key, Y_SEQ, required);
    if (n && n->n > max) {
        char p[256];
        join(p, sizeof p, path, key);
        vfail(v, p, "more than %d %s", max, what);
        return NULL;
    }
    return n;
}

static int get_str(vctx *v, const ynode *map, const char *path, const char *key, char *out,
                   size_t cap, int required)
{
    const ynode *n = need(v, map, path, key, Y_STR, required);
    if (!n)
        return v->failed ? -1 : 0;
    if (strlen(n->str) >= cap) {
        char p[256];
        join(p, sizeof p, path, key);
        vfail(v, p, "longer than %zu characters", cap - 1);
        return -1;
    }
    if (out)
        memcpy(out, n->str, strlen(n->str) + 1);
    return 1;
}

static int int_value(vctx *v, const ynode *n, const char *p, long long lo, long long hi,
                     long long *out)
{
    long long x;
    if (n->type != Y_INT) {
        vfail(v, p, "expected an integer, found %s", yaml_type_name(n->type));
        return -1;
    }
    if (yaml_int(n, &x) < 0 || x < lo || x > hi) {
        vfail(v, p, "must be an integer from %lld to %lld", lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int get_int(vctx *v, const ynode *map, const char *path, const char *key, long long lo,
                   long long hi, long long *out, int required)
{
    char p[256];
    join(p, sizeof p, path, key);
    const ynode *n = yaml_get(map, key);
    if (!n) {
        if (required) {
            vfail(v, p, "missing (required)");
            return -1;
        }
        return 0;
    }
    return int_value(v, n, p, lo, hi, out) < 0 ? -1 : 1;
}

#define U32MAX 4294967295LL

/* get_int for a required field from 0 to `hi` that goes into an unsigned int. */
static int get_uint(vctx *v, const ynode *map, const char *path, const char *key, long long hi,
                    unsigned int *out)
{
    long long x;
    if (get_int(v, map, path, key, 0, hi, &x, 1) < 0)
        return -1;
    *out = (unsigned int)x;
    return 0;
}
#define I64MAX 9223372036854775807LL

int sim_parse_bus_id(const char *text, sim_pci *pci)
{
    /* DOMAIN:BUS:DEVICE.FUNCTION (hex); domain may be 4 or 8 digits, or absent. */
    unsigned int d = 0, b, dev, fn;
    char tail;
    if (sscanf(text, "%x:%x:%x.%x%c", &d, &b, &dev, &fn, &tail) == 4) {
    } else if (sscanf(text, "%x:%x.%x%c", &b, &dev, &fn, &tail) == 3) {
        d = 0;
    } else {
        return -1;
    }
    for (const char *s = text; *s; s++)
        if (!strchr("0123456789abcdefABCDEF:.", *s))
            return -1;
    if (b > 0xFF || dev > 0x1F || fn > 7)
        return -1;
    pci->domain = d;
    pci->bus = b;
    pci->device = dev;
    pci->function = fn;
    return 0;
}

void sim_format_bus_id(const sim_pci *pci, char *out, size_t len, int legacy)
{
    if (legacy)
        snprintf(out, len, "%04X:%02X:%02X.%X", pci->domain & 0xFFFF, pci->bus, pci->device,
                 pci->function);
    else
        snprintf(out, len, "%08X:%02X:%02X.%X", pci->domain, pci->bus, pci->device,
                 pci->function);
}

/* Set in `mask` (an array of 64-bit words) the bit of each number in `text`: numbers joined by
 * `sep`, and A-B ranges where `ranges`; an empty text sets none. Returns 0; -1 when the text is
 * not such a list; -2 for a range that is empty or reaches `limit`, then range[] says which. */
static int parse_number_list(const char *text, char sep, int ranges, unsigned long limit,
                             uint64_t *mask, unsigned long range[2])
{
    const char *s = text;
    if (!*s)
        return 0;
    for (;;) {
        char *end;
        if (*s < '0' || *s > '9')
            return -1;
        unsigned long a = strtoul(s, &end, 10), b = a;
        s = end;
        if (ranges && *s == '-') {
            s++;
            if (*s < '0' || *s > '9')
                return -1;
            b = strtoul(s, &end, 10);
            s = end;
        }
        range[0] = a;
        range[1] = b;
        if (a > b || b >= limit)
            return -2;
        for (unsigned long c = a; c <= b; c++)
            mask[c / 64] |= 1ULL << (c % 64);
        if (*s == '\0')
            return 0;
        if (*s != sep)
            return -1;
        s++;
    }
}

int sim_parse_cpulist(const char *text, uint64_t *mask, char *err, size_t errlen)
{
    unsigned long range[2];
    memset(mask, 0, SIM_CPU_WORDS * sizeof *mask);
    int rc = parse_number_list(text, ',', 1, SIM_MAX_CPUS, mask, range);
    if (rc == -2)
        snprintf(err, errlen, "CPU range %lu-%lu is empty or beyond CPU %d", range[0], range[1],
                 SIM_MAX_CPUS - 1);
    else if (rc < 0)
        snprintf(err, errlen, "not a CPU list like '0-11,24-35'");
    return rc < 0 ? -1 : 0;
}

static int parse_pci(vctx *v, const ynode *map, const char *path, sim_pci *pci, int subsys)
{
    static const char *const keys[] = {"bus_id", "device_id", "subsystem_id", NULL};
    if (check_keys(v, map, path, keys) < 0)
        return -1;
    char bus[64];
    if (get_str(v, map, path, "bus_id", bus, sizeof bus, 1) <= 0)
        return -1;
    if (sim_parse_bus_id(bus, pci) < 0) {
        char p[256];
        join(p, sizeof p, path, "bus_id");
        vfail(v, p, "not a PCI bus id like '00000000:1B:00.0'");
        return -1;
    }
    if (get_uint(v, map, path, "device_id", U32MAX, &pci->device_id) < 0)
        return -1;
    if (subsys && get_uint(v, map, path, "subsystem_id", U32MAX, &pci->subsystem_id) < 0)
        return -1;
    return 0;
}

static int level_from_name(const char *s)
{
    if (strcmp(s, "PIX") == 0) return SIM_TOPO_SINGLE;
    if (strcmp(s, "PXB") == 0) return SIM_TOPO_MULTIPLE;
    if (strcmp(s, "PHB") == 0) return SIM_TOPO_HOSTBRIDGE;
    if (strcmp(s, "NODE") == 0) return SIM_TOPO_NODE;
    if (strcmp(s, "SYS") == 0) return SIM_TOPO_SYSTEM;
    if (strcmp(s, "X") == 0) return SIM_TOPO_INTERNAL;
    return -1;
}

static int parse_mig(vctx *v, const ynode *mig, const char *path, sim_gpu *g)
{
    static const char *const keys[] = {"mode", "pending_mode", "max_devices", "profiles",
                                       "instances", NULL};
    static const char *const pkeys[] = {"nvml_profile", "id", "name", "slices",
                                        "instance_count", "multiprocessors", "memory_mb",
                                        "copy_engines", "decoders", "encoders", "jpegs", "ofas",
                                        "p2p", NULL};
    static const char *const ikeys[] = {"gi", "ci", "profile", "uuid", "compute_slices", NULL};
    char p[256], q[256], mode[16];
    long long x;
    if (check_keys(v, mig, path, keys) < 0)
        return -1;
    for (int pass = 0; pass < 2; pass++) {
        const char *key = pass ? "pending_mode" : "mode";
        int r = get_str(v, mig, path, key, mode, sizeof mode, pass == 0);
        if (r < 0)
            return -1;
        if (r == 0) {
            g->mig_pending = g->mig_mode;
            continue;
        }
        int on = strcmp(mode, "enabled") == 0 ? 1 : strcmp(mode, "disabled") == 0 ? 0 : -1;
        if (on < 0) {
            join(p, sizeof p, path, key);
            vfail(v, p, "must be 'enabled' or 'disabled'");
            return -1;
        }
        if (pass)
            g->mig_pending = on;
        else
            g->mig_mode = on;
    }
    if (get_uint(v, mig, path, "max_devices", SIM_MAX_MIG, &g->mig_max) < 0)
        return -1;

    const ynode *profs = need_seq(v, mig, path, "profiles", 1, SIM_MAX_MIG_PROFILES, "profiles");
    if (!profs)
        return -1;
    join(p, sizeof p, path, "profiles");
    for (int i = 0; i < profs->n; i++) {
        char pp[256];
        const ynode *pn = map_item(v, profs, p, i, pkeys, q, sizeof q);
        if (!pn)
            return -1;
        sim_mig_profile *mp = &g->profiles[i];
        if (get_int(v, pn, q, "nvml_profile", 0, SIM_NUM_GI_PROFILES - 1, &x, 1) < 0)
            return -1;
        mp->nvml_profile = (int)x;
        for (int j = 0; j < i; j++)
            if (g->profiles[j].nvml_profile == mp->nvml_profile) {
                join(pp, sizeof pp, q, "nvml_profile");
                vfail(v, pp, "duplicate nvml_profile %d", mp->nvml_profile);
                return -1;
            }
        if (get_str(v, pn, q, "name", mp->name, sizeof mp->name, 1) <= 0)
            return -1;
        struct { const char *k; unsigned int *dst; } u[] = {
            {"id", &mp->id}, {"slices", &mp->slices}, {"instance_count", &mp->instance_count},
            {"multiprocessors", &mp->multiprocessors}, {"copy_engines", &mp->copy_engines},
            {"decoders", &mp->decoders}, {"encoders", &mp->encoders}, {"jpegs", &mp->jpegs},
            {"ofas", &mp->ofas}, {"p2p", &mp->p2p},
        };
        for (size_t k = 0; k < sizeof u / sizeof *u; k++) {
            long long hi = strcmp(u[k].k, "p2p") == 0 ? 1 : U32MAX;
            if (get_uint(v, pn, q, u[k].k, hi, u[k].dst) < 0)
                return -1;
        }
        if (get_int(v, pn, q, "memory_mb", 0, I64MAX, &x, 1) < 0)
            return -1;
        mp->memory_mb = (unsigned long long)x;
    }
    g->nprofiles = profs->n;

    const ynode *inst = yaml_get(mig, "instances");
    if (!inst)
        return 0;
    join(p, sizeof p, path, "instances");
    if (check_node(v, inst, p, Y_SEQ, NULL) < 0)
        return -1;
    if (inst->n && !g->mig_mode) {
        vfail(v, p, "MIG instances need mode: enabled");
        return -1;
    }
    if ((unsigned int)inst->n > g->mig_max) {
        vfail(v, p, "%d instances but max_devices is %u", inst->n, g->mig_max);
        return -1;
    }
    for (int i = 0; i < inst->n; i++) {
        const ynode *in = map_item(v, inst, p, i, ikeys, q, sizeof q);
        if (!in)
            return -1;
        sim_mig *m = &g->migs[i];
        if (get_uint(v, in, q, "gi", U32MAX - 1, &m->gi) < 0
            || get_uint(v, in, q, "ci", SIM_MAX_CI - 1, &m->ci) < 0)
            return -1;
        for (int j = 0; j < i; j++)
            if (g->migs[j].gi == m->gi && g->migs[j].ci == m->ci) {
                vfail(v, q, "duplicate gi %u / ci %u", m->gi, m->ci);
                return -1;
            }
        if (get_int(v, in, q, "profile", 0, SIM_NUM_GI_PROFILES - 1, &x, 1) < 0)
            return -1;
        m->profile = -1;
        for (int j = 0; j < g->nprofiles; j++)
            if (g->profiles[j].nvml_profile == (int)x)
                m->profile = j;
        if (m->profile < 0) {
            char pp[256];
            join(pp, sizeof pp, q, "profile");
            vfail(v, pp, "no entry in profiles has nvml_profile %lld", x);
            return -1;
        }
        if (get_str(v, in, q, "uuid", m->uuid, sizeof m->uuid, 1) <= 0)
            return -1;
        if (get_int(v, in, q, "compute_slices", 0, g->profiles[m->profile].slices, &x, 0) < 0)
            return -1;
        m->ci_slices = yaml_get(in, "compute_slices") ? (unsigned int)x : 0;
        if (yaml_get(in, "compute_slices") && x < 1) {
            char pp[256];
            join(pp, sizeof pp, q, "compute_slices");
            vfail(v, pp, "must be at least 1");
            return -1;
        }
        if (strncmp(m->uuid, "MIG-", 4) != 0) {
            char pp[256];
            join(pp, sizeof pp, q, "uuid");
            vfail(v, pp, "must start with 'MIG-'");
            return -1;
        }
    }
    g->nmig = inst->n;
    return 0;
}

static int parse_gpu(vctx *v, const ynode *gn, int index, sim_gpu *g, int ngpus, int nswitches)
{
    static const char *const keys[] = {"index", "name", "uuid", "serial", "minor", "pci",
                                       "numa_node", "cpu_affinity", "memory",
                                       "compute_capability", "multiprocessors", "nvlinks",
                                       "supported_events", "mig", NULL};
    char path[64], p[256], text[SIM_LEN_CPULIST], msg[200];
    long long x;
    snprintf(path, sizeof path, "gpus[%d]", index);
    if (check_node(v, gn, path, Y_MAP, keys) < 0)
        return -1;
    if (get_int(v, gn, path, "index", 0, SIM_MAX_GPUS - 1, &x, 1) < 0)
        return -1;
    if (x != index) {
        join(p, sizeof p, path, "index");
        vfail(v, p, "is %lld but the GPU is entry %d of gpus (indices must be 0, 1, 2, ...)", x,
              index);
        return -1;
    }
    if (get_str(v, gn, path, "name", g->name, sizeof g->name, 1) <= 0)
        return -1;
    if (get_str(v, gn, path, "uuid", g->uuid, sizeof g->uuid, 1) <= 0)
        return -1;
    if (strncmp(g->uuid, "GPU-", 4) != 0) {
        join(p, sizeof p, path, "uuid");
        vfail(v, p, "must start with 'GPU-'");
        return -1;
    }
    int r = get_str(v, gn, path, "serial", g->serial, sizeof g->serial, 0);
    if (r < 0)
        return -1;
    g->has_serial = r;
    if (get_uint(v, gn, path, "minor", U32MAX, &g->minor) < 0)
        return -1;

    join(p, sizeof p, path, "pci");
    const ynode *pci = need(v, gn, path, "pci", Y_MAP, 1);
    if (!pci || parse_pci(v, pci, p, &g->pci, 1) < 0)
        return -1;

    r = get_int(v, gn, path, "numa_node", 0, 65535, &x, 0);
    if (r < 0)
        return -1;
    g->has_numa = r;
    g->numa_node = r ? (int)x : -1;

    if (get_str(v, gn, path, "cpu_affinity", text, sizeof text, 1) <= 0)
        return -1;
    if (sim_parse_cpulist(text, g->cpu_mask, msg, sizeof msg) < 0) {
        join(p, sizeof p, path, "cpu_affinity");
        vfail(v, p, "%s", msg);
        return -1;
    }

    join(p, sizeof p, path, "memory");
    const ynode *mem = need(v, gn, path, "memory", Y_MAP, 1);
    if (!mem)
        return -1;
    static const char *const mkeys[] = {"total", "reserved", "used", NULL};
    if (check_keys(v, mem, p, mkeys) < 0)
        return -1;
    unsigned long long *mdst[] = {&g->mem_total, &g->mem_reserved, &g->mem_used};
    for (int k = 0; k < 3; k++) {
        if (get_int(v, mem, p, mkeys[k], 0, I64MAX, &x, 1) < 0)
            return -1;
        *mdst[k] = (unsigned long long)x;
    }
    if (g->mem_reserved + g->mem_used > g->mem_total) {
        vfail(v, p, "reserved + used exceed total");
        return -1;
    }

    join(p, sizeof p, path, "compute_capability");
    const ynode *cc = need(v, gn, path, "compute_capability", Y_SEQ, 1);
    if (!cc)
        return -1;
    if (cc->n != 2) {
        vfail(v, p, "expected [major, minor]");
        return -1;
    }
    if (int_value(v, cc->items[0], p, 0, 255, &x) < 0)
        return -1;
    g->cc_major = (int)x;
    if (int_value(v, cc->items[1], p, 0, 255, &x) < 0)
        return -1;
    g->cc_minor = (int)x;

    r = get_int(v, gn, path, "multiprocessors", 0, U32MAX, &x, 0);
    if (r < 0)
        return -1;
    g->has_mp = r;
    g->multiprocessors = r ? (unsigned int)x : 0;

    const ynode *links = need_seq(v, gn, path, "nvlinks", 0, SIM_MAX_LINKS, "links");
    if (v->failed)
        return -1;
    join(p, sizeof p, path, "nvlinks");
    if (links) {
        for (int k = 0; k < links->n; k++) {
            const ynode *ln = links->items[k];
            char lp[300];
            pathf(lp, sizeof lp, "%s[%d]", p, k);
            if (ln->type == Y_INT) {
                if (int_value(v, ln, lp, 0, ngpus - 1, &x) < 0)
                    return -1;
                if (x == index) {
                    vfail(v, lp, "a GPU cannot link to itself");
                    return -1;
                }
                g->link_kind[k] = SIM_LINK_GPU;
                g->link_target[k] = (int)x;
            } else if (ln->type == Y_STR && strcmp(ln->str, "down") == 0) {
                g->link_kind[k] = SIM_LINK_NONE;
            } else if (ln->type == Y_STR && strncmp(ln->str, "switch", 6) == 0) {
                char *end;
                const char *num = ln->str + 6;
                long s = (*num >= '0' && *num <= '9') ? strtol(num, &end, 10) : -1;
                if (s < 0 || *end || s >= nswitches || (num[0] == '0' && num[1])) {
                    vfail(v, lp, "'%s' names no entry of nvswitches (have %d)", ln->str,
                          nswitches);
                    return -1;
                }
                g->link_kind[k] = SIM_LINK_SWITCH;
                g->link_target[k] = (int)s;
            } else {
                vfail(v, lp, "expected a GPU index, 'switchN' or 'down'");
                return -1;
            }
        }
        g->nlinks = links->n;
    }

    if (get_int(v, gn, path, "supported_events", 0, I64MAX, &x, 1) < 0)
        return -1;
    g->supported_events = (unsigned long long)x;

    const ynode *mig = yaml_get(gn, "mig");
    if (mig) {
        join(p, sizeof p, path, "mig");
        if (check_node(v, mig, p, Y_MAP, NULL) < 0)
            return -1;
        g->mig_capable = 1;
        if (parse_mig(v, mig, p, g) < 0)
            return -1;
    }
    return 0;
}

/* NVML return code from a name (DRIVER_NOT_LOADED, NVML_ERROR_DRIVER_NOT_LOADED) or number. */
static int code_from_name(const char *s)
{
#define ERROR_NAME(name, value, text) {#name, value},
    static const struct { const char *name; int code; } codes[] = {SIM_NVML_ERRORS(ERROR_NAME)};
    if (strncmp(s, "NVML_ERROR_", 11) == 0)
        s += 11;
    for (size_t i = 0; i < sizeof codes / sizeof *codes; i++)
        if (strcmp(s, codes[i].name) == 0)
            return codes[i].code;
    return -1;
}

/* GPU indices below `ngpus` joined by '+' (GPU_AGENT_SIM_FAULTS lists). */
static int parse_index_list_text(const char *text, int ngpus, uint64_t *mask)
{
    unsigned long range[2];
    *mask = 0;
    return parse_number_list(text, '+', 0, (unsigned long)ngpus, mask, range) < 0 ? -1 : 0;
}

static int parse_faults_yaml(vctx *v, const ynode *f, sim_node *node)
{
    static const char *const keys[] = {"init", "events_unsupported", "lost", NULL};
    if (check_node(v, f, "faults", Y_MAP, keys) < 0)
        return -1;
    const ynode *init = yaml_get(f, "init");
    if (init) {
        long long x;
        if (init->type == Y_STR) {
            node->fault_init = code_from_name(init->str);
        } else if (init->type == Y_INT && yaml_int(init, &x) == 0 && x > 0 && x <= 999) {
            node->fault_init = (int)x;
        } else {
            node->fault_init = -1;
        }
        if (node->fault_init <= 0) {
            vfail(v, "faults.init", "expected an NVML error name such as DRIVER_NOT_LOADED");
            return -1;
        }
    }
    const char *lists[] = {"events_unsupported", "lost"};
    uint64_t *dst[] = {&node->fault_events_unsupported, &node->fault_lost};
    for (int k = 0; k < 2; k++) {
        const ynode *l = yaml_get(f, lists[k]);
        char p[64];
        pathf(p, sizeof p, "faults.%s", lists[k]);
        if (!l)
            continue;
        if (l->type != Y_SEQ) {
            vfail(v, p, "expected a sequence of GPU indices, found %s", yaml_type_name(l->type));
            return -1;
        }
        for (int i = 0; i < l->n; i++) {
            long long x;
            char q[80];
            pathf(q, sizeof q, "%s[%d]", p, i);
            if (int_value(v, l->items[i], q, 0, node->ngpus - 1, &x) < 0)
                return -1;
            *dst[k] |= 1ULL << x;
        }
    }
    return 0;
}

/* GPU_AGENT_SIM_FAULTS: comma-separated KEY=VALUE, keys as in `faults:`; lists use '+'. */
static int parse_faults_env(const char *text, sim_node *node, char *err, size_t errlen)
{
    char buf[1024];
    if (strlen(text) >= sizeof buf) {
        snprintf(err, errlen, "GPU_AGENT_SIM_FAULTS is too long");
        return -1;
    }
    strcpy(buf, text);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq) {
            snprintf(err, errlen, "GPU_AGENT_SIM_FAULTS: '%s' is not KEY=VALUE", item);
            return -1;
        }
        *eq = '\0';
        const char *val = eq + 1;
        if (strcmp(item, "init") == 0) {
            char *end;
            long n = strtol(val, &end, 10);
            int code = (*val && !*end) ? (int)n : code_from_name(val);
            if (code <= 0 || code > 999) {
                snprintf(err, errlen,
                         "GPU_AGENT_SIM_FAULTS: init=%s is not an NVML error name such as "
                         "DRIVER_NOT_LOADED", val);
                return -1;
            }
            node->fault_init = code;
        } else if (strcmp(item, "events_unsupported") == 0 || strcmp(item, "lost") == 0) {
            uint64_t mask;
            if (parse_index_list_text(val, node->ngpus, &mask) < 0) {
                snprintf(err, errlen,
                         "GPU_AGENT_SIM_FAULTS: %s=%s is not GPU indices below %d joined by '+'",
                         item, val, node->ngpus);
                return -1;
            }
            if (strcmp(item, "lost") == 0)
                node->fault_lost = mask;
            else
                node->fault_events_unsupported = mask;
        } else {
            snprintf(err, errlen,
                     "GPU_AGENT_SIM_FAULTS: unknown key '%s' (init, events_unsupported, lost)",
                     item);
            return -1;
        }
    }
    return 0;
}

static int parse_node(vctx *v, const ynode *root, sim_node *node)
{
    static const char *const keys[] = {"schema", "name", "description", "source",
                                       "driver_version", "nvml_version", "cuda_driver_version",
                                       "nvswitches", "gpus", "pcie_topology", "faults", NULL};
    long long x;
    char text[SIM_LEN_TEXT];
    if (root->type != Y_MAP) {
        vfail(v, "(top level)", "expected a mapping, found %s", yaml_type_name(root->type));
        return -1;
    }
    if (check_keys(v, root, "", keys) < 0)
        return -1;
    if (get_int(v, root, "", "schema", 1, 1, &x, 1) < 0)
        return -1;
    if (get_str(v, root, "", "name", node->name, sizeof node->name, 1) <= 0
        || get_str(v, root, "", "description", text, sizeof text, 1) <= 0
        || get_str(v, root, "", "source", text, sizeof text, 1) <= 0
        || get_str(v, root, "", "driver_version", node->driver_version,
                   sizeof node->driver_version, 1) <= 0
        || get_str(v, root, "", "nvml_version", node->nvml_version, sizeof node->nvml_version,
                   1) <= 0)
        return -1;
    if (get_int(v, root, "", "cuda_driver_version", 0, 2147483647LL, &x, 1) < 0)
        return -1;
    node->cuda_version = (int)x;

    const ynode *sw = need_seq(v, root, "", "nvswitches", 0, SIM_MAX_SWITCHES, "switches");
    if (v->failed)
        return -1;
    if (sw) {
        static const char *const skeys[] = {"bus_id", "device_id", NULL};
        for (int i = 0; i < sw->n; i++) {
            char p[64];
            const ynode *item = map_item(v, sw, "nvswitches", i, skeys, p, sizeof p);
            if (!item || parse_pci(v, item, p, &node->switches[i], 0) < 0)
                return -1;
        }
        node->nswitches = sw->n;
    }

    const ynode *gpus = need(v, root, "", "gpus", Y_SEQ, 1);
    if (!gpus)
        return -1;
    if (gpus->n < 1 || gpus->n > SIM_MAX_GPUS) {
        vfail(v, "gpus", "must list 1 to %d GPUs", SIM_MAX_GPUS);
        return -1;
    }
    node->ngpus = gpus->n;
    for (int i = 0; i < gpus->n; i++) {
        if (parse_gpu(v, gpus->items[i], i, &node->gpus[i], gpus->n, node->nswitches) < 0)
            return -1;
    }
    /* identities must be unique */
    for (int i = 0; i < node->ngpus; i++) {
        sim_gpu *a = &node->gpus[i];
        for (int j = 0; j < i; j++) {
            sim_gpu *b = &node->gpus[j];
            char p[64];
            pathf(p, sizeof p, "gpus[%d]", i);
            if (strcmp(a->uuid, b->uuid) == 0) {
                vfail(v, p, "uuid %s repeats gpus[%d]", a->uuid, j);
                return -1;
            }
            if (a->pci.domain == b->pci.domain && a->pci.bus == b->pci.bus
                && a->pci.device == b->pci.device && a->pci.function == b->pci.function) {
                vfail(v, p, "pci.bus_id repeats gpus[%d]", j);
                return -1;
            }
            if (a->minor == b->minor) {
                vfail(v, p, "minor %u repeats gpus[%d]", a->minor, j);
                return -1;
            }
        }
        for (int m = 0; m < a->nmig; m++)
            for (int j = 0; j <= i; j++)
                for (int n = 0; n < (j == i ? m : node->gpus[j].nmig); n++)
                    if (strcmp(a->migs[m].uuid, node->gpus[j].migs[n].uuid) == 0) {
                        char p[96];
                        pathf(p, sizeof p, "gpus[%d].mig.instances[%d].uuid", i, m);
                        vfail(v, p, "repeats another MIG device's uuid");
                        return -1;
                    }
    }
    /* NVLinks to GPUs must be mirrored: as many links i->j as j->i. */
    for (int i = 0; i < node->ngpus; i++)
        for (int j = 0; j < node->ngpus; j++) {
            int ij = 0, ji = 0;
            for (int k = 0; k < node->gpus[i].nlinks; k++)
                ij += node->gpus[i].link_kind[k] == SIM_LINK_GPU
                      && node->gpus[i].link_target[k] == j;
            for (int k = 0; k < node->gpus[j].nlinks; k++)
                ji += node->gpus[j].link_kind[k] == SIM_LINK_GPU
                      && node->gpus[j].link_target[k] == i;
            if (ij != ji) {
                char p[64];
                pathf(p, sizeof p, "gpus[%d].nvlinks", i);
                vfail(v, p, "%d links to GPU %d but GPU %d has %d links back", ij, j, j, ji);
                return -1;
            }
        }

    const ynode *topo = need(v, root, "", "pcie_topology", Y_SEQ, 1);
    if (!topo)
        return -1;
    if (topo->n != node->ngpus) {
        vfail(v, "pcie_topology", "has %d rows for %d GPUs", topo->n, node->ngpus);
        return -1;
    }
    for (int i = 0; i < topo->n; i++) {
        const ynode *row = topo->items[i];
        char p[64];
        pathf(p, sizeof p, "pcie_topology[%d]", i);
        if (row->type != Y_SEQ || row->n != node->ngpus) {
            vfail(v, p, "expected a row of %d levels", node->ngpus);
            return -1;
        }
        for (int j = 0; j < row->n; j++) {
            const ynode *c = row->items[j];
            int lvl = c->type == Y_STR ? level_from_name(c->str) : -1;
            char q[80];
            pathf(q, sizeof q, "%s[%d]", p, j);
            if (lvl < 0) {
                vfail(v, q, "expected one of X PIX PXB PHB NODE SYS");
                return -1;
            }
            if ((lvl == SIM_TOPO_INTERNAL) != (i == j)) {
                vfail(v, q, i == j ? "the diagonal must be X" : "X is only for the diagonal");
                return -1;
            }
            node->gpus[i].topo[j] = lvl;
        }
    }
    for (int i = 0; i < node->ngpus; i++)
        for (int j = 0; j < i; j++)
            if (node->gpus[i].topo[j] != node->gpus[j].topo[i]) {
                char p[64];
                pathf(p, sizeof p, "pcie_topology[%d][%d]", i, j);
                vfail(v, p, "differs from pcie_topology[%d][%d] (must be symmetric)", j, i);
                return -1;
            }

    const ynode *faults = yaml_get(root, "faults");
    if (faults && parse_faults_yaml(v, faults, node) < 0)
        return -1;
    return 0;
}

static int valid_name(const char *s)
{
    if (!*s)
        return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9')
              || *s == '-' || *s == '_' || *s == '.'))
            return 0;
    return 1;
}

/* Resolve GPU_AGENT_SIM_PROFILE to a file path. */
static int resolve_path(char *out, size_t len, char *err, size_t errlen)
{
    const char *spec = getenv("GPU_AGENT_SIM_PROFILE");
    if (!spec || !*spec)
        spec = DEFAULT_PROFILE;
    size_t sl = strlen(spec);
    int is_path = strchr(spec, '/') != NULL || (sl > 5 && strcmp(spec + sl - 5, ".yaml") == 0)
                  || (sl > 4 && strcmp(spec + sl - 4, ".yml") == 0);
    if (is_path) {
        if ((size_t)snprintf(out, len, "%s", spec) >= len) {
            snprintf(err, errlen, "GPU_AGENT_SIM_PROFILE path is too long");
            return -1;
        }
        return 0;
    }
    if (!valid_name(spec)) {
        snprintf(err, errlen,
                 "GPU_AGENT_SIM_PROFILE='%s' is neither a profile name ([A-Za-z0-9._-]) nor a "
                 "path", spec);
        return -1;
    }
    Dl_info info;
    if (!dladdr((void *)&resolve_path, &info) || !info.dli_fname) {
        snprintf(err, errlen, "cannot find the simulated library's own path (dladdr)");
        return -1;
    }
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", info.dli_fname);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    if ((size_t)snprintf(out, len, "%s/../profiles/%s.yaml", dir, spec) >= len) {
        snprintf(err, errlen, "profile path is too long");
        return -1;
    }
    struct stat st;
    if (stat(out, &st) != 0) {
        char real[PATH_MAX + 16];
        snprintf(real, sizeof real, "%s/../profiles", dir);
        char *r = realpath(real, NULL);
        snprintf(err, errlen, "no profile named '%s' (looked for %s/%s.yaml; set "
                 "GPU_AGENT_SIM_PROFILE to a shipped name or a path)", spec, r ? r : real, spec);
        free(r);
        return -1;
    }
    return 0;
}

int sim_profile_load(sim_node *node, char *err, size_t errlen)
{
    char path[PATH_MAX];
    memset(node, 0, sizeof *node);
    if (resolve_path(path, sizeof path, err, errlen) < 0)
        return NVML_ERROR_UNKNOWN;
    ynode *root = yaml_load_file(path, err, errlen);
    if (!root)
        return NVML_ERROR_UNKNOWN;
    vctx v = {.file = path, .err = err, .errlen = errlen};
    int rc = parse_node(&v, root, node);
    yaml_free(root);
    if (rc < 0)
        return NVML_ERROR_UNKNOWN;
    const char *faults = getenv("GPU_AGENT_SIM_FAULTS");
    if (faults && *faults && parse_faults_env(faults, node, err, errlen) < 0)
        return NVML_ERROR_UNKNOWN;
    for (int i = 0; i < node->ngpus; i++) {
        sim_gpu *g = &node->gpus[i];
        g->h.magic = SIM_MAGIC_DEVICE;
        g->h.gpu = i;
        g->h.mig = -1;
        sim_mig_placements(g);
        if (sim_mig_place_all(g, i, g->migs, g->nmig, 0) < 0) {
            snprintf(err, errlen, "%s: gpus[%d].mig.instances: they do not fit the placements of "
                     "their profiles (docs/simulator.md)", path, i);
            return NVML_ERROR_UNKNOWN;
        }
        g->lost = (node->fault_lost >> i) & 1;
        g->events_unsupported = (node->fault_events_unsupported >> i) & 1;
    }
    return NVML_SUCCESS;
}
