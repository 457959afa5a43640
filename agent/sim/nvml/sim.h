/*
 * sim.h: shared declarations of the simulated NVML (libnvidia-ml.so.1).
 *
 * Owns: the ABI types this library exposes (written from the ctypes layouts pynvml uses, not
 * from NVIDIA's header), the in-memory node model loaded from a profile, and the prototypes
 * shared by the library's C files. Must not declare anything a real NVML would not have
 * under the same name with a different meaning: every exported function keeps NVML's
 * signature and return codes.
 *
 * Files:
 *   yaml.c     the YAML subset parser (see docs/simulator.md)
 *   profile.c  profile path resolution, YAML -> sim_node, start-up faults
 *   control.c  the control channel (record log + inotify), event sets, waits
 *   system.c   init/shutdown refcount, error strings, system queries
 *   device.c   device, PCI, topology, NVLink, MIG, ECC and event-type queries
 *   mig.c      MIG placements; creating and destroying GPU and compute instances
 *   telemetry.c  telemetry (utilization, temperature, power, clocks, retired pages, remapped
 *              rows): per-product defaults, `telemetry` records, the getters and their delay
 */
#ifndef GPU_AGENT_SIM_H
#define GPU_AGENT_SIM_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define SIM_EXPORT __attribute__((visibility("default")))

/* ---- NVML ABI (types as pynvml's ctypes declarations describe them) ---- */

typedef int nvmlReturn_t;

/* The NVML error codes: X(name after NVML_ERROR_, value, what nvmlErrorString says). The
 * enum, nvmlErrorString (system.c) and the fault names (profile.c) are all made from it. */
#define SIM_NVML_ERRORS(X) \
    X(UNINITIALIZED, 1, "Uninitialized") \
    X(INVALID_ARGUMENT, 2, "Invalid Argument") \
    X(NOT_SUPPORTED, 3, "Not Supported") \
    X(NO_PERMISSION, 4, "Insufficient Permissions") \
    X(ALREADY_INITIALIZED, 5, "Already Initialized") \
    X(NOT_FOUND, 6, "Not Found") \
    X(INSUFFICIENT_SIZE, 7, "Insufficient Size") \
    X(INSUFFICIENT_POWER, 8, "Insufficient External Power") \
    X(DRIVER_NOT_LOADED, 9, "Driver Not Loaded") \
    X(TIMEOUT, 10, "Timeout") \
    X(IRQ_ISSUE, 11, "Interrupt Request Issue") \
    X(LIBRARY_NOT_FOUND, 12, "NVML Shared Library Not Found") \
    X(FUNCTION_NOT_FOUND, 13, "Function Not Found") \
    X(CORRUPTED_INFOROM, 14, "Corrupted infoROM") \
    X(GPU_IS_LOST, 15, "GPU is lost") \
    X(RESET_REQUIRED, 16, "GPU requires restart") \
    X(OPERATING_SYSTEM, 17, "The operating system has blocked the request") \
    X(LIB_RM_VERSION_MISMATCH, 18, "RM has detected an NVML/RM version mismatch") \
    X(IN_USE, 19, "In use by another client") \
    X(MEMORY, 20, "Insufficient Memory") \
    X(NO_DATA, 21, "No data") \
    X(VGPU_ECC_NOT_SUPPORTED, 22, "vGPU ECC not supported") \
    X(INSUFFICIENT_RESOURCES, 23, "Insufficient resources") \
    X(FREQ_NOT_SUPPORTED, 24, "Frequency not supported") \
    X(ARGUMENT_VERSION_MISMATCH, 25, "Argument version mismatch") \
    X(DEPRECATED, 26, "Deprecated") \
    X(NOT_READY, 27, "Not ready") \
    X(GPU_NOT_FOUND, 28, "GPU not found") \
    X(INVALID_STATE, 29, "Invalid state") \
    X(UNKNOWN, 999, "Unknown Error")

