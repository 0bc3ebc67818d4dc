# The two commands a reader needs are `make book` and `make test`; both set up .venv themselves.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The environment that makes outputs repeat (one thread, progress bars off, a fixed hash seed) is set by
# conftest.py for pytest and by scripts/execute_notebooks.py for the canonical run, not here.
NBVAL := -m pytest -q -p no:cacheprovider --dist loadfile --nbval --nbval-current-env \
	--nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: help venv site-assets book test test-unit test-notebooks test-site test-reader fuzz gpu-sweep gpu-check execute serve lint clean

help:
	@echo "make book    build the site into _build/html"
	@echo "make test    unit + property tests, nbval over every notebook, strict site build"
	@echo "make fuzz    every public function on 2,000 generated calls each, with the example counts"
	@echo "make gpu-sweep  compile every GPU kernel for sm_75/80/90 on this CPU: registers, spills (slow)"
	@echo "make gpu-check  on a CUDA machine: gpu tests, every chapter on the GPU, the GPU benchmark (<= 8 min)"
	@echo "make execute re-run every notebook in place (the canonical run whose outputs are committed)"
	@echo "make test-reader  every chapter in a reader's environment (Colab's versions, no triton, notebook alone)"
	@echo "make serve   serve _build/html on http://127.0.0.1:8000"

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@

venv: $(STAMP)

# JavaScript the site serves itself (no CDN reaches a reader offline or this machine): installed from
# the npm registry with the exact versions in site/package-lock.json, then only the files pages use.
VENDOR := _static/vendor
HTML_MANAGER := site/node_modules/@jupyter-widgets/html-manager/dist
MATHJAX := site/node_modules/mathjax/es5
$(VENDOR)/.installed: site/package.json site/package-lock.json
	cd site && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	rm -rf $(VENDOR) && mkdir -p $(VENDOR)/mathjax/output/chtml/fonts $(VENDOR)/mathjax/input/tex
	cp site/node_modules/requirejs/require.js $(VENDOR)/require.js
	cp $(HTML_MANAGER)/embed-amd.js $(HTML_MANAGER)/*.woff2 $(HTML_MANAGER)/*.woff \
		$(HTML_MANAGER)/*.ttf $(HTML_MANAGER)/*.eot $(HTML_MANAGER)/*.svg $(VENDOR)/
	cp $(MATHJAX)/tex-chtml.js $(VENDOR)/mathjax/
	cp -r $(MATHJAX)/output/chtml/fonts/woff-v2 $(VENDOR)/mathjax/output/chtml/fonts/
	cp -r $(MATHJAX)/input/tex/extensions $(VENDOR)/mathjax/input/tex/
	cp -r $(MATHJAX)/ui $(MATHJAX)/a11y $(VENDOR)/mathjax/
	@touch $@

site-assets: $(VENDOR)/.installed

# Strict: any Sphinx warning (broken reference, bad docstring markup, missing citation) fails the build.
book: $(STAMP) site-assets
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The site is at $(CURDIR)/_build/html/index.html"

test: test-unit test-notebooks test-site

# pytest-xdist spreads tests over the cores; `--dist loadfile` keeps each notebook's cells in one kernel, in order.
JOBS ?= 2

test-unit: $(STAMP)
	$(VENV)/bin/ruff check attention_core tests scripts benchmarks site
	$(PY) -m pytest -q -p no:cacheprovider -n $(JOBS) --ignore=tests/browser tests

# Twice: with the CPU kernels torch picks on this machine, and with ATEN_CPU_CAPABILITY=default, the plainest
# kernels, which round differently, as another CPU would. Stored outputs must not depend on either.
test-notebooks: $(STAMP)
	$(PY) $(NBVAL) -n $(JOBS) book
	ATEN_CPU_CAPABILITY=default $(PY) $(NBVAL) -n $(JOBS) book

# The fuzz test at full strength: Hypothesis profile "slow" (2,000 examples per public function, fresh ones on
# every run; `make test` runs the same file derandomized at 300). Prints, per test, how many examples ran and
# what they did (answered, raised, compared with the float64 oracle).
fuzz: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(JOBS) tests/test_fuzz.py tests/test_fuzz_caches.py tests/test_fuzz_modules.py tests/test_fuzz_checkpoints.py \
		tests/test_fuzz_interventions.py --fuzz-profile=slow \
		--hypothesis-show-statistics

# A clean strict build, then every page in Chromium (tests/browser); screenshots land in _build/screenshots/.
test-site: $(STAMP) site-assets
	rm -rf _build
	@start=$$(date +%s); $(VENV)/bin/jupyter-book build . -W -n --keep-going; \
		echo "Site built in $$(( $$(date +%s) - start )) s: $(CURDIR)/_build/html/index.html"
	scripts/ensure_chromium.sh
	$(PY) -m pytest -q -p no:cacheprovider tests/browser

# Not part of `make test`: the resource reports that tests/test_triton_resources.py and test_cuda_resources.py
# check. Every Triton kernel x autotune candidate x dtype x mask mode (causal, full, window) x E in {64, 80, 128}
# x L = S in {4096, 4001} for sm_75, sm_80 and sm_90: 1,440 compiles of 1-4 s each (the sum of their own
# times), so about 30 minutes on 2 idle cores; then the CUDA kernels with nvcc -Xptxas -v (about a minute).
# Compiles are cached in ~/.cache/attention_core, keyed by the kernels' fingerprint: an interrupted sweep, or
# one after a candidate list lost a member, compiles only what it has not seen. SWEEP_MINUTES=N stops it after
# N minutes and lists what was not compiled in the report.
SWEEP_MINUTES ?=
gpu-sweep: $(STAMP)
	$(PY) benchmarks/triton_resources.py --jobs $(JOBS) $(if $(SWEEP_MINUTES),--max-minutes $(SWEEP_MINUTES))
	$(PY) benchmarks/cuda_resources.py

# Not part of `make test`: everything that needs a GPU, in at most 8 minutes on an H100/H200 (the gpu-marked tests,
# every chapter executed on CUDA, the attention/flex/paged benchmark; benchmarks/results/gpu_<device>_<date>.json).
# It needs the machine's CUDA build of torch, so it does not install requirements.txt (which pins the CPU build):
# it runs .venv's python if there is one, else python3. Without CUDA it says so in one line and exits 0. How to run
# it on a lent GPU machine with no network: the docstring of scripts/gpu_check.py and benchmarks/NOTES.md.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) scripts/gpu_check.py

execute: $(STAMP)
	$(PY) scripts/execute_notebooks.py $(NOTEBOOKS)

# Not part of `make test` (it installs a second environment, about 5 minutes): see scripts/test_reader.py.
test-reader:
	python3 scripts/test_reader.py

serve: $(STAMP)
	$(PY) -m http.server --bind 127.0.0.1 --directory _build/html 8000

lint: $(STAMP)
	$(VENV)/bin/ruff check attention_core tests scripts benchmarks site

clean:
	rm -rf _build
