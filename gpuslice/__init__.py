"""gpuslice: a systemd-native priority scheduler for GPU jobs on one host."""

__version__ = "0.1.0"
