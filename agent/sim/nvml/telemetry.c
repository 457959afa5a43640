/*
 * telemetry.c: the GPU telemetry queries an exporter reads at scrape time: utilization,
 * temperature, power and its enforced limit, clocks, clock event (throttle) reasons, retired
 * pages and remapped rows; and the driver's recovery action (a field value), which the health
 * monitor's recovery probe reads with the pending pages and rows.
 *
 * Owns: each GPU's telemetry defaults (from its product name and compute capability, at
 * init), the `telemetry` control record's keys and their limits (applied all or nothing; the
 * writer, agent/sim/control.py, checks the same ones), the getters with NVML's signatures and
 * return codes, and `delay_ms`: a getter on a GPU with a delay sleeps that long, without the
 * global lock, before it answers, as a GPU whose NVML calls hang. Must not delay any other
 * query (discovery, memory, ECC, events and the probe's identity queries stay prompt) and must not
 * change state outside `sim_gpu.telemetry` and the memory used of a `telemetry` record.
 *
 * Which GPUs answer what: MIG handles get NOT_SUPPORTED from every getter here (NVML answers
 * these for the parent GPU). Memory repair follows the architecture, from the compute
 * capability: below 8 (Volta, Turing and older: V100, T4) the GPU retires pages and
 * nvmlDeviceGetRemappedRows is NOT_SUPPORTED; 8 and above (Ampere and newer: A100, A30, L40S,
 * H100, B200) it remaps rows and the retired-page queries are NOT_SUPPORTED, as `nvidia-smi -q`
 * shows "N/A" there.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "sim.h"

#define MIB (1024ULL * 1024ULL)
#define MAX_U32 0xFFFFFFFFULL
#define MAX_DELAY_MS 600000ULL /* ten minutes: longer than any scrape waits */

#define SIM_TEMPERATURE_GPU 0 /* NVML_TEMPERATURE_GPU; other sensors are not modelled */
enum { SIM_CLOCK_GRAPHICS = 0, SIM_CLOCK_SM = 1, SIM_CLOCK_MEM = 2 };
#define SIM_CLOCKS_EVENT_GPU_IDLE 0x1ULL /* nvmlClocksEventReasonGpuIdle */
#define SIM_FI_GPU_RECOVERY_ACTION 230 /* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION */
#define SIM_RECOVERY_ACTION_MAX 7     /* NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT */
#define SIM_VALUE_TYPE_UNSIGNED_INT 1 /* NVML_VALUE_TYPE_UNSIGNED_INT */

/* ---- defaults ---- */

/* Idle values by product: the first row whose `match` is in the GPU's name, else the last. */
static const struct product {
    const char *match;
    unsigned int limit_w;  /* enforced power limit (the board's default TDP) */
    unsigned int idle_w;   /* power drawn idle */
    unsigned int sm_mhz;   /* SM (and graphics) clock idle */
    unsigned int mem_mhz;  /* memory clock */
} PRODUCTS[] = {
    {"V100-SXM2", 300, 42, 135, 877},
    {"V100", 250, 30, 135, 877},
    {"P100-SXM2", 300, 32, 405, 715},
    {"P100", 250, 28, 405, 715},
    {"A100-SXM4", 400, 58, 210, 1593},
    {"A100", 300, 45, 210, 1512},
    {"A30", 165, 30, 210, 1215},
    {"H100 80GB HBM3", 700, 72, 345, 2619},
    {"H100", 350, 50, 345, 1593},
    {"B200", 1000, 140, 345, 3996},
    {"L40S", 350, 35, 210, 405},
    {"RTX 4090", 450, 20, 210, 405},
    {"RTX 3090", 350, 25, 210, 405},
    {"", 300, 50, 210, 1215}, /* anything else */
};

#define IDLE_TEMPERATURE_C 35

