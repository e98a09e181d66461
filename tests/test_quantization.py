"""Quantized weights (--quantization int8 / fp8): the paged engine with quantized projections decodes exactly what the
dense reference decoder decodes with the weights they stand for rebuilt in full, and stays close to the unquantized
model (tolerances that a wrong scale or a transposed weight would break)."""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import load_model, plan_model
from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.checkpoint.quantize import dequantized_arrays
from jaxserve.config import QUANTIZATIONS, EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.model.quantization import WEIGHT_FORMATS, dequantize, quantize, scaled_matmul, weight_format
from jaxserve.reference.dense_decoder import DecodeRequest, DenseDecoder
from tests.hf_models import jaxserve_logits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from quantization import greedy_sequences, score_difference, teacher_forced_scores  # noqa: E402

LIMITS = dict(model=None, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              use_tqdm_on_load=False)
PROMPTS = [[507, 40, 41, 42, 43], [507, 100, 7, 300], [507, 9, 9, 9, 250, 251, 3]]
NEW_TOKENS = 20
# Measured on the built-in model (teacher-forced over its own greedy continuations): int8 0.037 and 91%, fp8 0.145
# and 80%. A wrong scale or a transposed weight leaves no agreement at all.
TOLERANCES = {"int8": (0.1, 0.8), "fp8": (0.35, 0.65)}  # (mean |logprob difference|, top-1 agreement)


@pytest.fixture(scope="module")
def unquantized():
    return LLM(**LIMITS)


# XLA's GEMMs on each layer's slice, and the Pallas kernel reading the layer's rows of the whole stack in place
# (--gemm-backend pallas; interpreted here, compiled on a GPU), which steps of up to 64 tokens take.
GEMMS = {"xla": {}, "pallas": dict(gemm_backend="pallas", pallas_interpret=True)}


@pytest.fixture(scope="module")
def quantized_llm():
    """(quantization, gemm) -> its engine, each built once for this module and released with it (a whole session
    holding every engine's compiled programs would exhaust the process's memory maps: tests/conftest.py)."""
    engines = {}

    def engine(quantization: str, gemm: str) -> LLM:
        if (quantization, gemm) not in engines:
            engines[quantization, gemm] = LLM(quantization=quantization, **LIMITS, **GEMMS[gemm])
        return engines[quantization, gemm]
    return engine


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_the_engine_decodes_what_the_dense_reference_decodes_with_the_rebuilt_weights(quantized_llm, quantization,
                                                                                        gemm):
    llm = quantized_llm(quantization, gemm)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    quantized = load_model(None, "float32", progress=False, quantization=quantization)
    dense = abstract_params(quantized.config, np.dtype(np.float32), lambda name, shape: None)
    rebuilt = fill_params(dense, dequantized_arrays(flat_arrays(quantized.params), jnp.float32))
    decoder = DenseDecoder(quantized.config, dense.graphdef, rebuilt, np.float32, max_batch=len(PROMPTS))
    tokens = [[] for _ in PROMPTS]
    decoder.decode([DecodeRequest(tuple(p), params, NEW_TOKENS) for p in PROMPTS],
                   lambda i, token: tokens[i].append(token) or len(tokens[i]) == NEW_TOKENS)
    for output, expected in zip(outputs, tokens):
        assert list(output.outputs[0].token_ids) == [t.token_id for t in expected]
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(output.outputs[0].token_ids,
                                                                   output.outputs[0].logprobs)],
                                   [t.logprob for t in expected], atol=1e-4)


def _kernels_in_step_programs(llm: LLM) -> dict[int, int]:
    """Tokens of each step program (not the samplers) -> how many quantized_matmul kernels its trace calls."""
    runner = llm.engine.runner
    found = {}
    for program in runner.programs.lowerings(llm.engine.config.num_kv_pages):
        if not program.sampler:
            call = program.call()
            jaxpr = str(call.function.trace(*call.args, **call.static).jaxpr)
            found[program.bucket.num_tokens] = jaxpr.count("name=quantized_matmul")
    return found


def test_the_pallas_gemm_backend_reads_the_quantized_stacks_with_the_kernel(quantized_llm):
    """Every step of this engine has at most 32 tokens, under IN_PLACE_MAX_ROWS: each program's scan calls the kernel
    for its projections; with XLA's GEMMs none does."""
    assert all(count > 0 for count in _kernels_in_step_programs(quantized_llm("int8", "pallas")).values())
    assert set(_kernels_in_step_programs(quantized_llm("int8", "xla")).values()) == {0}


