"""A process that serves gRPC and then forks to exec (as the agent does through pyinotify's
`ldconfig -p`) must not disturb gRPC or the child. grpcio 1.80, the newest on Python 3.9,
enables its fork handlers by default and aborts some children or the server; importing
`agent` turns them off."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap

SCRIPT = textwrap.dedent("""
    import subprocess, sys
    from concurrent.futures import ThreadPoolExecutor
    import agent  # must come before grpc: it sets the process's gRPC fork policy
    import grpc
    sock = sys.argv[1]
    server = grpc.server(ThreadPoolExecutor(2))
    server.add_insecure_port("unix:" + sock)
    server.start()
    channel = grpc.insecure_channel("unix:" + sock)
    grpc.channel_ready_future(channel).result(timeout=10)
    bad = [r for r in (subprocess.run(["/bin/true"], capture_output=True) for _ in range(200))
           if r.returncode != 0 or r.stderr]
    grpc.channel_ready_future(channel).result(timeout=10)  # still serving
    server.stop(0)
    print("children that failed:", len(bad))
""")


def test_forking_to_exec_in_a_grpc_process_is_clean():
    with tempfile.TemporaryDirectory(prefix="gafork") as tmp:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, f"{tmp}/s.sock"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "children that failed: 0" in proc.stdout
    assert "fork() handlers" not in proc.stderr  # gRPC ran no fork handlers at all
