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
 *   device.c   device, PCI, topology, NVLink, MIG and ECC queries
 */
#ifndef GPU_AGENT_SIM_H
#define GPU_AGENT_SIM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define SIM_EXPORT __attribute__((visibility("default")))

/* ---- NVML ABI (types as pynvml's ctypes declarations describe them) ---- */

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_UNKNOWN = 999,
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

/* Opaque handles: pointers to sim_handle (devices) and sim_eventset (event sets). */
typedef struct sim_handle *nvmlDevice_t;
typedef struct sim_eventset *nvmlEventSet_t;

/* nvmlPciInfo_t (the _v3 layout): legacy 16-byte bus id, ids, then the 32-byte bus id. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

/* Layout answered by the old nvmlDeviceGetPciInfo / _v2 names. */
typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved[4];
} nvmlPciInfoLegacy_t;

typedef struct {
    unsigned int version;
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
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
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;

#define SIM_GI_PROFILE_INFO_V2_VERSION \
    ((unsigned int)(sizeof(nvmlGpuInstanceProfileInfo_v2_t) | (2u << 24)))

/* ---- limits of the node model (profile.py enforces the same ones) ---- */

#define SIM_MAX_GPUS 64
#define SIM_MAX_LINKS 36        /* NVML_NVLINK_MAX_LINKS in current NVML */
#define SIM_MAX_MIG 16          /* MIG devices per GPU */
#define SIM_MAX_MIG_PROFILES 32 /* GPU instance profiles per GPU */
#define SIM_MAX_SWITCHES 64
#define SIM_MAX_CPUS 4096
#define SIM_CPU_WORDS (SIM_MAX_CPUS / 64)
#define SIM_NUM_GI_PROFILES 0x12 /* NVML_GPU_INSTANCE_PROFILE_COUNT */

#define SIM_LEN_NAME 96      /* device names, uuids, profile names (incl. NUL) */
#define SIM_LEN_SERIAL 30
#define SIM_LEN_VERSION 80
#define SIM_LEN_TEXT 1024    /* description, source */
#define SIM_LEN_MIG_NAME 32
#define SIM_LEN_CPULIST 1024

#define SIM_MAGIC_DEVICE 0x53494d44u /* "SIMD" */
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
} sim_mig_profile;

typedef struct {
    struct sim_handle h;
    unsigned int gi, ci;
    int profile; /* index into sim_gpu.profiles */
    char uuid[SIM_LEN_NAME];
} sim_mig;

enum { SIM_LINK_NONE = 0, SIM_LINK_GPU = 1, SIM_LINK_SWITCH = 2 };

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
    int nmig;
    sim_mig migs[SIM_MAX_MIG];
    int topo[SIM_MAX_GPUS]; /* common-ancestor level to each GPU */
    /* run-time state */
    int lost;
    int events_unsupported;
    unsigned long long ecc_sbe, ecc_dbe;
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
/* Read control records appended since the last call (lock held). */
void sim_control_ingest(void);

/* ---- helpers for device.c ---- */

/* Lock, check init, ingest, validate `device` and its lost state. On success the lock is
 * held and *gpu / *mig are set (mig NULL for a full GPU); on failure the lock is released. */
nvmlReturn_t sim_enter_device(nvmlDevice_t device, int out_ok, sim_gpu **gpu, sim_mig **mig);
nvmlReturn_t sim_enter(int out_ok);
/* Validate another handle while the lock is held (for calls taking two devices). */
nvmlReturn_t sim_lookup_device(nvmlDevice_t device, sim_gpu **gpu, sim_mig **mig);
SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result);
void sim_leave(void);
nvmlReturn_t sim_copy_string(char *dst, unsigned int len, const char *src);

#endif
