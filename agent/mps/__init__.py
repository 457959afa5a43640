"""MPS (sharing.mps): the control daemons the agent runs, one per shared GPU (daemons.py), and
how it talks to them through nvidia-cuda-mps-control (control.py)."""
