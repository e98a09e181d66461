# The README's two commands. Both set up .venv on first use (Python >= 3.12, found on PATH or through pyenv).
# On an NVIDIA host add the CUDA extra: make run EXTRAS=cuda13 (or cuda12).
EXTRAS ?=
comma := ,
# gpu-audit: JAX's CUDA plugin, with which tests/test_gpu_audit.py compiles the step programs for H100/H200 targets
# (no GPU needed; about 4.9 GB of NVIDIA libraries). docs: mkdocs, with which tests/test_docs.py builds the site.
TEST_EXTRAS := test,parity,gpu-audit,docs$(if $(EXTRAS),$(comma)$(EXTRAS))

.PHONY: run test gpu-check

run:  ## serves the OpenAI API on 127.0.0.1:8000 with the built-in tiny model (or pass ARGS="--model DIR ...")
	./scripts/bootstrap.sh "$(EXTRAS)"
	exec .venv/bin/jaxserve serve --config configs/tiny-cpu.yaml $(ARGS)

test:  ## runs the whole test suite, parity oracles included (CI runs exactly this)
	./scripts/bootstrap.sh "$(TEST_EXTRAS)"
	.venv/bin/python -m pytest -q $(ARGS)

# On a GPU host: the host's own python3 (with CUDA JAX) and the wheels scripts/gpu_wheels.sh put in .whl/; no .venv,
# no package index. benchmarks/gpu_check.py's docstring says what each part measures.
OUT ?= gpu-check-results

gpu-check:  ## on a GPU host: GPU checks and benchmarks into OUT (ARGS="--group 1" ... "--group 7"; "--list")
	./scripts/gpu_check.sh "$(OUT)" $(ARGS)
