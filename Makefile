# Every target installs what it needs into $(VENV) first: a fresh machine needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := data/demo
PYTEST_ARGS ?=

.PHONY: install demo test test-fast test-slow lint bench-convert bench-train bench-generate soak-resume bench-restart bench-gpu clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# --- the quickstart: corpus -> tokenizer -> shards -> training -> generated text -------------
$(DEMO)/corpus.jsonl: | install
	$(PY) -m convert demo-corpus --out $@

$(DEMO)/tokenizer.model: $(DEMO)/corpus.jsonl
	$(PY) -m convert tokenizer $< --format jsonl --vocab-size 4096 --character-coverage 0.995 --out $@

$(DEMO)/shards/train/index.json: $(DEMO)/tokenizer.model
	$(PY) -m convert shards $(DEMO)/corpus.jsonl --format jsonl --tokenizer $< \
		--seq-len 256 --val-fraction 0.02 --workers 2 --out $(DEMO)/shards --overwrite

demo: $(DEMO)/shards/train/index.json
	$(PY) train.py recipes/demo.yaml

# --- quality gates -------------------------------------------------------------------------
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest tests -m slow $(PYTEST_ARGS)

# --- benchmarks (figures and ratios, never timed tests) --------------------------------------
bench-convert: install
	$(PY) -m bench.convert

bench-train: install
	$(PY) -m bench.train

soak-resume: install
	$(PY) -m bench.soak_resume

bench-restart: $(DEMO)/shards/train/index.json
	$(PY) -m bench.restart

bench-gpu: install
	$(PY) -m bench.gpu

bench-generate: install
	$(PY) -m bench.generate

clean:
	rm -rf runs $(DEMO) .pytest_cache