def test_an_fp8_prefill_step_quantizes_activations_and_the_dense_model_agrees():
    """A 101-token prompt is one prefill step of more than IN_PLACE_MAX_ROWS tokens: with fp8 weights it runs W8A8
    (model/quantization.py). Its prompt scores equal the dense-cache forward of the same model (W8A8 too, at 101
    rows), and differ visibly from the model run weight-only (W8A16): the step did quantize its activations."""
    llm = LLM(quantization="fp8", **{**LIMITS, "max_model_len": 160, "max_num_batched_tokens": 128})
    prompt = [507, *range(10, 110)]
    [output] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)
    scored = np.array([candidates[token].logprob for token, candidates in zip(prompt[1:], output.prompt_logprobs[1:])])
    loaded = load_model(None, "float32", progress=False, quantization="fp8")
    weight_only = abstract_params(loaded.config, np.dtype(np.float32), lambda name, shape: None,
                                  dataclasses.replace(WEIGHT_FORMATS["fp8"], activations=None))

    def reference(graphdef) -> np.ndarray:
        logits = jaxserve_logits(dataclasses.replace(loaded, graphdef=graphdef), np.array([prompt]))[0, :-1]
        return np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.array(prompt[1:])[:, None], -1)[:, 0]

    np.testing.assert_allclose(scored, reference(loaded.graphdef), atol=1e-4)
    assert np.abs(scored - reference(weight_only.graphdef)).max() > 1e-2


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_scores_stay_close_to_the_unquantized_models(unquantized, quantization):
    sequences = greedy_sequences(unquantized, [{"prompt_token_ids": p} for p in PROMPTS], NEW_TOKENS)
    mean_difference, agreement = score_difference(teacher_forced_scores(unquantized, sequences),
                                                  LLM(quantization=quantization, **LIMITS), sequences)
    most_difference, least_agreement = TOLERANCES[quantization]
    assert mean_difference < most_difference and agreement > least_agreement, (mean_difference, agreement)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_each_channel_keeps_its_largest_weight_and_the_matmul_equals_the_rebuilt_weights(quantization):
    fmt = weight_format(quantization)
    weight = jax.random.normal(jax.random.key(0), (3, 16, 8)) * jnp.arange(1, 17)[None, :, None]
    weight = weight.at[1, 5].set(0.0)  # an all-zero channel
    q, scale = quantize(weight, fmt)
    assert q.dtype == fmt.dtype and scale.shape == (3, 16) and float(scale[1, 5]) == 1.0
    rebuilt = dequantize(q, scale, jnp.float32)
    largest = jnp.abs(weight).max(axis=-1)
    np.testing.assert_allclose(jnp.abs(rebuilt).max(axis=-1), largest, rtol=1e-6)
    np.testing.assert_allclose(rebuilt, weight, atol=float(largest.max()) / (50 if quantization == "int8" else 8))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    np.testing.assert_allclose(scaled_matmul(x, q[2], scale[2]), x @ rebuilt[2].T, rtol=1e-5, atol=1e-5)


def test_quantized_weights_take_a_byte_each_and_unknown_modes_are_refused():
    assert set(WEIGHT_FORMATS) == set(QUANTIZATIONS)
    plan = plan_model(None, "float32", quantization="int8")
    arrays = flat_arrays(plan.load(progress=False).params)
    projection = "model.layers.mlp.up_proj.weight"
    assert arrays[projection].dtype == jnp.int8 and arrays[projection + "_scale"].dtype == jnp.float32
    assert arrays["lm_head.weight"].dtype == jnp.float32  # left unquantized, as vLLM leaves it
    projections = sum(a.size for name, a in arrays.items() if name.endswith("proj.weight"))
    saved = projections * 3 - sum(a.size * 4 for name, a in arrays.items() if name.endswith("_scale"))
    assert plan_model(None, "float32").weight_bytes_per_device() - plan.weight_bytes_per_device() == saved
    assert plan.weight_bytes_per_device() == sum(a.nbytes for a in arrays.values())
    with pytest.raises(ConfigError, match=r"quantization \(--quantization\) must be one of int8, fp8, got .int4."):
        EngineConfig(quantization="int4")
