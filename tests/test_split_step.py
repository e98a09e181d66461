"""A plain step dispatched as two programs (the forward pass, then the sampler: ModelRunner.start / finish) against
the reference, the same step as one program (runner/step.py's run_step through run_packed_step), with and without
grammar masks on some rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.runner.token_masks import ALL_ALLOWED
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.schedule import SamplingRow, ScheduledSequence, SchedulerOutput, mask_width

PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7)]


def _schedule(runner, eos_token_ids, rng) -> SchedulerOutput:
    """Three prompts prefilled into pages at the end of the pool, each sampling."""
    page_size, last_page = runner.config.block_size, runner.pool.num_pages - 1
    chunks = []
    for row, params in enumerate(PARAMS):
        tokens = tuple(int(t) for t in rng.integers(0, 500, 3 + 4 * row))
        pages = tuple(range(last_page - 2 * row, last_page - 2 * row - -(-len(tokens) // page_size), -1))
        chunks.append(ScheduledSequence(f"split-{row}", tokens, 0, pages, samples=True, wants_prompt_logits=False,
                                        sampling=SamplingRow(params, tokens, [], eos_token_ids, seed=row)))
    return SchedulerOutput(step=0, sequences=tuple(chunks), num_batched_tokens=sum(c.num_tokens for c in chunks))


@pytest.mark.parametrize("masked_rows", [(), (0, 1)], ids=["no masks", "masks on two rows"])
def test_a_plain_step_in_two_programs_equals_the_one_program_reference(tiny_llm, masked_rows):
    runner = tiny_llm.engine.runner
    rng = np.random.default_rng(len(masked_rows))
    vocab, width = runner.model_config.vocab_size, mask_width(runner.model_config.vocab_size)
    masks = {row: np.packbits(rng.random(width * 32) < 0.3, bitorder="little").view(np.int32) for row in masked_rows}
    schedule = _schedule(runner, tiny_llm.tokenizer.eos_token_ids, rng)
    kept = (jax.tree.map(jnp.copy, runner.pool), runner._last_tokens, runner.inputs.last_rows)
    reference_pool = jax.tree.map(jnp.copy, runner.pool)
    try:
        started = runner.start(schedule)
        assert started.forward_running
        split = runner.finish(started, masks).fetch()
        host = started.host_arrays
        layout = PackedLayout.of(host)
        allowed = np.full((started.bucket.num_seqs, width), ALL_ALLOWED, np.int32)
        for row, mask in masks.items():
            allowed[row] = mask
        reference, _ = runner.programs.reference_step(runner.params, reference_pool, kept[1], jax.device_put(layout.pack(host)),
                                      jax.device_put(allowed), None, layout=layout,
                                      num_top_logprobs=runner.config.max_logprobs)
    finally:
        runner.pool, runner._last_tokens, runner.inputs.last_rows = kept
    one_program = jax.device_get(reference.sampled)
    rows = len(PARAMS)
    np.testing.assert_array_equal(split.token_ids, one_program.token_ids[:rows])
    np.testing.assert_array_equal(split.top_ids, one_program.top_ids[:rows])
    np.testing.assert_allclose(split.logprobs, one_program.logprobs[:rows], rtol=1e-6, atol=1e-6)
    for row, mask in masks.items():  # the draw obeyed its mask
        allowed_ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
        assert split.token_ids[row] in allowed_ids
    assert tiny_llm.engine.compiles_after_warmup == 0