#define SIM_DECLARE_ERROR(name, value, text) NVML_ERROR_##name = value,
enum {
    NVML_SUCCESS = 0,
    SIM_NVML_ERRORS(SIM_DECLARE_ERROR)
};

/* Event type bits (nvmlEventType*). */
#define SIM_EVENT_SBE 0x1ULL
#define SIM_EVENT_DBE 0x2ULL
#define SIM_EVENT_XID 0x8ULL

/* Topology levels (nvmlGpuTopologyLevel_t). */
enum {
    SIM_TOPO_INTERNAL = 0,
    SIM_TOPO_SINGLE = 10,     /* PIX */
    SIM_TOPO_MULTIPLE = 20,   /* PXB */
    SIM_TOPO_HOSTBRIDGE = 30, /* PHB */
    SIM_TOPO_NODE = 40,       /* NODE */
    SIM_TOPO_SYSTEM = 50,     /* SYS */
};

/* NVLink remote device types. */
#define SIM_NVLINK_DEVICE_GPU 0
#define SIM_NVLINK_DEVICE_SWITCH 2

/* Opaque handles: pointers to sim_handle (devices, GPU instances, compute instances: told
 * apart by their magic) and sim_eventset (event sets). NVML's header wraps the instance
 * handles in a one-pointer struct, which the ABI passes as the pointer. */
typedef struct sim_handle *nvmlDevice_t;
typedef struct sim_handle *nvmlGpuInstance_t;
typedef struct sim_handle *nvmlComputeInstance_t;
typedef struct sim_eventset *nvmlEventSet_t;

/*
 * Field lists that several ABI structs share, each written once as an X-macro:
 * X(type, NVML field, member of the node model it is answered from). SIM_DECLARE_FIELD
 * declares them (in ABI order); device.c copies them from the node model with the same list.
 */
#define SIM_DECLARE_FIELD(type, field, member) type field;

/* The PCI identity every nvmlPciInfo* layout has (answered from sim_pci). */
#define SIM_PCI_ID_FIELDS(X) \
    X(unsigned int, domain, domain) \
    X(unsigned int, bus, bus) \
    X(unsigned int, device, device) \
    X(unsigned int, pciDeviceId, device_id) \
    X(unsigned int, pciSubSystemId, subsystem_id)

/* What both GPU instance profile info layouts have (answered from sim_mig_profile). */
#define SIM_GI_PROFILE_FIELDS(X) \
    X(unsigned int, id, id) \
    X(unsigned int, isP2pSupported, p2p) \
    X(unsigned int, sliceCount, slices) \
    X(unsigned int, instanceCount, instance_count) \
    X(unsigned int, multiprocessorCount, multiprocessors) \
    X(unsigned int, copyEngineCount, copy_engines) \
    X(unsigned int, decoderCount, decoders) \
    X(unsigned int, encoderCount, encoders) \
    X(unsigned int, jpegCount, jpegs) \
    X(unsigned int, ofaCount, ofas) \
    X(unsigned long long, memorySizeMB, memory_mb)

/* nvmlPciInfo_t (the _v3 layout): legacy 16-byte bus id, ids, then the 32-byte bus id. */
typedef struct {
    char busIdLegacy[16];
    SIM_PCI_ID_FIELDS(SIM_DECLARE_FIELD)
    char busId[32];
} nvmlPciInfo_t;

/* Layout answered by the old nvmlDeviceGetPciInfo / _v2 names. */
typedef struct {
    char busId[16];
    SIM_PCI_ID_FIELDS(SIM_DECLARE_FIELD)
    unsigned int reserved[4];
} nvmlPciInfoLegacy_t;

typedef struct {
    unsigned int version;
    SIM_PCI_ID_FIELDS(SIM_DECLARE_FIELD)
    unsigned int baseClass;
    unsigned int subClass;
    char busId[32];
} nvmlPciInfoExt_v1_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int gpu;    /* % of the last sample period a kernel ran */
    unsigned int memory; /* % of it device memory was read or written */
} nvmlUtilization_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define SIM_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    SIM_GI_PROFILE_FIELDS(SIM_DECLARE_FIELD)
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    SIM_GI_PROFILE_FIELDS(SIM_DECLARE_FIELD)
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;

