"""gpu-agent: a Kubernetes GPU device plugin that runs as a host service.

This package owns nothing by itself beyond the version; see the sub-packages. It must import
without the compiled extensions so that `gpu-agent --help` works on a broken build.
"""

__version__ = "0.1.0"
