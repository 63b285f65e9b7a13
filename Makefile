# `make demo`: set up and run the main job.  `make test`: set up and run the tests.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradsync-installed
TVPTH  := $(VENV)/.gradsync-torchvision-pth
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
KJV    := /usr/lib/bible.data

.PHONY: setup data demo reproduce test docs clean

setup: $(STAMP) $(TVPTH) data

# torch is pinned explicitly: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all]'
	touch $@

# The torchvision wheel for torch 2.13 is CUDA-built: beside the CPU torch its import fails ("operator
# torchvision::nms does not exist") unless two operator schemas are defined first. A start-up hook
# (gradsync-torchvision.pth in the venv, gradsync.extras) defines them before whoever imports it first
# (Lightning, Transformers, a user), so any import order works.
$(TVPTH): $(STAMP) src/gradsync/extras.py
	$(PY) -m gradsync.extras --write-torchvision-pth
	touch $@

# Real datasets from Debian: Fashion-MNIST idx files and the King James Bible text.
data:
	@if [ ! -f $(FMNIST) ] || [ ! -f $(KJV) ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist bible-kjv-text >/dev/null; \
	  else echo "datasets missing: run 'sudo apt-get install dataset-fashion-mnist bible-kjv-text' or pass --data-dir" >&2; exit 1; fi; \
	fi

# The story in one table: time to the quality dense training reaches (its final test accuracy - 0.5 points) on 2
# emulated hosts at 5 Mbit/s, where dense all-reduce is communication-bound, for DDP (allreduce), torch's fp16 hook,
# torch's PowerSGD hook at its best rank in the 5-seed grid (8), gradsync's PowerSGD overlapped with backward (r=8)
# and --algorithm auto, which measures the job (each setting's error on its gradients, the best 3 timed on the
# network) and chooses; shown as "auto (chose X)". Under the recipe (2 epochs, one seed; docs/results.md has 5):
# steps to the target trained on loopback x iteration time measured on the emulated network over 3 interleaved
# rounds (gradsync sweep), a table + runs/demo/predicted-2x5mbit.png. Needs root (network namespaces and tc); about
# 10 minutes on 2 cores.
DEMO_ARGS ?= --algorithms allreduce,fp16,powersgd:matrix_approximation_rank=8,powersgd-overlap:matrix_approximation_rank=8,auto \
             --seeds 0 --hosts 2 --bandwidths 5 --epochs 2 --eval-every 39 --rounds 3
demo: setup
	$(VENV)/bin/gradsync sweep $(DEMO_ARGS) --out runs/demo

# Regenerate every results table of docs/results.md (raw JSON beside each table) under results/.
reproduce: setup
	$(PY) benchmarks/reproduce.py --out results

# The layers of .importlinter first (an upward import fails the run), then the suite on 2 pytest-xdist workers,
# which keep both cores busy (idle 4 % of a perf-sampled run; 3 or 4 workers were slower). An idle worker takes
# tests queued for the other (worksteal): 569 s here, 606 s with xdist's default scheduling.
test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q -n 2 --dist worksteal tests --durations=15

# The documentation site (docs/, mkdocs.yml; API reference from the docstrings) into site/; --strict makes a
# broken link or reference fail (tests/test_docs.py runs the same build).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs results build site *.egg-info
