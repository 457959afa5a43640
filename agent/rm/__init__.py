"""Resource managers: the device model, resource naming, sharing and allocation policy.

Must not import grpc; it talks to NVML only through `agent.nvml`.
"""