#define SIM_GI_PROFILE_INFO_V2_VERSION \
    ((unsigned int)(sizeof(nvmlGpuInstanceProfileInfo_v2_t) | (2u << 24)))

/* GPU and compute instances (what go-nvlib reads to name a MIG device's profile). */
typedef struct {
    unsigned int start; /* first occupied slice */
    unsigned int size;  /* slices occupied */
} nvmlInstancePlacement_t;

typedef nvmlInstancePlacement_t nvmlGpuInstancePlacement_t;     /* memory slices */
typedef nvmlInstancePlacement_t nvmlComputeInstancePlacement_t; /* compute slices */

typedef struct {
    nvmlDevice_t device; /* the parent GPU */
    unsigned int id;
    unsigned int profileId;
    nvmlInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    nvmlDevice_t device; /* the parent GPU */
    nvmlGpuInstance_t gpuInstance;
    unsigned int id;
    unsigned int profileId;
    nvmlInstancePlacement_t placement; /* within the GPU instance's compute slices */
} nvmlComputeInstanceInfo_t;

/* What every compute instance profile info layout has. */
#define SIM_CI_PROFILE_FIELDS(X) \
    X(unsigned int, id, id) \
    X(unsigned int, sliceCount, slices) \
    X(unsigned int, instanceCount, instance_count) \
    X(unsigned int, multiprocessorCount, multiprocessors) \
    X(unsigned int, sharedCopyEngineCount, copy_engines) \
    X(unsigned int, sharedDecoderCount, decoders) \
    X(unsigned int, sharedEncoderCount, encoders) \
    X(unsigned int, sharedJpegCount, jpegs) \
    X(unsigned int, sharedOfaCount, ofas)

typedef struct {
    SIM_CI_PROFILE_FIELDS(SIM_DECLARE_FIELD)
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    SIM_CI_PROFILE_FIELDS(SIM_DECLARE_FIELD)
    char name[96];
} nvmlComputeInstanceProfileInfo_v2_t;

typedef struct {
    unsigned int version;
    SIM_CI_PROFILE_FIELDS(SIM_DECLARE_FIELD)
    char name[96];
    unsigned int capabilities;
} nvmlComputeInstanceProfileInfo_v3_t;

#define SIM_CI_PROFILE_INFO_V2_VERSION \
    ((unsigned int)(sizeof(nvmlComputeInstanceProfileInfo_v2_t) | (2u << 24)))
#define SIM_CI_PROFILE_INFO_V3_VERSION \
    ((unsigned int)(sizeof(nvmlComputeInstanceProfileInfo_v3_t) | (3u << 24)))
#define SIM_NUM_CI_PROFILES 0x9     /* NVML_COMPUTE_INSTANCE_PROFILE_COUNT */
#define SIM_NUM_CI_ENGINE_PROFILES 1 /* NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT (SHARED) */

/* ---- limits of the node model (profile.py enforces the same ones) ---- */

#define SIM_MAX_GPUS 64
#define SIM_MAX_LINKS 36        /* NVML_NVLINK_MAX_LINKS in current NVML */
#define SIM_MAX_MIG 16          /* MIG devices per GPU */
#define SIM_MAX_MIG_PROFILES 32 /* GPU instance profiles per GPU */
#define SIM_MAX_SWITCHES 64
#define SIM_MAX_CPUS 4096
#define SIM_CPU_WORDS (SIM_MAX_CPUS / 64)
#define SIM_NUM_GI_PROFILES 0x12 /* NVML_GPU_INSTANCE_PROFILE_COUNT */
#define SIM_MAX_MEM_SLICES 8     /* memory slices of a MIG-capable GPU (8 on A100/H100) */
#define SIM_MAX_CI 8             /* compute instances per GPU instance (ids 0-7) */

