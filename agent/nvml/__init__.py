"""The only code that talks to NVML (through pynvml): loading the library, discovery, topology,
MIG, and turning NVML failures into `agent.errors.NvmlError`.

Must not import grpc or anything of `agent.kubelet`/`agent.rm`.
"""
