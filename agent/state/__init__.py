"""The allocation state: what Allocate handed out, kept in an append-only journal in the state
directory, and matched to kubelet's pods.

Owns: the record schema and the old single-file checkpoint (`checkpoint`), the journal's
framing (`frames`), what the journal finds at start (`loading`), the journal that records
every Allocate before it answers, syncs, compacts and copes with a failing disk (`journal`),
the reconciliation rules as plain data
(`reconcile`), the thread that applies them from kubelet's podresources (`reconciler`), the
daemon's `AllocationState` and its status lines (`allocations`), and `gpu-agent state show`
(`cli`). Must not import grpc or NVML code: the podresources client (agent.kubelet.podresources)
is handed in by agent.daemon. See docs/state.md.
"""
