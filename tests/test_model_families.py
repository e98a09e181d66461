"""Qwen2, Qwen3 and Mistral checkpoints, as transformers writes them, run in jaxserve's one decoder and give HF's
float32 logits, greedy tokens and logprobs: through one paged prefill (both attention backends), through the engine
(chunked prefill, prefix caching and preemption on), with speculative decoding, with LoRA adapters (peft as the
oracle) and with int8 / fp8 weights (HF running the weights they stand for; one format per family, the formats
themselves being family-blind). Config keys that change the math and are not implemented, and architectures not
served, are refused by name. Each family's checkpoint and HF's greedy answers are made once per module and shared.

Tensor parallelism for the families is in tests/test_model_families_tp.py (a subprocess with 8 CPU devices).
"""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR, load_model
from jaxserve.checkpoint.lora_config import PROJECTIONS
from jaxserve.checkpoint.param_tree import checkpoint_tensors, flat_arrays
from jaxserve.checkpoint.quantize import dequantized_arrays
from jaxserve.config import PALLAS_INTERPRET_BACKEND, XLA_BACKEND
from jaxserve.errors import UnsupportedModelError
from jaxserve.model.config import SUPPORTED_ARCHITECTURES, LlamaConfig
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, PagedKVCache
from jaxserve.parallel import param_partition_spec
from jaxserve.parallel.mesh import TP_AXIS
from jaxserve.runner.paged_inputs import build_metadata
from tests.hf_models import FAMILY_STYLES, hf_logits, random_tokens
from tests.test_kernels_prefill import Chunk

SEQUENCE_LENGTH = 40  # far past the 6-token windows of the windowed styles
TOLERANCE = 1e-4  # max-abs on logits of magnitude ~5, as tests/test_model_parity.py
LOGPROB_ATOL = 2e-4
PAGE_SIZE = 8
# Families the engine tests run: biases (Qwen2), q/k norms with tied embeddings (Qwen3), head_dim and a window on
# every layer (Mistral).
ENGINE_STYLES = ("qwen2", "qwen3", "mistral")
# Speculative decoding and LoRA on every family, one engine each: what each family changes for them is
# verification and rollback under a sliding window (Mistral), adapters on q and k that are normed afterwards with an
# explicit head_dim and tied embeddings (Qwen3), and biases beside the adapters' deltas (Qwen2).
SPECULATIVE_STYLES = ENGINE_STYLES
LORA_STYLES = ENGINE_STYLES
# Chunked prefill (16-token steps for prompts of up to 30), prefix caching (prompts sharing 16 tokens) and
# preemption (9 usable pages of 8 slots for two sequences of up to 46 tokens, 6 pages each) all on; two sequences
# at a time, so that each engine compiles few programs.
ENGINE = dict(tokenizer=BUILTIN_MODEL_DIR, dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, block_size=PAGE_SIZE, num_kv_pages=10, use_tqdm_on_load=False)
NEW_TOKENS = 16
VOCAB = 512  # the built-in tokenizer's, so it can serve these checkpoints


def _hf_dict(architecture: str, **fields) -> dict:
    return dict(architectures=[architecture], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, **fields)


# ---- config: each family's differences, read as transformers reads them -------------------------------------------


def test_each_family_reads_its_own_differences():
    qwen2 = LlamaConfig.from_hf_dict(_hf_dict("Qwen2ForCausalLM", attention_bias=False))
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)  # Qwen2 hard-wires its biases
    qwen3 = LlamaConfig.from_hf_dict(_hf_dict("Qwen3ForCausalLM", head_dim=16, tie_word_embeddings=True))
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.tie_word_embeddings) == (False, True, 16, True)
    assert LlamaConfig.from_hf_dict(_hf_dict("Qwen3ForCausalLM", attention_bias=True)).o_proj_bias
    mistral = LlamaConfig.from_hf_dict(_hf_dict("MistralForCausalLM", head_dim=16, sliding_window=4096,
                                                attention_bias=True, mlp_bias=True))
    assert (mistral.head_dim, mistral.qkv_bias, mistral.mlp_bias) == (16, False, False)
    assert mistral.layer_windows == (4096, 4096, 4096)
    llama = LlamaConfig.from_hf_dict(_hf_dict("LlamaForCausalLM", attention_bias=True, sliding_window=8))
    assert (llama.qkv_bias, llama.o_proj_bias, llama.sliding_window) == (True, True, None)
    assert LlamaConfig.from_hf_dict({**_hf_dict("X"), "architectures": None, "model_type": "qwen3"}).qk_norm