#define SIM_LEN_NAME 96      /* device names, uuids, profile names (incl. NUL) */
#define SIM_LEN_SERIAL 30
#define SIM_LEN_VERSION 80
#define SIM_LEN_TEXT 1024    /* description, source */
#define SIM_LEN_MIG_NAME 32
#define SIM_LEN_CPULIST 1024

#define SIM_MAGIC_DEVICE 0x53494d44u /* "SIMD" */
#define SIM_MAGIC_GI 0x53494d47u     /* "SIMG": a MIG device's GPU instance */
#define SIM_MAGIC_CI 0x53494d43u     /* "SIMC": a MIG device's compute instance */
#define SIM_MAGIC_SET 0x53494d45u    /* "SIME" */

/* ---- node model ---- */

struct sim_handle {
    uint32_t magic;
    int gpu; /* index of the GPU (the parent for a MIG device) */
    int mig; /* -1 for a full GPU, else the MIG device index */
};

typedef struct {
    unsigned int domain, bus, device, function;
    unsigned int device_id, subsystem_id;
} sim_pci;

typedef struct {
    int nvml_profile; /* NVML_GPU_INSTANCE_PROFILE_* value passed to GetGpuInstanceProfileInfo */
    unsigned int id;
    char name[SIM_LEN_MIG_NAME];
    unsigned int slices, instance_count, multiprocessors;
    unsigned int copy_engines, decoders, encoders, jpegs, ofas, p2p;
    unsigned long long memory_mb;
    /* placements (memory slices): a GPU instance of this profile starts at one of place[] and
     * covers place_size slices (sim_mig_placements derives them at profile load) */
    unsigned int place_size, nplace;
    unsigned int place[SIM_MAX_MEM_SLICES];
} sim_mig_profile;

/* A MIG device: a compute instance (ci) of GPU instance gi. */
typedef struct {
    struct sim_handle h;
    unsigned int gi, ci;
    int profile; /* index into sim_gpu.profiles: its GPU instance's */
    unsigned int ci_slices; /* the compute instance's slices; 0: the whole GPU instance */
    unsigned int ci_start;  /* its placement: first compute slice within the GPU instance */
    char uuid[SIM_LEN_NAME];
} sim_mig;

/* A GPU instance, in a slot of sim_gpu.gis that stays its own while it lives (so its handle
 * and its compute instances' handles stay valid across other changes). It may have no compute
 * instance (then it is no MIG device). */
typedef struct {
    struct sim_handle h;                /* magic SIM_MAGIC_GI while it lives */
    struct sim_handle ci_h[SIM_MAX_CI]; /* its compute instances' handles, by compute instance id */
    int live;
    unsigned int id;
    int profile;        /* index into sim_gpu.profiles */
    unsigned int start; /* placement: its first memory slice (size: the profile's place_size) */
} sim_gi;

enum { SIM_LINK_NONE = 0, SIM_LINK_GPU = 1, SIM_LINK_SWITCH = 2 };

/* How a GPU reports repaired memory: retired pages (before Ampere) or remapped rows. */
enum { SIM_REPAIR_PAGES = 1, SIM_REPAIR_ROWS = 2 };

/* A GPU's telemetry (telemetry.c): product defaults at init, then `telemetry` records. Memory
 * used is sim_gpu.mem_used. */
typedef struct {
    unsigned int gpu_util, mem_util;     /* % */
    unsigned int temperature_c;          /* NVML_TEMPERATURE_GPU */
    unsigned int power_mw, power_limit_mw;
    unsigned int sm_clock_mhz;           /* also the graphics clock */
    unsigned int mem_clock_mhz;
    unsigned long long throttle_reasons; /* nvmlClocksEventReason* bits */
    int repair;                          /* SIM_REPAIR_PAGES or SIM_REPAIR_ROWS */
    unsigned int retired_pending;        /* 0 or 1 */
    unsigned int remapped_correctable, remapped_uncorrectable, remapped_pending;
    unsigned int remapped_failed;        /* 0 or 1: a row remapping failed */
    unsigned int recovery_action;        /* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0 (none) to 7 */
    unsigned int delay_ms;               /* every telemetry getter sleeps this long first */
} sim_telemetry;

