"""Allocation checkpoints kept as msgpack files in the state directory.

Must not import grpc or NVML code: it stores and loads records, nothing else.
"""
