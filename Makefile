# gpuslice: developer, CI and install targets. `make help` lists them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PREFIX ?= /usr/local
DESTDIR ?=
SYSCONFDIR ?= /etc
PURGE ?=
# Optional: a pynvml.py to install next to the package (test beds without nvidia-ml-py).
PYNVML ?=

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

LIBDIR := $(PREFIX)/lib/gpuslice
PYDIR := $(LIBDIR)/python
UNITDIR := $(PREFIX)/lib/systemd/system
GENDIR := $(PREFIX)/lib/systemd/system-generators
USERGENDIR := $(PREFIX)/lib/systemd/user-generators
EXAMPLEDIR := $(LIBDIR)/examples
BUSCONFDIR := $(SYSCONFDIR)/dbus-1/system.d
SYSUSERSDIR := $(PREFIX)/lib/sysusers.d
# While `make uninstall` runs, any start of gpuslice.service is skipped (debian/gpuslice.prerm)
REMOVAL_DROPIN_DIR := /run/systemd/system/gpuslice.service.d
REMOVAL_DROPIN := $(REMOVAL_DROPIN_DIR)/gpuslice-removal.conf
# The default config shipped to /etc/gpuslice/config.yaml (top level, else data/).
CONFIG ?= $(or $(wildcard config.yaml),$(wildcard data/config.yaml),config.yaml)

.PHONY: help venv lint fuzz bed-deps bed test demo install uninstall install-examples uninstall-examples clean bench \
	deb deb-deps
.PHONY: mutate mutate-report

help:
	@echo "make venv | lint | test | demo | bench | deb | bed-deps | bed | clean"
	@echo "make install | uninstall | install-examples  (root; PREFIX=$(PREFIX) DESTDIR= SYSCONFDIR=$(SYSCONFDIR))"

# ---------------------------------------------------------------- development

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

lint: venv
	$(VENV)/bin/ruff check gpuslice tests bench
	$(VENV)/bin/ruff format --check gpuslice tests bench
	$(VENV)/bin/mypy

# Tools for the container test bed (tests/bed); apt only when something is missing.
bed-deps:
	@if ! command -v systemd-nspawn >/dev/null || ! command -v mmdebstrap >/dev/null \
	    || ! command -v zstd >/dev/null || ! command -v dbus-daemon >/dev/null; then \
	    set -x; apt-get update && apt-get install -y systemd-container mmdebstrap zstd dbus-daemon; \
	fi

# Build/unpack the cached container tree (tests/bed) before pytest, outside its per-test timeout.
bed: venv bed-deps
	$(VENV)/bin/python -m tests.bed.container

test: venv bed-deps
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory bed
	$(VENV)/bin/pytest tests

# Property tests (tests/test_fuzz_*.py) with 10000 examples each; `make test` runs 200.
fuzz: venv
	GPUSLICE_HYPOTHESIS=explore GPUSLICE_FUZZ_EXAMPLES=10000 $(VENV)/bin/pytest tests/test_fuzz_*.py tests/test_core_properties.py tests/test_core_renumber_properties.py tests/test_core_instance_properties.py -q -p no:cacheprovider -o timeout=0

demo: venv bed-deps
	$(VENV)/bin/python -m tests.bed.demo

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find gpuslice tests -name __pycache__ -type d -prune -exec rm -rf {} +

# ---------------------------------------------------------------- install (root, systemd host)
# Writes only below $(DESTDIR): the source tree may be read-only (the test bed mounts it so).

install:
ifeq ($(DESTDIR),)
	@# Two copies would share gpuslice.service: systemd takes this one (/usr/local/lib before
	@# /usr/lib), and the package's upgrades would restart it and its removal stop it, its own
	@# code never run. A package removed but not purged (config-files) is no copy.
	@status=$$(dpkg-query -W -f='$${Status}' gpuslice 2>/dev/null || true); \
	case "$${status##* }" in \
	    '' | not-installed | config-files) ;; \
	    *) echo "make install: the gpuslice Debian package is installed ($$status): upgrade" \
	        "it with \`make deb\` and \`apt install ./build/deb/gpuslice_VERSION_all.deb\`," \
	        "or \`apt remove gpuslice\` first" >&2; exit 1 ;; \
	esac
endif
	@for f in units/gpuslice.service units/gpuslice-metrics.socket units/gpuslice-metrics@.service \
	    units/gpuslice-claim@.service data/gpuslice-user-generator data/gpuslice-metrics.sysusers \
	    data/gpuslice-gate data/org.gpuslice.Scheduler1.conf data/gpuslice.in data/gpuslice-generator.in $(CONFIG); do \
	    test -e "$$f" || { echo "make install: missing $$f" >&2; exit 1; }; done
	rm -rf $(DESTDIR)$(PYDIR)/gpuslice
	find gpuslice -name '*.py' -type f | while read -r f; do \
	    install -D -m 644 "$$f" "$(DESTDIR)$(PYDIR)/$$f"; done
ifneq ($(PYNVML),)
	install -D -m 644 $(PYNVML) $(DESTDIR)$(PYDIR)/pynvml.py
endif
	install -D -m 755 data/gpuslice-gate $(DESTDIR)$(LIBDIR)/gpuslice-gate
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(GENDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(BUSCONFDIR)
	sed 's|@PYDIR@|$(PYDIR)|g' data/gpuslice.in > $(DESTDIR)$(PREFIX)/bin/gpuslice
	chmod 755 $(DESTDIR)$(PREFIX)/bin/gpuslice
	sed 's|@PYDIR@|$(PYDIR)|g' data/gpuslice-generator.in > $(DESTDIR)$(GENDIR)/gpuslice-generator
	chmod 755 $(DESTDIR)$(GENDIR)/gpuslice-generator
	# user units (systemctl --user) are not scheduled: this says so in their journal
	install -D -m 755 data/gpuslice-user-generator $(DESTDIR)$(USERGENDIR)/gpuslice-user-generator
	sed 's|@PREFIX@|$(PREFIX)|g' units/gpuslice.service > $(DESTDIR)$(UNITDIR)/gpuslice.service
	chmod 644 $(DESTDIR)$(UNITDIR)/gpuslice.service
	# the optional metrics exporter: installed, never enabled here
	install -m 644 units/gpuslice-metrics.socket $(DESTDIR)$(UNITDIR)/
	sed 's|@PREFIX@|$(PREFIX)|g' units/gpuslice-metrics@.service \
	    > $(DESTDIR)$(UNITDIR)/gpuslice-metrics@.service
	chmod 644 $(DESTDIR)$(UNITDIR)/gpuslice-metrics@.service
	install -D -m 644 data/gpuslice-metrics.sysusers $(DESTDIR)$(SYSUSERSDIR)/gpuslice-metrics.conf
	# a GPU claimed for work gpuslice does not run (a Slurm prolog's): started by whoever claims
	install -m 644 'units/gpuslice-claim@.service' $(DESTDIR)$(UNITDIR)/
	install -m 644 data/org.gpuslice.Scheduler1.conf $(DESTDIR)$(BUSCONFDIR)/
	@if [ -e $(DESTDIR)$(SYSCONFDIR)/gpuslice/config.yaml ]; then \
	    echo "keeping $(DESTDIR)$(SYSCONFDIR)/gpuslice/config.yaml"; \
	else install -D -m 644 $(CONFIG) $(DESTDIR)$(SYSCONFDIR)/gpuslice/config.yaml; fi
ifeq ($(DESTDIR),)
	# byte-compiled here, as py3compile does for the package: the controller cannot write
	# __pycache__ itself (ProtectSystem=strict), and compiled its modules at every start
	# (READY=1 in the test bed: 533 ms without the compiled files, 461 ms with them)
	python3 -m compileall -q $(PYDIR)
	systemd-sysusers $(SYSUSERSDIR)/gpuslice-metrics.conf
	# left by an uninstall cut short, it would skip the start below
	rm -f $(REMOVAL_DROPIN)
	systemctl daemon-reload
	busctl call org.freedesktop.DBus / org.freedesktop.DBus ReloadConfig \
	    || systemctl reload dbus.service
	# restarted, not only started: run again over an earlier copy (an upgrade from a
	# checkout), `enable --now` left that copy's controller running, its old code beside
	# the new gate and drop-ins until the next reboot (the package's upgrade restarts it too)
	systemctl enable gpuslice.service
	systemctl restart gpuslice.service
endif

uninstall:
ifeq ($(DESTDIR),)
	# until the reload at the end shows gpuslice.service gone, no gated start may bring the
	# controller back (each gate's drop-in Wants= it): release-jobs would leave every unit
	# to it, and it would run on from removed files (debian/gpuslice.prerm does the same)
	mkdir -p $(REMOVAL_DROPIN_DIR) && printf '%s\n' '# Written by `make uninstall`.' \
	    '[Unit]' 'ConditionPathExists=!$(REMOVAL_DROPIN)' > $(REMOVAL_DROPIN)
	systemctl daemon-reload
	-systemctl disable --now gpuslice-metrics.socket
	-systemctl disable --now gpuslice.service
	# the controller stopped, nothing would thaw, resume or requeue a unit again: thaw those
	# it froze, resume those it suspended, name those left suspended or preempted
	# (debian/gpuslice.prerm does the same)
	-$(PREFIX)/bin/gpuslice release-jobs
endif
	rm -rf $(DESTDIR)$(PYDIR)
	rm -f $(DESTDIR)$(LIBDIR)/gpuslice-gate $(DESTDIR)$(PREFIX)/bin/gpuslice \
	    $(DESTDIR)$(GENDIR)/gpuslice-generator $(DESTDIR)$(UNITDIR)/gpuslice.service \
	    $(DESTDIR)$(USERGENDIR)/gpuslice-user-generator \
	    $(DESTDIR)$(UNITDIR)/gpuslice-metrics.socket $(DESTDIR)$(UNITDIR)/gpuslice-metrics@.service \
	    '$(DESTDIR)$(UNITDIR)/gpuslice-claim@.service' $(DESTDIR)$(SYSUSERSDIR)/gpuslice-metrics.conf \
	    $(DESTDIR)$(BUSCONFDIR)/org.gpuslice.Scheduler1.conf
	-rmdir --ignore-fail-on-non-empty $(DESTDIR)$(LIBDIR)
ifneq ($(PURGE),)
	rm -rf $(DESTDIR)$(SYSCONFDIR)/gpuslice $(DESTDIR)/var/lib/gpuslice \
	    $(DESTDIR)$(SYSCONFDIR)/systemd/system/.gpuslice.lock
endif
ifeq ($(DESTDIR),)
	rm -f $(REMOVAL_DROPIN)
	-rmdir --ignore-fail-on-non-empty $(REMOVAL_DROPIN_DIR)
	systemctl daemon-reload
	-busctl call org.freedesktop.DBus / org.freedesktop.DBus ReloadConfig
endif

# Example units (units/examples/*.service) and their programs (units/examples/bin/*); the
# Grafana dashboard (units/examples/grafana/*.json) goes to $(EXAMPLEDIR)/grafana.
install-examples:
	install -d $(DESTDIR)$(UNITDIR) $(DESTDIR)$(EXAMPLEDIR)
	@if compgen -G 'units/examples/*.service' >/dev/null; then \
	    for f in units/examples/*.service; do echo "install $$f"; \
	        sed 's|@PREFIX@|$(PREFIX)|g' "$$f" > "$(DESTDIR)$(UNITDIR)/$${f##*/}"; done; \
	else echo "make install-examples: WARNING: no units/examples/*.service, nothing installed"; fi
	@if compgen -G 'units/examples/bin/*' >/dev/null; then \
	    set -x; install -m 755 units/examples/bin/* $(DESTDIR)$(EXAMPLEDIR)/; \
	else echo "make install-examples: WARNING: no programs in units/examples/bin/"; fi
	@if compgen -G 'units/examples/grafana/*.json' >/dev/null; then \
	    set -x; install -d $(DESTDIR)$(EXAMPLEDIR)/grafana; \
	    install -m 644 units/examples/grafana/*.json $(DESTDIR)$(EXAMPLEDIR)/grafana/; \
	else echo "make install-examples: WARNING: no dashboard in units/examples/grafana/"; fi
ifeq ($(DESTDIR),)
	systemctl daemon-reload
endif

uninstall-examples:
	@for f in units/examples/*.service; do [ -e "$$f" ] || continue; \
	    n=$${f##*/}; \
	    if [ -z "$(DESTDIR)" ]; then systemctl disable --now "$$n" || true; fi; \
	    rm -f "$(DESTDIR)$(UNITDIR)/$$n"; done
	rm -rf $(DESTDIR)$(EXAMPLEDIR)
ifeq ($(DESTDIR),)
	systemctl daemon-reload
endif

# ---------------------------------------------------------------- Debian package
# `make deb` -> $(DEB_DIR)/gpuslice_VERSION_all.deb, lintian-checked (any error or warning fails).
# The build runs on a copy of the files the package needs, in $(DEB_DIR)/gpuslice, so the
# checkout stays clean and dpkg-buildpackage's outputs land in $(DEB_DIR). The pinned
# nvidia-ml-py wheel is downloaded here (debian/nvidia-ml-py.sha256 names it and its checksum)
# so that the package build itself needs no network.
DEB_DIR ?= build/deb
PYNVML_WHEEL_DIR ?= $(DEB_DIR)/wheels
DEB_BUILD_DEPS := dpkg-dev debhelper dh-python help2man lintian python3-pip \
	python3-click python3-dbus-next python3-prometheus-client python3-sdnotify python3-yaml
DEB_SOURCES := Makefile pyproject.toml gpuslice data units debian $(CONFIG)
DEB_VERSION = $(shell sed -n '1s/^[^(]*(\([^)]*\)).*/\1/p' debian/changelog)
PYNVML_WHEEL = $(lastword $(shell cat debian/nvidia-ml-py.sha256))
PYNVML_PIN = $(word 2,$(subst -, ,$(PYNVML_WHEEL)))

