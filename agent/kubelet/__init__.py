"""gRPC towards kubelet: one device-plugin server per resource, registration, podresources client.

Must never import `agent.nvml`: devices come from the resource managers in `agent.rm`.
"""