typedef struct {
    struct sim_handle h;
    char name[SIM_LEN_NAME];
    char uuid[SIM_LEN_NAME];
    char serial[SIM_LEN_SERIAL];
    int has_serial;
    unsigned int minor;
    sim_pci pci;
    int has_numa;
    int numa_node;
    uint64_t cpu_mask[SIM_CPU_WORDS];
    unsigned long long mem_total, mem_reserved, mem_used;
    int cc_major, cc_minor;
    int has_mp;
    unsigned int multiprocessors;
    int nlinks;
    int link_kind[SIM_MAX_LINKS];
    int link_target[SIM_MAX_LINKS];
    unsigned long long supported_events;
    int mig_capable, mig_mode, mig_pending;
    unsigned int mig_max;
    int nprofiles;
    sim_mig_profile profiles[SIM_MAX_MIG_PROFILES];
    unsigned int mem_slices, compute_slices; /* what placements divide (8 and 7 on A100) */
    int nmig;
    sim_mig migs[SIM_MAX_MIG]; /* MIG devices (compute instances), in handle-index order */
    sim_gi gis[SIM_MAX_MIG];   /* GPU instances, in slots (live ones) */
    unsigned int mig_made; /* instances made by `mig` control records (their UUIDs' seed) */
    int topo[SIM_MAX_GPUS]; /* common-ancestor level to each GPU */
    /* run-time state */
    int lost;
    unsigned long long hang_until_ns; /* CLOCK_MONOTONIC: every call on this GPU blocks until
                                       * then (a `hang` record); 0 or past: none */
    int events_unsupported;
    unsigned long long ecc_sbe, ecc_dbe;
    sim_telemetry telemetry;
} sim_gpu;

typedef struct {
    char name[SIM_LEN_NAME];
    char driver_version[SIM_LEN_VERSION];
    char nvml_version[SIM_LEN_VERSION];
    int cuda_version;
    int ngpus;
    sim_gpu gpus[SIM_MAX_GPUS];
    int nswitches;
    sim_pci switches[SIM_MAX_SWITCHES];
    /* start-up faults (profile `faults:` merged with GPU_AGENT_SIM_FAULTS) */
    int fault_init;                 /* 0 or the NVML code nvmlInit returns */
    uint64_t fault_events_unsupported; /* GPU index bitmask */
    uint64_t fault_lost;               /* GPU index bitmask */
} sim_node;

/* ---- YAML subset (yaml.c) ---- */

typedef enum { Y_NULL, Y_STR, Y_INT, Y_OTHER, Y_MAP, Y_SEQ } ytype;

typedef struct ynode {
    ytype type;
    int line;
    char *str;          /* scalars: the text (unescaped for quoted ones) */
    int quoted;
    int n;              /* maps and sequences: number of entries */
    char **keys;        /* maps only */
    int *key_lines;
    struct ynode **items;
} ynode;

/* Parse `path`; NULL on failure with a "file:line: problem" message in err. */
ynode *yaml_load_file(const char *path, char *err, size_t errlen);
void yaml_free(ynode *n);
ynode *yaml_get(const ynode *map, const char *key);
const char *yaml_type_name(ytype t);
/* Integer value of an int scalar (decimal, 0x hex, 0o/0 octal, 0b binary, '_' allowed). */
int yaml_int(const ynode *n, long long *out);
/* Record the first failure of a parse (the YAML reader's and the profile schema's): sets
 * *failed and writes "<where>: <message>" into err, `where` from where_fmt and its arguments,
 * the message from fmt and ap. Once *failed is set later failures are dropped: the first one
 * is the cause. */
void sim_vfail(char *err, size_t errlen, int *failed, const char *fmt, va_list ap,
               const char *where_fmt, ...)
    __attribute__((format(printf, 4, 0), format(printf, 6, 7)));

/* ---- profiles (profile.c) ---- */