@pytest.mark.parametrize("fields, windows", [
    (dict(sliding_window=4096, use_sliding_window=False, max_window_layers=0), (None, None, None)),
    (dict(sliding_window=16, use_sliding_window=True, max_window_layers=1), (None, 16, 16)),
    (dict(sliding_window=16, use_sliding_window=True, max_window_layers=1,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"]), (16, None, 16)),
    (dict(sliding_window=None, use_sliding_window=True), (None, None, None)),
], ids=["switched-off", "max-window-layers", "layer-types", "no-window"])
def test_qwen_windows_follow_use_sliding_window_and_the_layer_types(fields, windows):
    assert LlamaConfig.from_hf_dict(_hf_dict("Qwen2ForCausalLM", **fields)).layer_windows == windows


def test_mistral_without_a_window_attends_over_everything():
    assert LlamaConfig.from_hf_dict(_hf_dict("MistralForCausalLM", sliding_window=None)).sliding_window is None


def test_an_architecture_not_served_is_named_with_the_supported_list():
    with pytest.raises(UnsupportedModelError, match="architecture Gemma2ForCausalLM is not supported") as refused:
        LlamaConfig.from_hf_dict(_hf_dict("Gemma2ForCausalLM"))
    assert all(name in str(refused.value) for name in SUPPORTED_ARCHITECTURES)
    assert set(SUPPORTED_ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                            "Qwen3ForCausalLM"}


@pytest.mark.parametrize("fields, key", [
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "rope_scaling"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["chunked_attention"] * 3), "layer_types"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
], ids=["yarn", "dynamic", "partial-rotary", "partial-rotary-in-rope-parameters", "layer-type", "softcap"])
def test_a_key_that_changes_the_math_and_is_not_implemented_is_refused_by_name(fields, key):
    with pytest.raises(UnsupportedModelError, match=key):
        LlamaConfig.from_hf_dict(_hf_dict("Qwen3ForCausalLM", **fields))


def test_biases_shard_as_their_weights_outputs_and_the_qk_norms_are_replicated():
    assert param_partition_spec("model.layers.self_attn.q_proj.bias") == P(None, TP_AXIS)
    assert param_partition_spec("model.layers.self_attn.v_proj.bias") == P(None, TP_AXIS)
    assert param_partition_spec("model.layers.self_attn.q_norm.weight") == P(None)
    assert param_partition_spec("model.layers.self_attn.k_norm.weight") == P(None)


# ---- logits: one paged prefill against HF -------------------------------------------------------------------------


def paged_logits(loaded, tokens: np.ndarray, backend: str) -> np.ndarray:  # f32[length, vocab]
    """One prefill of tokens i[1, length] through the paged KV cache (the engine's), then every row's logits."""
    cfg, length = loaded.config, tokens.shape[1]
    pages = -(-length // PAGE_SIZE)
    inputs = build_metadata([Chunk(0, length, list(range(1, pages + 1)))], num_tokens=length, num_seqs=1,
                            max_pages=pages, page_size=PAGE_SIZE)
    m = inputs.metadata
    metadata = PagedAttentionMetadata(jnp.asarray(m.slot_mapping), jnp.asarray(m.token_seq),
                                      jnp.asarray(m.block_tables), jnp.asarray(m.seq_lens))
    cache = PagedKVCache.zeros(cfg.num_hidden_layers, pages + 1, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                               loaded.dtype, attention_backend=backend).with_metadata(metadata)
    model = nnx.merge(loaded.graphdef, loaded.params)
    hidden, _ = model(jnp.asarray(tokens), jnp.asarray(inputs.positions)[None], cache)
    return np.asarray(model.logits(hidden))[0]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Style -> (folder, the float32 HF model saved there), vocabulary 512 so the built-in tokenizer serves them."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.hf_models import save_tiny_hf_model

    work = tmp_path_factory.mktemp("families")
    return {style: (work / style, save_tiny_hf_model(work / style, style, vocab_size=VOCAB)) for style in FAMILY_STYLES}


# Every style through the XLA backend; the Pallas kernel (interpreted) for the windowed styles, where it differs
# from the full attention the Llama parity tests already check it in.
LOGITS_CASES = [(style, XLA_BACKEND) for style in FAMILY_STYLES] + [
    (style, PALLAS_INTERPRET_BACKEND) for style in ("qwen2-window", "mistral")]


@pytest.mark.parity
@pytest.mark.parametrize("style, backend", LOGITS_CASES)
def test_float32_logits_match_hf(hf_folders, style, backend):
    folder, hf_model = hf_folders[style]
    tokens = random_tokens(VOCAB, SEQUENCE_LENGTH)
    loaded = load_model(folder, dtype="float32", progress=False)
    assert loaded.config.architecture == type(hf_model).__name__
    np.testing.assert_allclose(paged_logits(loaded, tokens, backend), hf_logits(hf_model, tokens)[0], rtol=0,
                               atol=TOLERANCE)


@pytest.mark.parity
def test_the_window_is_what_makes_the_windowed_families_match(hf_folders):
    """Full attention on a windowed checkpoint would be wrong: loaded without its window, Mistral's logits differ."""
    import dataclasses

    folder, hf_model = hf_folders["mistral"]
    tokens = random_tokens(VOCAB, SEQUENCE_LENGTH)
    loaded = load_model(folder, dtype="float32", progress=False)
    unwindowed = dataclasses.replace(loaded.config, sliding_window=None, windowed_layers=())
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(unwindowed)), nnx.Param)
    wrong = paged_logits(dataclasses.replace(loaded, config=unwindowed, graphdef=graphdef), tokens, XLA_BACKEND)
    assert np.abs(wrong - hf_logits(hf_model, tokens)[0]).max() > 100 * TOLERANCE