void sim_telemetry_defaults(sim_gpu *g)
{
    const struct product *p = PRODUCTS;
    while (p->match[0] && !strstr(g->name, p->match))
        p++;
    sim_telemetry *t = &g->telemetry;
    memset(t, 0, sizeof *t);
    t->temperature_c = IDLE_TEMPERATURE_C;
    t->power_mw = p->idle_w * 1000;
    t->power_limit_mw = p->limit_w * 1000;
    t->sm_clock_mhz = p->sm_mhz;
    t->mem_clock_mhz = p->mem_mhz;
    t->throttle_reasons = SIM_CLOCKS_EVENT_GPU_IDLE; /* what an idle GPU reports */
    t->repair = g->cc_major >= 8 ? SIM_REPAIR_ROWS : SIM_REPAIR_PAGES;
}

/* ---- the `telemetry` record ---- */

/* The keys a record may set (besides memory_used_mib, which is in MiB of sim_gpu.mem_used and
 * limited by the GPU's memory): X(key, largest value, sim_telemetry member). The same table is
 * TELEMETRY_KEYS in agent/sim/control.py. */
#define TELEMETRY_KEYS(X) \
    X(gpu_util, 100, gpu_util) \
    X(mem_util, 100, mem_util) \
    X(temperature_c, 200, temperature_c) \
    X(power_mw, MAX_U32, power_mw) \
    X(sm_clock_mhz, 100000, sm_clock_mhz) \
    X(throttle_reasons, ~0ULL, throttle_reasons) \
    X(retired_pending, 1, retired_pending) \
    X(remapped_correctable, MAX_U32, remapped_correctable) \
    X(remapped_uncorrectable, MAX_U32, remapped_uncorrectable) \
    X(remapped_pending, 1, remapped_pending) \
    X(remapped_failed, 1, remapped_failed) \
    X(recovery_action, SIM_RECOVERY_ACTION_MAX, recovery_action) \
    X(delay_ms, MAX_DELAY_MS, delay_ms)

void sim_telemetry_apply(sim_gpu *g, char *const *keys, char *const *vals, int n)
{
    sim_telemetry next = g->telemetry;
    unsigned long long mem_used = g->mem_used;
    for (int i = 0; i < n; i++) {
        unsigned long long v;
        if (strcmp(keys[i], "gpu") == 0)
            continue;
        if (sim_parse_u64(vals[i], &v) < 0)
            return;
        if (strcmp(keys[i], "memory_used_mib") == 0) {
            if (v > (g->mem_total - g->mem_reserved) / MIB)
                return;
            mem_used = v * MIB;
            continue;
        }
#define APPLY_KEY(key, most, member) \
        if (strcmp(keys[i], #key) == 0) { \
            if (v > (most)) \
                return; \
            next.member = (__typeof__(next.member))v; \
            continue; \
        }
        TELEMETRY_KEYS(APPLY_KEY)
#undef APPLY_KEY
        return; /* an unknown key */
    }
    g->telemetry = next;
    g->mem_used = mem_used;
}

/* ---- the getters ---- */

/* Enter a telemetry getter for `device`: a full GPU (a MIG handle gets NOT_SUPPORTED), and
 * INVALID_ARGUMENT unless out_ok. When the GPU has a delay, sleep it with the lock released,
 * then enter again: the answer is the state after the delay (the GPU may have been lost, or
 * the library shut down, meanwhile). On success the lock is held and *gpu is the GPU. */
static nvmlReturn_t enter_telemetry(nvmlDevice_t device, int out_ok, sim_gpu **gpu)
{
    sim_mig *m;
    nvmlReturn_t rc = sim_enter_device(device, out_ok, gpu, &m);
    if (rc)
        return rc;
    if (m) {
        sim_leave();
        return NVML_ERROR_NOT_SUPPORTED;
    }
    unsigned int delay = (*gpu)->telemetry.delay_ms;
    if (delay == 0)
        return NVML_SUCCESS;
    sim_leave();
    sim_sleep_until_ns(sim_now_ns() + (unsigned long long)delay * 1000000ULL);
    return sim_enter_device(device, out_ok, gpu, &m);
}

/* Open a telemetry getter: declare g and t (its telemetry) and enter; past it the lock is
 * held. */
#define ENTER_TELEMETRY(device, out_ok) \
    sim_gpu *g; \
    TRY_ENTER(enter_telemetry((device), (out_ok), &g)); \
    const sim_telemetry *t = &g->telemetry

/* The getters that copy one value into their one output:
 *   X(function, output type, supported, value) */
#define TELEMETRY_VALUES(X) \
    X(nvmlDeviceGetPowerUsage, unsigned int, 1, t->power_mw) \
    X(nvmlDeviceGetEnforcedPowerLimit, unsigned int, 1, t->power_limit_mw) \
    X(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long, 1, t->throttle_reasons) \
    X(nvmlDeviceGetCurrentClocksThrottleReasons, unsigned long long, 1, t->throttle_reasons) \
    X(nvmlDeviceGetRetiredPagesPendingStatus, int, t->repair == SIM_REPAIR_PAGES, \
      (int)t->retired_pending)

#define DEFINE_TELEMETRY_VALUE(function, type, supported, value) \
    SIM_EXPORT nvmlReturn_t function(nvmlDevice_t device, type *out) \
    { \
        ENTER_TELEMETRY(device, out != NULL); \
        if (!(supported)) \
            DONE(NVML_ERROR_NOT_SUPPORTED); \
        *out = (value); \
        DONE(NVML_SUCCESS); \
    }

TELEMETRY_VALUES(DEFINE_TELEMETRY_VALUE)

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                      nvmlUtilization_t *utilization)
{
    ENTER_TELEMETRY(device, utilization != NULL);
    utilization->gpu = t->gpu_util;
    utilization->memory = t->mem_util;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                                 unsigned int *temp)
{
    ENTER_TELEMETRY(device, temp != NULL && sensorType == SIM_TEMPERATURE_GPU);
    *temp = t->temperature_c;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type,
                                               unsigned int *clock)
{
    ENTER_TELEMETRY(device, clock != NULL && type <= SIM_CLOCK_MEM);
    *clock = type == SIM_CLOCK_MEM ? t->mem_clock_mhz : t->sm_clock_mhz;
    DONE(NVML_SUCCESS);
}