/* Load the profile named by GPU_AGENT_SIM_PROFILE (or the default) and the start-up faults.
 * Returns 0, or an NVML code with a one-line message in err. */
int sim_profile_load(sim_node *node, char *err, size_t errlen);
int sim_parse_cpulist(const char *text, uint64_t *mask, char *err, size_t errlen);
int sim_parse_bus_id(const char *text, sim_pci *pci);
void sim_format_bus_id(const sim_pci *pci, char *out, size_t len, int legacy);

/* ---- global state (system.c) ---- */

extern pthread_mutex_t g_sim_lock;
extern int g_sim_init_count;
extern sim_node g_node;

/* ---- control channel and events (control.c) ---- */

/* Called with the lock held at the 0->1 init: sets up the control channel and replays state. */
int sim_control_start(char *err, size_t errlen);
/* Called with the lock held at the 1->0 shutdown. */
void sim_control_stop(void);
/* Append `record` (one `mig` record, no newline) to the control log with a token of this
 * process, then read the log up to it: returns what applying it made (a GPU instance slot, a MIG
 * device index, or 0 for a destroy), or -1 when it changed nothing (another process's record
 * came first and took the room). Without a control channel it is applied in this process only.
 * Lock held. */
int sim_control_commit(const char *record);
/* Read control records appended since the last call (lock held). */
void sim_control_ingest(void);
/* A record's unsigned value: decimal, 0x hex or 0 octal; -1 when it is not one. */
int sim_parse_u64(const char *s, unsigned long long *out);

/* ---- telemetry (telemetry.c) ---- */

/* Set the telemetry defaults of `g` from its product name and compute capability. */
void sim_telemetry_defaults(sim_gpu *g);
/* Apply a `telemetry` record's KEY=VALUE fields (the `gpu` key is skipped) to `g`, all or
 * nothing: an unknown key or a bad value changes nothing. Lock held. */
void sim_telemetry_apply(sim_gpu *g, char *const *keys, char *const *vals, int n);

/* ---- helpers for device.c and telemetry.c ---- */

/* Lock, check init, ingest, validate `device` and its lost state. On success the lock is
 * held and *gpu / *mig are set (mig NULL for a full GPU); on failure the lock is released. */
nvmlReturn_t sim_enter_device(nvmlDevice_t device, int out_ok, sim_gpu **gpu, sim_mig **mig);
nvmlReturn_t sim_enter(int out_ok);
/* With the lock held: when GPU `g` hangs now (a `hang` record), release the lock, sleep (until
 * the hang ends, or 20 ms) and return 1: the caller enters again, which reads the log (a
 * record may have ended the hang) and checks the GPU anew (it may be lost, or the library shut
 * down, meanwhile); else 0, the lock still held. */
int sim_hang_wait(const sim_gpu *g);
/* CLOCK_MONOTONIC now, in ns (the clock Python's time.monotonic_ns() reads on Linux). */
unsigned long long sim_now_ns(void);
/* Sleep until CLOCK_MONOTONIC reaches `until_ns` (signals do not cut it short). */
void sim_sleep_until_ns(unsigned long long until_ns);
/* Validate another handle while the lock is held (for calls taking two devices). */
nvmlReturn_t sim_lookup_device(nvmlDevice_t device, sim_gpu **gpu, sim_mig **mig);
/* Number GPU `gpu`'s MIG device handles after its instances changed (the handles of positions
 * past g->nmig become invalid), and its GPU and compute instance handles (live ones only). */
void sim_set_mig_handles(sim_gpu *g, int gpu);
/* sim_enter_device for any handle: `magic` says its kind, SIM_MAGIC_DEVICE (a device; *gi
 * NULL), SIM_MAGIC_GI (*gi: the GPU instance; *mig NULL) or SIM_MAGIC_CI (*gi: its GPU
 * instance, *mig: the MIG device that is the compute instance). gi may be NULL. */
nvmlReturn_t sim_enter_instance(struct sim_handle *h, uint32_t magic, int out_ok, sim_gpu **gpu,
                                sim_gi **gi, sim_mig **mig);