@pytest.mark.parity
@pytest.mark.parametrize("style, quantization", [("qwen2", "int8"), ("qwen3", "fp8"), ("mistral", "int8")])
def test_quantized_projections_give_hf_logits_of_the_weights_they_stand_for(hf_folders, style, quantization):
    """The quantized forward pass (biases and q/k norms left as they are) equals HF run with each projection
    replaced by the weight its quantized form and scales stand for."""
    import torch

    folder, hf_model = hf_folders[style]
    loaded = load_model(folder, dtype="float32", progress=False, quantization=quantization)
    rebuilt = dequantized_arrays(checkpoint_tensors(flat_arrays(loaded.params)), jnp.float32)
    oracle = copy.deepcopy(hf_model)
    state = oracle.state_dict()
    with torch.no_grad():
        for name, array in rebuilt.items():
            state[name].copy_(torch.from_numpy(np.array(array)))
    assert not torch.equal(oracle.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           hf_model.state_dict()["model.layers.0.mlp.up_proj.weight"])
    tokens = random_tokens(VOCAB, SEQUENCE_LENGTH)
    np.testing.assert_allclose(paged_logits(loaded, tokens, XLA_BACKEND), hf_logits(oracle, tokens)[0], rtol=0,
                               atol=TOLERANCE)


@pytest.mark.parity
@pytest.mark.parametrize("style", ["qwen3"])
def test_pre_quantized_fp8_checkpoints_give_transformers_logits(hf_folders, tmp_path, style):
    """Block-scaled FP8 (transformers' format, as Qwen3-*-FP8 repositories ship), against transformers' own
    dequantized reading of the same folder."""
    pytest.importorskip("accelerate")
    from tests.fp8_checkpoints import save_transformers_fp8, transformers_dequantized

    save_transformers_fp8(copy.deepcopy(hf_folders[style][1]), tmp_path, block=(16, 16))
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    assert loaded.quantization.startswith("fp8")
    tokens = random_tokens(VOCAB, SEQUENCE_LENGTH)
    np.testing.assert_allclose(paged_logits(loaded, tokens, XLA_BACKEND),
                               hf_logits(transformers_dequantized(tmp_path), tokens)[0], rtol=0, atol=TOLERANCE)


