# Two entry points: `make run` and `make test`. Both create .venv when it is missing and are idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch is pinned here (not in pyproject) so pip takes the CPU wheel this machine class has on disk.
TORCH  := torch==2.13.0

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install $(TORCH)

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install -e '.[hf]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install -e '.[test]'
	touch $@

# The default job's data: a BPE tokenizer and token shards of the standard library's sources,
# made once and cached.
DATA   := runs/data/stdlib-bpe2k
$(DATA)/manifest.json: $(VENV)/.installed
	$(VENV)/bin/frugaltrain data tokenizer --vocab-size 2048 --max-bytes 4000000 --out $(DATA)-tokenizer --force
	$(VENV)/bin/frugaltrain data prepare --tokenizer $(DATA)-tokenizer --max-bytes 4000000 --out $(DATA) --force

# The default job beside DiLoCo, both over emulated links of LINK Mbit/s per worker: the rate
# at which DiLoCo's exchange (H = 16, this job's reference) takes about as long as its compute
# between exchanges on this project's 2-core machine (r about 1). Override: make run LINK=8
LINK   := 16
.PHONY: run test lint format clean
run: $(DATA)/manifest.json
	$(VENV)/bin/frugaltrain train --config examples/default.toml --link-mbit $(LINK) \
		--baseline diloco --baseline-set outer.H=16

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs
