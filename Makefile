# Arena: `make demo` and `make test` do all set-up themselves on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo demo-rl test test-pkg proto proto-check clean bench

$(STAMP): pyproject.toml deploy/setup-host.sh
	bash deploy/setup-host.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,rl]'
	touch $(STAMP)

venv: $(STAMP)

## start the embedded stack, run a group of 4 quickstart rollouts end to end, print it, stop
demo: venv
	$(VENV)/bin/arena demo

## closed-loop RL: a tiny policy learns through the real stack (GRPO, policy server); prints the curve
demo-rl: venv
	$(PY) examples/grpo-loop/run.py

## the whole suite: unit, integration (real NATS, real sandboxes), end-to-end (services as processes)
test: venv
	$(VENV)/bin/pytest -q

## one package's tests, e.g. `make test-pkg PKG=rollout` (tests/ mirrors the packages)
test-pkg: venv
	$(VENV)/bin/pytest -q tests/$(PKG)

## regenerate proto/ from the msgspec schemas
proto: venv
	$(PY) -m arena_core.proto

proto-check: venv
	$(PY) -m arena_core.proto --check

clean:
	rm -rf .arena build *.egg-info