/* Both retired-page lists: the simulator retires no pages, so the list is always empty; only
 * whether it is supported and NVML's argument checks remain. */
static nvmlReturn_t retired_pages(nvmlDevice_t device, unsigned int cause,
                                  unsigned int *pageCount)
{
    ENTER_TELEMETRY(device, pageCount != NULL && cause <= 1);
    if (t->repair != SIM_REPAIR_PAGES)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *pageCount = 0;
    DONE(NVML_SUCCESS);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, unsigned int cause,
                                                  unsigned int *pageCount,
                                                  unsigned long long *addresses)
{
    return retired_pages(device, cause, pageCount);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, unsigned int cause,
                                                     unsigned int *pageCount,
                                                     unsigned long long *addresses,
                                                     unsigned long long *timestamps)
{
    return retired_pages(device, cause, pageCount);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                                  unsigned int *uncRows, unsigned int *isPending,
                                                  unsigned int *failureOccurred)
{
    ENTER_TELEMETRY(device, corrRows != NULL && uncRows != NULL && isPending != NULL
                                && failureOccurred != NULL);
    if (t->repair != SIM_REPAIR_ROWS)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    *corrRows = t->remapped_correctable;
    *uncRows = t->remapped_uncorrectable;
    *isPending = t->remapped_pending;
    *failureOccurred = t->remapped_failed;
    DONE(NVML_SUCCESS);
}

/* nvmlFieldValue_t and nvmlValue_t as nvml.h lays them out. */
typedef union {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
} sim_value;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    sim_value value;
} sim_field_value;

/* Field values: the GPU recovery action only; any other field answers NOT_SUPPORTED in its
 * own nvmlReturn while the call succeeds, as NVML does for fields a GPU lacks. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                                 sim_field_value *values)
{
    ENTER_TELEMETRY(device, values != NULL && valuesCount > 0);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < valuesCount; i++) {
        sim_field_value *v = &values[i];
        v->timestamp = (long long)now.tv_sec * 1000000LL + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId == SIM_FI_GPU_RECOVERY_ACTION) {
            v->valueType = SIM_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = t->recovery_action;
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    DONE(NVML_SUCCESS);
}
