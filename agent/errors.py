"""The exception hierarchy of gpu-agent, shared by the Python and the Cython code.

Owns: every exception type of the agent (those it raises on purpose, and `InvalidValue`, which
the config value kinds raise and agent.config turns into a ConfigError), and the one function
that turns an NVML return code into an exception (`nvml_error`). The simulator's own errors
live in agent.sim. Must not import anything of `agent`, so that `agent._fast` (compiled or
pure) can depend on it alone.
"""

from __future__ import annotations

# NVML return codes (nvml.h, nvmlReturn_t). Names without the NVML_ERROR_ prefix.
NVML_SUCCESS = 0
NVML_RETURN_NAMES = {
    0: "SUCCESS",
    1: "UNINITIALIZED",
    2: "INVALID_ARGUMENT",
    3: "NOT_SUPPORTED",
    4: "NO_PERMISSION",
    5: "ALREADY_INITIALIZED",
    6: "NOT_FOUND",
    7: "INSUFFICIENT_SIZE",
    8: "INSUFFICIENT_POWER",
    9: "DRIVER_NOT_LOADED",
    10: "TIMEOUT",
    11: "IRQ_ISSUE",
    12: "LIBRARY_NOT_FOUND",
    13: "FUNCTION_NOT_FOUND",
    14: "CORRUPTED_INFOROM",
    15: "GPU_IS_LOST",
    16: "RESET_REQUIRED",
    17: "OPERATING_SYSTEM",
    18: "LIB_RM_VERSION_MISMATCH",
    19: "IN_USE",
    20: "MEMORY",
    21: "NO_DATA",
    22: "VGPU_ECC_NOT_SUPPORTED",
    23: "INSUFFICIENT_RESOURCES",
    24: "FREQ_NOT_SUPPORTED",
    25: "ARGUMENT_VERSION_MISMATCH",
    26: "DEPRECATED",
    27: "NOT_READY",
    28: "GPU_NOT_FOUND",
    29: "INVALID_STATE",
    999: "UNKNOWN",
}
NVML_CODES = {name: code for code, name in NVML_RETURN_NAMES.items()}


class AgentError(Exception):
    """Base of every error the agent raises on purpose; `main()` prints these without a trace."""

    exit_code = 1


class ConfigError(AgentError):
    """A configuration value is wrong. The message names the key path and the file."""

    exit_code = 2

    def __init__(self, key: str, problem: str, source: str = ""):
        self.key = key
        self.problem = problem
        self.source = source
        where = f" ({source})" if source else ""
        super().__init__(f"{key}: {problem}{where}")


class InvalidValue(ValueError):
    """One config value is wrong (raised by agent.config.kinds, which know no keys).
    `subkey` (e.g. "[2]") is appended to the caller's key in the ConfigError it becomes."""

    def __init__(self, problem: str, subkey: str = ""):
        super().__init__(problem)
        self.problem = problem
        self.subkey = subkey


class MpsError(AgentError):
    """An MPS control daemon could not be started, reached or told something
    (agent.mps); the message says which GPU and what the program said."""


class InitError(AgentError):
    """NVML or discovery failed at start with failOnInitError true (exit 1)."""


class MigLayoutError(AgentError):
    """The node's MIG layout does not fit the MIG strategy (NVIDIA's rules and messages,
    agent.rm.devices); the agent exits at start whatever failOnInitError says, as NVIDIA's
    plugin does, and refuses a reload to it."""


class NvmlError(AgentError):
    """An NVML call returned something other than NVML_SUCCESS."""

    def __init__(self, code: int, function: str = ""):
        self.code = code
        self.name = NVML_RETURN_NAMES.get(code, f"code {code}")
        self.function = function
        prefix = f"{function}: " if function else ""
        super().__init__(f"{prefix}NVML_ERROR_{self.name}")

    @property
    def is_timeout(self) -> bool:
        return self.code == NVML_CODES["TIMEOUT"]

    @property
    def is_not_supported(self) -> bool:
        return self.code == NVML_CODES["NOT_SUPPORTED"]

    @property
    def is_gpu_lost(self) -> bool:
        return self.code == NVML_CODES["GPU_IS_LOST"]


class NvmlNotAnswering(NvmlError):
    """A GPU's NVML call did not return within agent.nvml.guard's budget (it may still be
    running), or one still has not: the GPU is "NVML not answering". An NvmlError with NVML's
    own TIMEOUT code, so a caller that handles NVML failures handles this one too."""

    def __init__(self, gpu: object, function: str, budget_s: float, since_s: float = 0.0):
        self.gpu = gpu
        self.budget_s = budget_s
        super().__init__(NVML_CODES["TIMEOUT"], function)
        waited = (f"a call has not returned for {since_s:.1f} s" if since_s > budget_s
                  else f"no answer within {budget_s:g} s")
        self.args = (f"{function}: NVML not answering on GPU {gpu} ({waited})",)


class NvmlLibraryError(AgentError):
    """The NVML shared library could not be opened or lacks a function we need."""


class SimError(AgentError):
    """The simulated GPU node was asked for something it cannot do (bad profile, bad GPU)."""

    exit_code = 2


class RequestError(AgentError):
    """A kubelet request the agent refuses (unknown, duplicate or no device IDs, too many).

    The gRPC layer answers it with INVALID_ARGUMENT and this message, and keeps serving.
    """


class RegistrationError(AgentError):
    """kubelet did not accept the registration (not there, refused, or timed out)."""


class PodResourcesError(AgentError):
    """podresources could not be asked. `kind`: "missing" (no socket), "unimplemented" (a
    kubelet without that v1 method), "unavailable" (not answering) or "error"."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


class KubeApiError(AgentError):
    """The Kubernetes API could not be reached, or refused a request (agent.kubeapi): the
    message says which request and why; `code` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class ClaimError(AgentError):
    """A DRA claim that cannot be prepared as asked (kubelet shows it in the pod's events)."""


class IsolationError(AgentError):
    """The isolation file is malformed (the previous set stays in force)."""


class StateError(AgentError):
    """A checkpoint could not be read or written."""


class CheckpointError(StateError):
    """A checkpoint that cannot be used. `kind`: "truncated", "corrupt", "version" or
    "unreadable"; the message says what is wrong and where."""

    def __init__(self, kind: str, problem: str):
        self.kind = kind
        self.problem = problem
        super().__init__(problem)


def nvml_error(code: int, function: str = "") -> NvmlError:
    """Return the exception for NVML return `code`; the one place codes become exceptions."""
    return NvmlError(int(code), function)


def check_nvml(code: int, function: str = "") -> None:
    """Raise `nvml_error(code)` unless `code` is NVML_SUCCESS."""
    if code != NVML_SUCCESS:
        raise nvml_error(code, function)
