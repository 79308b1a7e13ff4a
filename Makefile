# Two commands on a fresh machine:
#   make run   set up .venv and run the main job (FedAvg vs FedSubAvg on the embedded data)
#   make test  set up .venv and run ruff and the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= runs/default

.PHONY: setup run test test-deployment lint docs docs-strict bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,flower,docs,datasets,tracking,blt]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fedsub compare --overwrite --out $(OUT)  # the demo folder is replaced each time

lint: $(STAMP)
	$(BIN)/ruff check src tests docs/hooks $(wildcard benchmarks)
	$(BIN)/ruff format --check src tests docs/hooks $(wildcard benchmarks)
	$(BIN)/mypy  # files and settings: [tool.mypy] in pyproject.toml

# The documentation site (docs/, mkdocs.yml) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build

# Strict: a broken link, reference or docstring fails the build.
docs-strict: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # not --quiet: it would hide (and not count) the warnings

test: lint docs-strict
	$(BIN)/pytest -q

# The long real-process Flower runs (minutes each) that `make test` leaves out.
test-deployment: $(STAMP)
	$(BIN)/pytest -q -m deployment

clean:
	rm -rf $(VENV) runs site
