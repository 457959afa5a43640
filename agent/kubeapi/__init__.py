"""The agent's side of the Kubernetes API server: the fault events and the GPUHealthy node
condition (agent.kubeapi.faults), over a small client of the API (agent.kubeapi.client).

Owns: nothing but this package's layout. Must not be imported on the start path: the daemon
imports it only when a kubeconfig is configured, and its thread loads ssl, not the start.
"""