deb-deps:
	@missing=$$(for p in $(DEB_BUILD_DEPS); do \
	    dpkg-query -W -f='$${Status}\n' "$$p" 2>/dev/null | grep -q 'ok installed' || echo "$$p"; \
	done); \
	if [ -n "$$missing" ]; then set -x; apt-get update \
	    && apt-get install -y --no-install-recommends $$missing; fi

deb: deb-deps
	mkdir -p $(PYNVML_WHEEL_DIR)
	cd $(PYNVML_WHEEL_DIR) && if ! sha256sum --check --strict --status $(CURDIR)/debian/nvidia-ml-py.sha256 2>/dev/null; then \
	    rm -f $(PYNVML_WHEEL); \
	    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest . \
	        'nvidia-ml-py==$(PYNVML_PIN)'; \
	    sha256sum --check --strict $(CURDIR)/debian/nvidia-ml-py.sha256; fi
	rm -rf $(DEB_DIR)/gpuslice $(DEB_DIR)/gpuslice_*
	mkdir -p $(DEB_DIR)/gpuslice
	cp -a $(DEB_SOURCES) $(DEB_DIR)/gpuslice/
	find $(DEB_DIR)/gpuslice -name __pycache__ -type d -prune -exec rm -rf {} +
	cd $(DEB_DIR)/gpuslice && PYNVML_WHEEL_DIR=$(abspath $(PYNVML_WHEEL_DIR)) \
	    dpkg-buildpackage -us -uc -b
	lintian --fail-on error,warning --info $(DEB_DIR)/gpuslice_$(DEB_VERSION)_all.deb
	@ls -l $(DEB_DIR)/gpuslice_$(DEB_VERSION)_all.deb

# ---------------------------------------------------------------- mutation testing (not part of `make test`)
# `make mutate [MUTATE=core|adapters|controller|outer|all]`: mutmut (pinned in the test extras, configured in
# pyproject.toml [tool.mutmut]) breaks the chosen modules on purpose, one mutant at a time, and
# runs the fast tests that reach the broken function (one worker: the CPU is shared). Prints
# killed/survived/hung per module (a mutant that hangs or crashes the test run is caught);
# fails while a survivor is not listed, with why it changes nothing observable, in
# tests/mutation-equivalent.txt. Results are kept in mutants/ (ignored);
# MUTATE_KEEP=1 keeps its stats cache (every chosen mutant runs again). The default, all, is
# the core, the adapters and the controller (the core alone, 2,923 mutants, took 57 minutes on a 2-core VM);
# MUTATE=adapters runs only the validating adapters: the parsers, the generator, the status
# JSON and table, the gate's pipes, the reader of units' signals, the tracker of systemd's
# word, whose a foreign process is (owners.py), the reader of regular files (safefile.py),
# and of inventory.py only the attribution of GPU processes to units. A selection is mutmut's names, globs allowed (`*` for the `ǁ` of a
# method). To add an adapter: put its file in only_mutate and its
# fast tests in pytest_add_cli_args_test_selection ([tool.mutmut]), and its module in
# MUTATE_adapters.
MUTATE ?= all
MUTATE_KEEP ?=
MUTATE_core := gpuslice.core.model.* gpuslice.core.placement.* gpuslice.core.scheduler.* \
	gpuslice.core.decisions.* gpuslice.core.plan.*
