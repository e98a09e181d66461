# The README's two commands. Both set up .venv on first use (Python >= 3.12, found on PATH or through pyenv).
# On an NVIDIA host add the CUDA extra: make run EXTRAS=cuda13 (or cuda12).
EXTRAS ?=
comma := ,
TEST_EXTRAS := test,parity$(if $(EXTRAS),$(comma)$(EXTRAS))

.PHONY: run test

run:  ## runs jaxserve's main job on the built-in tiny model (or pass ARGS="--model DIR ...")
	./scripts/bootstrap.sh "$(EXTRAS)"
	.venv/bin/jaxserve generate --config configs/tiny-cpu.yaml $(ARGS)

test:  ## runs the whole test suite, parity oracles included (CI runs exactly this)
	./scripts/bootstrap.sh "$(TEST_EXTRAS)"
	.venv/bin/python -m pytest -q $(ARGS)
