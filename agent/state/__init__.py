"""Allocation checkpoints kept as msgpack files in the state directory.

Owns: the checkpoint format (`checkpoint`), the journal that records every Allocate durably
and loads, sets aside and rewrites the file (`journal`), the reconciliation rules that match
records to pods as plain data (`reconcile`), and `gpu-agent state show` (`cli`). Must not
import grpc or NVML code: it stores, loads and judges records; agent.kubelet.podresources
asks kubelet, agent.daemon wires it in. See docs/state.md.
"""
