"""gpu-agent: a Kubernetes GPU device plugin that runs as a host service.

This package owns the version and one process-wide setting that must precede any gRPC import:
gRPC's fork support is off unless the operator turned it on. The agent forks only to exec
(pyinotify runs `ldconfig -p` through ctypes.util.find_library); with fork support on, grpcio
1.80 (the newest for Python 3.9) runs its fork handlers around that and can abort the agent
("epoll_wait error: Bad file descriptor", grpc/grpc#43055). Nothing here may import grpc or
the compiled extensions, so that `gpu-agent --help` works on a broken build.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