MUTATE_adapters := gpuslice.sizes.* gpuslice.annotations.* gpuslice.starttimeout.* \
	gpuslice.unitfiles.* \
	gpuslice.config.* gpuslice.state.* gpuslice.generator.* gpuslice.cgroups.* gpuslice.status.* \
	gpuslice.inventory.x_command_of__mutmut_* gpuslice.inventory.x*Sample*used_by__mutmut_* \
	gpuslice.inventory.x*Inventory*_managed__mutmut_* \
	gpuslice.inventory.x*Inventory*_build__mutmut_* \
	gpuslice.inventory.x*Inventory*_still_releasing__mutmut_* \
	gpuslice.inventory.x*Inventory*reattribute__mutmut_* gpuslice.inventory.x__attributed__mutmut_* \
	gpuslice.inventory.x__with_foreign__mutmut_* gpuslice.inventory.x__guessed__mutmut_* \
	gpuslice.gatepipes.* gpuslice.busread.* gpuslice.tracker.* gpuslice.owners.* gpuslice.envfiles.* \
	gpuslice.safefile.* gpuslice.rereads.* gpuslice.envsafety.* gpuslice.envsyntax.* gpuslice.ladder.* \
	gpuslice.checkpoint.*
# the controller (the composition root: wiring, gates, calls to systemd, its journal lines,
# run()): 1,698 mutants, ~25 minutes on two workers, longer on one; with it, the answers to
# status's readers it was split from (answers.py), what it keeps of template instances and
# when it lets go (instances.py), when config.yaml is read again (reloads.py), its calls to
# systemd that queue a job, sent again (calls.py), a grant's way to its gate, the env file
# first (delivery.py), start-up's restore of the saved state against what systemd shows
# (restore.py), the rescans after a daemon-reload with the starts they hold back
# (rescans.py), what a gate that asks is answered (gates.py) and the starts queued it waits
# for (queued.py), whether a released `RemainAfterExit=yes` unit has processes left
# (remains.py), and how a run ended that a bare `auto-restart` told (restartresult.py)
MUTATE_controller := gpuslice.controller.* gpuslice.calls.* gpuslice.delivery.* \
	gpuslice.restore.* gpuslice.rescans.* gpuslice.gates.* gpuslice.queued.* \
	gpuslice.answers.* gpuslice.instances.* gpuslice.reloads.* gpuslice.remains.* \
	gpuslice.restartresult.*
# the adapters to the outside world: systemd's bus, NVML and the driver's arrival, the GPU
# watcher and the whole inventory, `gpuslice new`, the metrics and their exporter, the
# journal's lines and sd_notify, gpuslice's own D-Bus interface and who calls it, the
# journal's word of stop jobs (journalctl), the `gpuslice` command's own code (each click command hands
# its work to a plain function: mutmut mutates no decorated one)
MUTATE_outer := gpuslice.systemd.* gpuslice.nvml.* gpuslice.driver.* gpuslice.gpuwatch.* \
	gpuslice.inventory.* gpuslice.newunit.* gpuslice.metrics.* gpuslice.exporter.* \
	gpuslice.journal.* gpuslice.notify.* gpuslice.counters.* gpuslice.offloop.* gpuslice.cli.* \
	gpuslice.procmount.* gpuslice.service.* gpuslice.callers.* gpuslice.stopjournal.* \
	gpuslice.clock.*
