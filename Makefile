# The README's two commands. Both set up .venv on first use (Python >= 3.12, found on PATH or through pyenv).
# On an NVIDIA host add the CUDA extra: make run EXTRAS=cuda13 (or cuda12).
EXTRAS ?=
comma := ,
TEST_EXTRAS := test,parity$(if $(EXTRAS),$(comma)$(EXTRAS))

.PHONY: run test

run:  ## serves the OpenAI API on 127.0.0.1:8000 with the built-in tiny model (or pass ARGS="--model DIR ...")
	./scripts/bootstrap.sh "$(EXTRAS)"
	exec .venv/bin/jaxserve serve --config configs/tiny-cpu.yaml $(ARGS)

test:  ## runs the whole test suite, parity oracles included (CI runs exactly this)
	./scripts/bootstrap.sh "$(TEST_EXTRAS)"
	.venv/bin/python -m pytest -q $(ARGS)
