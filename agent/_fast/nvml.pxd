# The slice of the NVML C ABI that agent._fast calls, declared from the facts of the public ABI
# (types, struct layouts, return codes, symbol names and signatures). Declarations only, no
# logic: the library is opened at run time with dlopen() and each symbol resolved with dlsym()
# into a pointer of one of the function types below, so nothing links against the driver.

# nvmlReturn_t: an int-sized enum; the codes we act on by value (the rest are only reported).
ctypedef int nvmlReturn_t

cdef enum:
    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_GPU_IS_LOST = 15

# Buffer size for nvmlDeviceGetUUID (NVML_DEVICE_UUID_V2_BUFFER_SIZE).
cdef enum:
    NVML_DEVICE_UUID_V2_BUFFER_SIZE = 96

# Opaque handles (pointers to structs NVML never shows).
ctypedef void* nvmlDevice_t
ctypedef void* nvmlEventSet_t

# nvmlEventData_t, as nvmlEventSetWait_v2 fills it.
ctypedef struct nvmlEventData_t:
    nvmlDevice_t device
    unsigned long long eventType
    unsigned long long eventData
    unsigned int gpuInstanceId
    unsigned int computeInstanceId

# Function types of the symbols we resolve. All are plain C: none can raise, none needs the GIL.
ctypedef nvmlReturn_t (*nvmlInit_v2_fn)() noexcept nogil
ctypedef nvmlReturn_t (*nvmlShutdown_fn)() noexcept nogil
ctypedef nvmlReturn_t (*nvmlDeviceGetHandleByIndex_v2_fn)(
    unsigned int index, nvmlDevice_t* device) noexcept nogil
ctypedef nvmlReturn_t (*nvmlDeviceGetIndex_fn)(
    nvmlDevice_t device, unsigned int* index) noexcept nogil
ctypedef nvmlReturn_t (*nvmlDeviceGetUUID_fn)(
    nvmlDevice_t device, char* uuid, unsigned int length) noexcept nogil
ctypedef nvmlReturn_t (*nvmlDeviceGetSupportedEventTypes_fn)(
    nvmlDevice_t device, unsigned long long* eventTypes) noexcept nogil
ctypedef nvmlReturn_t (*nvmlDeviceRegisterEvents_fn)(
    nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) noexcept nogil
ctypedef nvmlReturn_t (*nvmlEventSetCreate_fn)(nvmlEventSet_t* set) noexcept nogil
ctypedef nvmlReturn_t (*nvmlEventSetWait_v2_fn)(
    nvmlEventSet_t set, nvmlEventData_t* data, unsigned int timeoutms) noexcept nogil
ctypedef nvmlReturn_t (*nvmlEventSetFree_fn)(nvmlEventSet_t set) noexcept nogil
