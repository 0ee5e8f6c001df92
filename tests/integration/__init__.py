"""End-to-end tests in a booted systemd container (tests/bed)."""