@pytest.mark.parity
def test_a_bfloat16_qwen3_checkpoint_loads_bit_exact(tmp_path):
    import torch

    from tests.hf_models import save_tiny_hf_model

    hf_model = save_tiny_hf_model(tmp_path, "qwen3", dtype="bfloat16")
    loaded = load_model(tmp_path, "bfloat16", progress=False)
    hf_weights = hf_model.state_dict()
    tensors = checkpoint_tensors(flat_arrays(loaded.params))
    assert "model.layers.1.self_attn.k_norm.weight" in tensors and "lm_head.weight" not in tensors
    for name, array in tensors.items():
        expected = hf_weights[name].to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(np.asarray(array).astype(np.float32), expected, err_msg=name)


# ---- the engine against HF generate -------------------------------------------------------------------------------


def workload() -> list[list[int]]:
    """Six prompts of 5 to 30 tokens, three sharing a 16-token prefix (two whole pages)."""
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(3, VOCAB, size=16)]
    prompts = []
    for i, length in enumerate((5, 14, 9, 30, 3, 12)):
        own = [int(t) for t in rng.integers(3, VOCAB, size=length)]
        prompts.append(shared + own if i % 2 == 0 else own)
    return prompts


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], np.ndarray]:
    """HF's greedy tokens and each one's log-probability, from the raw logits."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, generated)]
    return generated, np.array(logprobs)


def assert_matches_hf(outputs, expected: list[tuple[list[int], np.ndarray]]):
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        got = output.outputs[0]
        assert list(got.token_ids) == tokens
        np.testing.assert_allclose([step[t].logprob for step, t in zip(got.logprobs, got.token_ids)], logprobs,
                                   atol=LOGPROB_ATOL)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def hf_expected(hf_folders):
    return {style: [hf_greedy(hf_folders[style][1], p) for p in workload()] for style in ENGINE_STYLES}


@pytest.mark.parity
@pytest.mark.parametrize("style", ENGINE_STYLES)
def test_engine_greedy_tokens_and_logprobs_match_hf(hf_folders, hf_expected, style):
    llm = LLM(model=hf_folders[style][0], **ENGINE)
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload()], GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, hf_expected[style])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert llm.engine.compiles_after_warmup == 0


@pytest.mark.parity
@pytest.mark.parametrize("style", SPECULATIVE_STYLES)
def test_speculative_decoding_keeps_hf_greedy_tokens(hf_folders, hf_expected, style):
    from tests.test_engine import RandomDrafts

    llm = LLM(model=hf_folders[style][0], **{**ENGINE, "num_kv_pages": 40},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    llm.engine.scheduler.proposer = RandomDrafts(seed=0)  # mostly wrong drafts: rollback runs nearly every step
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload()], GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, hf_expected[style])
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0


@pytest.mark.parity
@pytest.mark.parametrize("style", LORA_STYLES)
def test_lora_adapters_match_peft(hf_folders, tmp_path, style):
    peft = pytest.importorskip("peft")
    import torch

    folder, base = hf_folders[style]
    adapted = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8,
                                                                       target_modules=list(PROJECTIONS)))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.2 * torch.randn_like(param))
    adapted.save_pretrained(tmp_path / "adapter")
    adapted.eval()
    llm = LLM(model=folder, enable_lora=True, max_loras=1, max_lora_rank=8, **{**ENGINE, "num_kv_pages": 40})
    prompts = workload()[:2]
    request = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=[request] * len(prompts))
    assert_matches_hf(outputs, [hf_greedy(adapted, p) for p in prompts])
    assert [o.outputs[0].token_ids for o in outputs] != [hf_greedy(base, p)[0] for p in prompts], "adapter matters"

