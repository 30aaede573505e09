# `make demo` and `make test` work on a fresh machine: they build .venv and install
# everything first (torch pinned to 2.13.0 through constraints.txt, so no other package
# can pull a different, multi-GB build).
# Nothing is ever fetched from a model hub: pipelines load from local folders only.
export HF_HUB_OFFLINE := 1
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN    := runs/digits-dit
NPROC  ?= 2

.PHONY: demo test lint install clean docs

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# RUN=folder (default runs/digits-dit): the checkpoint there, resumed if a run was cut short, and
# the samples' PNG beside it (digits.png in its parent folder)
demo: $(STAMP)
	@if [ -f $(RUN)/train_state.json ]; then \
		$(VENV)/bin/tessera train --recipe digits-dit --nproc $(NPROC) --out $(RUN) --resume; \
	else \
		$(VENV)/bin/tessera train --recipe digits-dit --nproc $(NPROC) --out $(RUN); \
	fi
	$(VENV)/bin/tessera generate --model $(RUN) --digits 0123456789 --steps 20 --seed 0 --out $(dir $(RUN))digits.png

# two pytest workers (pytest-xdist), each test file whole on one, and every file that starts
# ranks in the test's process on the same one (tests/conftest.py: xdist groups), so the rank
# pools start once and multi-rank tests do not share the cores. On the Intel VM (2 cores),
# --dist loadfile: 912 s at 205255e, 938 and 1113 s with the precompiled kernel headers (the
# VM's speed moves); with the groups and larger pools as well: 847 s; `make test` 802 s at
# 99f8a41 and 928 s at fa814c5 (one test smaller). Add -n 0 to run serially.
test: $(STAMP)
	OMP_NUM_THREADS=2 $(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup tests

# the documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, page or
# API reference fails the build (tests/test_docs.py runs the same build in the suite)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs
