"""tests/gpu holds checks for machines with a real NVIDIA GPU, run by hand: never collected."""

collect_ignore_glob = ["*.py"]
