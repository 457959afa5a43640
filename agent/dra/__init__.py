"""gpu-agent as a Dynamic Resource Allocation driver for GPUs (`gpu.nvidia.com`): the devices
it publishes in ResourceSlices (slices.py). See docs/architecture.md."""
