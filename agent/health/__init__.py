"""Per-GPU health state machine, fed by the NVML event loop in `agent._fast`.

Must not import grpc; it reports transitions, the kubelet layer decides what to send.
"""