/* ---- MIG instances and placements (mig.c) ---- */

/* Derive GPU g's placements (each profile's place[] and place_size, g->mem_slices) from its
 * profiles. */
void sim_mig_placements(sim_gpu *g);
/* The GPU instance with id `id` (NULL: none). */
sim_gi *sim_gi_by_id(sim_gpu *g, unsigned int id);
/* Install migs[0..n) as GPU `gpu`'s MIG devices and rebuild its GPU instances from them (each
 * MIG device names its gi; the first one of a GPU instance gives its profile); with keep_empty
 * the GPU instances without a MIG device stay too. A GPU instance that was there keeps its slot
 * and, where it can, its placement; every GPU and compute instance gets a placement: the first
 * fit, trying the lowest starts for the instances in order. Returns 0, or -1 when they do not
 * fit (then nothing changes). */
int sim_mig_place_all(sim_gpu *g, int gpu, sim_mig *migs, int n, int keep_empty);
/* A new MIG device's UUID, derived from the GPU's UUID, the GI id and a per-GPU counter (the
 * same in every process that replays the log). */
void sim_mig_uuid(sim_gpu *g, unsigned int gi, char *out, size_t len);
/* Whether a GPU instance of profile index p fits at `start` (-1: anywhere): NVML_SUCCESS,
 * INVALID_ARGUMENT (not one of its placements) or INSUFFICIENT_RESOURCES. */
int sim_mig_gi_check(const sim_gpu *g, int p, long start);
/* Make a GPU instance of profile index p at `start` (-1: the lowest free one), no compute
 * instance: its slot, or -1 when it does not fit. */
int sim_mig_gi_create(sim_gpu *g, int gpu, int p, long start);
/* Destroy GPU instance `id`: 0, or -1 (none, or it has compute instances). */
int sim_mig_gi_destroy(sim_gpu *g, int gpu, unsigned int id);
/* Whether a compute instance of NVML compute instance profile `profile` fits GPU instance t at
 * `start` (-1: anywhere): NVML_SUCCESS, NOT_SUPPORTED (profile not offered), INVALID_ARGUMENT
 * (not one of its placements) or INSUFFICIENT_RESOURCES. */
int sim_mig_ci_check(const sim_gpu *g, const sim_gi *t, unsigned int profile, long start);
/* Make that compute instance (a MIG device, appended): its MIG device index, or -1. */
int sim_mig_ci_create(sim_gpu *g, int gpu, unsigned int gi, unsigned int profile, long start);
/* Destroy compute instance ci of GPU instance gi (and the GPU instance when with_gi and it has
 * no other): 0, or -1 when there is none. */
int sim_mig_ci_destroy(sim_gpu *g, int gpu, unsigned int gi, unsigned int ci, int with_gi);
/* The compute slices of compute instance profile `profile` in a GPU instance of `gs` slices; 0
 * when it does not offer it. */
unsigned int sim_ci_profile_slices(unsigned int profile, unsigned int gs);
/* The compute instance profile constant with `slices` compute slices. */
unsigned int sim_ci_profile_of(unsigned int slices);
/* The compute slices of MIG device m (its compute instance). */
unsigned int sim_ci_slices(const sim_gpu *g, const sim_mig *m);
/* The placement starts of a compute instance of `size` slices in a GPU instance of `gi_slices`
 * slices, into starts[] (at most SIM_MAX_CI); returns how many. */
unsigned int sim_ci_placements(unsigned int size, unsigned int gi_slices, unsigned int *starts);
SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result);
void sim_leave(void);
nvmlReturn_t sim_copy_string(char *dst, unsigned int len, const char *src);

/* Return the error of `call`, an enter function (which releases the lock when it fails). */
#define TRY_ENTER(call) \
    do { \
        nvmlReturn_t enter_rc = (call); \
        if (enter_rc) \
            return enter_rc; \
    } while (0)

/* Release the lock and return rc. */
#define DONE(rc) do { sim_leave(); return (rc); } while (0)

#endif
