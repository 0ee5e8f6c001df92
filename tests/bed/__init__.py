"""Container test bed: a real systemd booted with systemd-nspawn, for tests and the demo."""