MUTATE_all := $(MUTATE_core) $(MUTATE_adapters) $(MUTATE_controller) $(MUTATE_outer)
MUTATE_EQUIVALENT := tests/mutation-equivalent.txt
# Address space of each process of the run (KiB): a mutant that makes a loop append for ever
# fails there with MemoryError (a kill), where it grew to 16 GiB on a 24 GiB VM and the
# kernel's OOM killer ended the whole run (seen 2026-12-06); a run works under 8 GB (4 GB
# of address space was too little for mutmut's own process here).
MUTATE_VMEM_KB ?= 8000000
mutate: venv
	@test -n "$(MUTATE_$(MUTATE))" || { echo "make mutate: MUTATE=$(MUTATE): no modules (core, adapters, controller, outer, all)" >&2; exit 2; }
	$(if $(MUTATE_KEEP),,rm -rf mutants)
	ulimit -v $(MUTATE_VMEM_KB); $(VENV)/bin/mutmut run --max-children 1 $(MUTATE_$(MUTATE))
	@$(MAKE) --no-print-directory mutate-report MUTATE=$(MUTATE)

# The summary of the last `make mutate` (mutants/), e.g. after rerunning some mutants by name
# with `.venv/bin/mutmut run NAME...`.
mutate-report: venv
	@test -n "$(MUTATE_$(MUTATE))" || { echo "make mutate-report: MUTATE=$(MUTATE): no modules" >&2; exit 2; }
	@$(VENV)/bin/mutmut results --all true | sed -n 's/^ *\([^ ]*\): \(.*\)$$/\1 \2/p' \
	    | awk -v eq=$(MUTATE_EQUIVALENT) -v want='$(MUTATE_$(MUTATE))' -f <(sed -n 's/^#awk //p' Makefile)
#awk BEGIN {
#awk     while ((getline line < eq) > 0) if (line ~ /^[a-z]/) { split(line, f, /[ :]/); equiv[f[1]] = 1 }
#awk     np = split(want, pats, " "); n = 0
#awk     for (i = 1; i <= np; i++) {
#awk         m = pats[i]; sub(/\.(\*|x[^.]*)$/, "", m); if (!(m in seen)) { seen[m] = 1; mods[++n] = m }
#awk         r = pats[i]; gsub(/\./, "[.]", r); gsub(/\*/, ".*", r); re[i] = "^" r "$"
#awk     }
#awk     mods[n + 1] = "total"
#awk }
#awk {
#awk     known = 0; for (i = 1; i <= np; i++) if ($1 ~ re[i]) known = 1; if (!known) next
#awk     m = $1; sub(/\.x[^.]*$/, "", m); s = $2 ($3 == "" ? "" : " " $3)
#awk     if (s == "survived" && ($1 in equiv)) s = "equivalent"
#awk     if (s == "segfault") s = "timeout"  # the mutant killed the test run (a loop eating memory): caught, like a hang
#awk     if (s != "killed" && s != "timeout" && s != "equivalent") left[++nl] = $1 " (" s ")"
#awk     c[m, s]++; c[m]++; c["total", s]++; c["total"]++
#awk }
#awk END {
#awk     printf "%-26s %7s %8s %7s %10s %5s %7s\n", "module", "killed", "survived", "hung", "equivalent", "other", "score"
#awk     for (i = 1; i <= n + 1; i++) {
#awk         m = mods[i]; k = c[m, "killed"]; t = c[m, "timeout"]; e = c[m, "equivalent"]; sv = c[m, "survived"]
#awk         tested = c[m] - e; score = tested ? sprintf("%6.1f%%", 100 * (k + t) / tested) : "     -"
#awk         printf "%-26s %7d %8d %7d %10d %5d %s\n", m, k, sv, t, e, c[m] - k - t - e - sv, score
#awk     }
#awk     for (i = 1; i <= nl; i++) print "not killed and not in " eq ": " left[i]
#awk     exit (nl > 0)
#awk }

# ---------------------------------------------------------------- benchmark (not part of `make test`)
# Boots the container bed, prints one table (gpuslice vs systemd's own floor), writes JSON to
# bench-results/. BENCH_ARGS=--quick for a short run (30 s idle window, fewer repetitions).
BENCH_ARGS ?=
bench: venv bed-deps
	$(MAKE) --no-print-directory bed
	$(VENV)/bin/python -m bench.run $(BENCH_ARGS)
