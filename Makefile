# sd3-cluster: `make demo` builds and checks a local cluster; `make test` runs everything CI runs.
# Both install their own prerequisites (as root on Debian 12 / Ubuntu 22.04 / 24.04).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

NODES ?= 3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# Podman settings of the local cluster, without editing the host's /etc/containers.
export CONTAINERS_CONF := $(CURDIR)/localcluster/containers.conf
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# promtool for the alert rules' unit tests lies in .cache/tools/bin (`make tools`).
TOOLS := .cache/tools
export PATH := $(CURDIR)/$(BIN):$(CURDIR)/$(TOOLS)/bin:$(PATH)
# The node image molecule scenarios boot (the tag is the hash of its recipe).
export SD3_NODE_IMAGE := $(shell bash localcluster/node-image.sh --print-tag)
# Molecule scenarios (each lists its own nodes), MOLECULE_JOBS at a time.
MOLECULE_JOBS ?= 2
SCENARIOS ?= $(sort $(notdir $(patsubst %/molecule.yml,%,$(wildcard molecule/*/molecule.yml))))
PLAYBOOKS := site.yml $(wildcard ansible/playbooks/*.yml)

.PHONY: help host-prereqs venv image workloads-image cluster-up cluster-down cluster-status demo \
        test test-full lint syntax unit unit-ansible unit-workloads tools container molecule e2e e2e-full clean

help: ## Show the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

host-prereqs: ## Install podman, runc, debootstrap (apt) and check the kernel (root)
	@bash localcluster/host-prereqs.sh

$(VENV)/.stamp: requirements.txt $(wildcard workloads/pyproject.toml)
	@echo "[venv] installing the pinned tools into $(VENV) (a few minutes the first time)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@$(BIN)/pip install -q -r requirements.txt
	@if [ -f workloads/pyproject.toml ]; then $(BIN)/pip install -q --no-deps -e workloads; fi
	@touch $@

venv: $(VENV)/.stamp ## Make the project virtualenv from requirements.txt

image: host-prereqs ## Build the node image (once per recipe)
	@bash localcluster/node-image.sh

workloads-image: image ## Build the sd3cluster image (workloads/Containerfile) on the node image, offline-friendly
	@bash workloads/container/build-local.sh

cluster-up: host-prereqs venv ## Start NODES podman nodes (default 3) and write inventories/local
	@$(PY) localcluster/cluster.py up --nodes $(NODES)

cluster-down: ## Remove the local cluster's containers and network (nothing else)
	@$(PY) localcluster/cluster.py down

cluster-status: ## List the local cluster's containers
	@$(PY) localcluster/cluster.py status

demo: host-prereqs venv ## The local cluster: cluster-up, site.yml, verify.yml, the report (NODES=3)
	@NODES=$(NODES) bash localcluster/demo.sh

# The scenarios CI runs: those that have passed whole (create to destroy) on this project's machine.
# `make test-full` runs every scenario and the whole-cluster end-to-end tests as well.
# Longest first (seconds in a CI rehearsal on a 2-core machine, two at a time: slurm 709, storage 416,
# inference 296, network 231, backup 228, gpu_stack 189, base 186, monitoring 153, firewall 98, storage_nfs 92,
# cloud_fs_client 65, preflight 40), so the two lanes end together instead of slurm starting late and running
# on alone.
CI_SCENARIOS ?= slurm storage inference network backup gpu_stack base monitoring firewall storage_nfs cloud_fs_client preflight

test: host-prereqs venv lint unit ## Everything CI runs
	@# The container test runs after the unit tests, never beside them: in two CI rehearsals with it beside
	@# unit-workloads, a 2-rank torchrun test's rank aborted at exit in gloo (none in the runs without).
	@$(MAKE) --no-print-directory container
	@$(MAKE) --no-print-directory molecule SCENARIOS="$(CI_SCENARIOS)"
	@$(MAKE) --no-print-directory e2e

test-full: host-prereqs venv lint unit container molecule e2e e2e-full ## Every scenario and the whole cluster end to end

lint: venv syntax ## yamllint (strict), ansible-lint (production), ruff
	@echo "[lint] yamllint"; $(BIN)/yamllint -s .
	@# Its syntax checks read the default inventory, which exists only once `make cluster-up` has written it;
	@# ansible.cfg makes an inventory that does not parse an error, which a syntax check does not need.
	@echo "[lint] ansible-lint"; ANSIBLE_INVENTORY_UNPARSED_FAILED=false ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED=false \
	  $(BIN)/ansible-lint -q --profile production
	@echo "[lint] ruff"; $(BIN)/ruff check .
	@echo "[lint] hadolint"; $(BIN)/hadolint workloads/Containerfile

syntax: venv ## ansible-playbook --syntax-check of every playbook
	@for p in $(PLAYBOOKS); do $(BIN)/ansible-playbook -i localhost, --syntax-check $$p >/dev/null \
	  || { echo "syntax error in $$p"; exit 1; }; done; echo "[lint] syntax of $(words $(PLAYBOOKS)) playbooks ok"

tools: $(TOOLS)/bin/promtool ## promtool from the distribution's prometheus package, unpacked (nothing installed)

$(TOOLS)/bin/promtool: localcluster/promtool.sh
	@bash localcluster/promtool.sh $(TOOLS)

unit: venv tools ## pytest: workloads, pulumi, inventory and preflight checks (no containers)
	@# Two pytest processes, side by side (each target's output printed whole when it ends): tests that import
	@# Ansible's module code patch sys.intern, which torch's compiler rejects; and the two take about as long.
	@$(MAKE) --no-print-directory -j2 --output-sync=target unit-ansible unit-workloads

unit-ansible: venv tools ## pytest: every test but the cluster, container and workloads ones
	@$(BIN)/pytest -q -m "not cluster and not container" --ignore=tests/workloads tests

unit-workloads: venv ## pytest: the sd3cluster package (training, generation, serving) on CPU
	@$(BIN)/pytest -q -m "not cluster and not container" tests/workloads

container: image venv ## Build the sd3cluster image on the node image; run --help, generate and serve from it
	@$(BIN)/pytest -q -m container tests/container

molecule: venv ## Every molecule scenario on podman nodes (create, converge, idempotence, verify)
	@$(PY) localcluster/cluster.py cache-up
	@bash localcluster/run-scenarios.sh $(MOLECULE_JOBS) $(SCENARIOS)

e2e: cluster-up ## The local cluster's own tests (SSH, host keys, cache, cluster-down) and the cluster tests
	@$(BIN)/pytest -q -m "cluster and not full" --ignore=tests/workloads tests

# In this order: site.yml converges the nodes the later tests use; the day-2 tests leave 3 nodes.
E2E_FULL_TESTS := tests/e2e/test_local_cluster.py tests/e2e/test_fault.py tests/e2e/test_generate_job.py \
                  tests/e2e/test_inference.py $(wildcard tests/e2e/test_day2.py)

e2e-full: cluster-up ## site.yml twice, verify.yml, a node killed during training, serving, day-2 playbooks
	@$(BIN)/pytest -q -s -m full $(E2E_FULL_TESTS)

clean: cluster-down ## Remove the local cluster and the virtualenv
	rm -rf $(VENV) .cache
