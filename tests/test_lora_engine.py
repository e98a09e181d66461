"""LoRA adapters in the engine: a batch mixing adapters and the base model, checked against peft; slots, the host
cache of adapters, the prefix cache per adapter, and refusals.

The parity test takes the real peft library as the oracle: a tiny HF Llama saved by transformers, two adapters made
by `peft.get_peft_model` (lora_B randomised: peft starts it at zero) and saved by peft's `save_pretrained`; HF's
greedy `generate` with each adapter gives the tokens and log-probabilities that jaxserve must give for the same
prompts in one batch mixing both adapters and the base model. The other tests run the built-in model with adapter
folders written in peft's format by jaxserve/checkpoint/random_lora.py, no torch needed.
"""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.checkpoint.lora_config import PROJECTIONS
from jaxserve.checkpoint.random_lora import write_random_lora_adapter
from jaxserve.engine.adapter_slots import AdapterSlots
from jaxserve.errors import (InvalidRequestError, LoraAdapterError, LoraNameTakenError, LoraRankError,
                             ModelNotFoundError)
from jaxserve.model.config import LlamaConfig

MAX_RANK = 8
LIMITS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, use_tqdm_on_load=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def builtin_config() -> LlamaConfig:
    return LlamaConfig.from_hf_dict(json.loads((Path(BUILTIN_MODEL_DIR) / "config.json").read_text()))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    """Three adapters for the built-in model: different projections, ranks and scalings."""
    work, config = tmp_path_factory.mktemp("adapters"), builtin_config()
    specs = {"qv": dict(rank=4, projections=("q_proj", "v_proj", "down_proj")),
             "mlp": dict(rank=8, projections=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=3, lora_alpha=32),
             "all": dict(rank=2, projections=tuple(PROJECTIONS), seed=5, use_rslora=True)}
    for name, spec in specs.items():
        write_random_lora_adapter(work / name, config, **spec)
    return {name: work / name for name in specs}


@pytest.fixture(scope="module")
def llm():
    """Two adapter slots: three adapters in one batch make one wait for a slot."""
    return LLM(enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=MAX_RANK, **LIMITS)


def lora(adapter_dirs, name: str) -> LoRARequest:
    return LoRARequest(name, list(adapter_dirs).index(name) + 1, str(adapter_dirs[name]))


def tokens(outputs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_a_batch_of_more_adapters_than_slots_gives_each_request_its_own_adapters_output(llm, adapter_dirs):
    prompts = ["The weather today", "Once upon a time"]
    loras = [None, *(lora(adapter_dirs, name) for name in adapter_dirs)]
    alone = {(p, r): tokens(llm.generate([p], GREEDY, use_tqdm=False, lora_request=r))[0]
             for p in prompts for r in loras}
    mixed = [(p, r) for r in loras for p in prompts]
    together = tokens(llm.generate([p for p, _ in mixed], GREEDY, use_tqdm=False, lora_request=[r for _, r in mixed]))
    assert together == [alone[key] for key in mixed]
    assert len({alone[(prompts[0], r)] for r in loras}) == len(loras), "every adapter changes the output"


def test_the_prefix_cache_never_serves_one_adapters_pages_to_another(llm, adapter_dirs):
    prompt = {"prompt_token_ids": list(range(3, 60))}  # three full pages of 16
    first = {name: tokens(llm.generate([prompt], GREEDY, use_tqdm=False,
                                       lora_request=lora(adapter_dirs, name) if name else None))[0]
             for name in (None, "qv", "mlp")}
    hits_before = llm.engine.scheduler.stats().prefix_hit_tokens
    for name in (None, "qv", "mlp"):
        again = tokens(llm.generate([prompt], GREEDY, use_tqdm=False,
                                    lora_request=lora(adapter_dirs, name) if name else None))[0]
        assert again == first[name]
    assert llm.engine.scheduler.stats().prefix_hit_tokens - hits_before == 3 * 48, "each adapter reuses its own"


def test_an_adapter_dropped_from_host_memory_is_read_again(llm, adapter_dirs):
    """max_cpu_loras 2: the third adapter drops the least recently used, which a later slot write reads again."""
    names = list(adapter_dirs)
    outputs = [tokens(llm.generate(["Read again"], GREEDY, use_tqdm=False, lora_request=lora(adapter_dirs, n)))[0]
               for n in names + names]
    assert outputs[:3] == outputs[3:]


def test_a_removed_adapter_finishes_its_running_requests_and_refuses_new_ones(llm, adapter_dirs):
    engine = llm.engine
    request = lora(adapter_dirs, "qv")
    expected = tokens(llm.generate(["Goodbye"], GREEDY, use_tqdm=False, lora_request=request))[0]
    engine.add_request("leaving", llm.tokenizer.encode("Goodbye"), GREEDY, lora_request=request)
    engine.step()
    assert engine.remove_lora("qv") and "qv" not in [r.lora_name for r in engine.list_loras()]
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.outputs[0].token_ids for o in finished] == [expected]
    assert not engine.remove_lora("qv")
    assert engine.add_lora(request), "it can be added again"


def test_bad_adapters_are_refused_and_change_nothing(llm, adapter_dirs, tmp_path):
    served = llm.engine.list_loras()
    with pytest.raises(LoraAdapterError, match="does not exist"):
        llm.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 9, str(tmp_path / "none")))
    write_random_lora_adapter(tmp_path / "wide", builtin_config(), rank=MAX_RANK * 2)
    with pytest.raises(LoraRankError):
        llm.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("wide", 9, str(tmp_path / "wide")))
    taken = lora(adapter_dirs, "mlp")
    llm.engine.add_lora(taken)
    with pytest.raises(LoraAdapterError, match="already loaded"):
        llm.engine.add_lora(LoRARequest("mlp", 7, str(adapter_dirs["qv"])))
    with pytest.raises(LoraAdapterError, match="already belongs"):
        llm.engine.add_lora(LoRARequest("other", taken.lora_int_id, str(adapter_dirs["qv"])))
    assert {r.lora_name for r in llm.engine.list_loras()} == {r.lora_name for r in served} | {"mlp"}
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.generate(["x", "y"], GREEDY, use_tqdm=False, lora_request=[taken])
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("zero", 0, "folder")


def test_a_steps_adapters_come_from_host_memory_so_a_deleted_folder_fails_only_new_requests(llm, adapter_dirs,
                                                                                           tmp_path):
    """max_cpu_loras 2: a queued request keeps its adapter in memory while two others pass through, so the step that
    admits it reads no folder; once it ended, a new request for the deleted folder's adapter is refused alone."""
    engine = llm.engine
    shutil.copytree(adapter_dirs["qv"], tmp_path / "moved")
    moved = LoRARequest("moved", 42, str(tmp_path / "moved"))
    expected = tokens(llm.generate(["Kept"], GREEDY, use_tqdm=False, lora_request=moved))[0]
    engine.add_request("kept", llm.tokenizer.encode("Kept"), GREEDY, lora_request=moved)
    for name in ("mlp", "all"):
        engine.add_request(name, llm.tokenizer.encode("Other"), GREEDY, lora_request=lora(adapter_dirs, name))
    shutil.rmtree(tmp_path / "moved")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    assert finished["kept"].outputs[0].token_ids == expected and len(finished) == 3
    for name in ("mlp", "all", "qv"):  # moves "moved" out of host memory
        llm.generate(["Again"], GREEDY, use_tqdm=False, lora_request=lora(adapter_dirs, name))
    with pytest.raises(LoraAdapterError, match="does not exist"):
        engine.add_request("gone", [5, 6], GREEDY, lora_request=moved)
    assert not engine.has_unfinished_requests()


def test_an_adapter_id_names_one_adapter_for_the_engines_life(llm, adapter_dirs):
    engine = llm.engine
    first = LoRARequest("first", 77, str(adapter_dirs["qv"]))
    engine.add_lora(first)
    assert engine.remove_lora("first")
    with pytest.raises(LoraNameTakenError, match="id 77"):
        engine.add_lora(LoRARequest("second", 77, str(adapter_dirs["mlp"])))
    assert engine.add_lora(first), "the same adapter under its id again is fine"


def test_the_server_path_refuses_an_adapter_unloaded_after_its_name_was_resolved(llm, adapter_dirs):
    engine, request = llm.engine, LoRARequest("brief", 78, str(adapter_dirs["mlp"]))
    engine.add_lora(request)
    engine.remove_lora("brief")
    with pytest.raises(ModelNotFoundError) as refused:
        engine.add_request("late", [5, 6], GREEDY, lora_request=request, load_lora=False)
    assert refused.value.param == "model" and not engine.has_unfinished_requests()
    assert "brief" not in [r.lora_name for r in engine.list_loras()], "not served again behind the server's back"


def test_a_failed_slot_write_leaves_no_slot_promised_to_an_adapter(llm, adapter_dirs, monkeypatch):
    """A step whose slot write fails aborts its requests (as any failed step does); the adapter it was writing
    must be written again for the next request rather than assumed present."""
    engine, request = llm.engine, lora(adapter_dirs, "all")
    for name in ("qv", "mlp"):  # both slots hold other adapters
        llm.generate(["Fill"], GREEDY, use_tqdm=False, lora_request=lora(adapter_dirs, name))
    expected = tokens(llm.generate(["Write"], GREEDY, use_tqdm=False, lora_request=request))[0]
    for name in ("qv", "mlp"):
        llm.generate(["Fill"], GREEDY, use_tqdm=False, lora_request=lora(adapter_dirs, name))
    with monkeypatch.context() as patched:
        patched.setattr(engine.runner, "write_lora_slot", lambda slot, weights: 1 / 0)
        engine.add_request("doomed", llm.tokenizer.encode("Write"), GREEDY, lora_request=request)
        with pytest.raises(ZeroDivisionError):
            engine.step()
        assert engine.abort_all_requests() == ["doomed"]
    assert tokens(llm.generate(["Write"], GREEDY, use_tqdm=False, lora_request=request))[0] == expected


def test_an_engine_without_lora_refuses_adapters():
    base = LLM(**LIMITS)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        base.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, "folder"))


@pytest.fixture(scope="module")
def tiny_pool_llm():
    """Eleven usable pages of 16 tokens for four sequences of up to 60: forces preemption by recompute."""
    return LLM(enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, num_kv_pages=12, **LIMITS)


def test_preempted_adapter_requests_recompute_with_their_adapter(llm, tiny_pool_llm, adapter_dirs):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 23 + i))} for i in range(4)]
    loras = [None, lora(adapter_dirs, "qv"), lora(adapter_dirs, "mlp"), lora(adapter_dirs, "qv")]
    expected = [tokens(llm.generate([p], params, use_tqdm=False, lora_request=r))[0] for p, r in zip(prompts, loras)]
    assert tokens(tiny_pool_llm.generate(prompts, params, use_tqdm=False, lora_request=loras)) == expected
    stats = tiny_pool_llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_running == stats.num_pages_used == 0


def test_a_request_aborted_while_waiting_for_a_slot_leaves_the_slots_free(tiny_pool_llm, adapter_dirs):
    engine, params = tiny_pool_llm.engine, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for name in ("qv", "mlp", "all"):  # two slots: "all" waits for one
        engine.add_request(name, [5, 6, 7], params, lora_request=lora(adapter_dirs, name))
    engine.step()
    assert engine.stats().num_waiting == 1
    engine.abort_request("all")
    while engine.has_unfinished_requests():
        engine.step()
    slots = engine.scheduler.adapter_slots
    assert all(slots.can_acquire(lora_id) for lora_id in (1, 2, 3, 4))
    [output] = tiny_pool_llm.generate(["Back"], params, use_tqdm=False, lora_request=lora(adapter_dirs, "all"))
    assert len(output.outputs[0].token_ids) == 4 and engine.stats().num_running == 0


def test_continuations_of_one_prompt_share_its_adapter(llm, adapter_dirs):
    sampled = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    [output] = llm.generate(["Twice"], sampled, use_tqdm=False, lora_request=lora(adapter_dirs, "mlp"))
    alone = tokens(llm.generate(["Twice"], GREEDY, use_tqdm=False, lora_request=lora(adapter_dirs, "mlp")))[0]
    assert [c.token_ids for c in output.outputs] == [alone[:6], alone[:6]]


def test_slots_are_shared_by_an_adapters_requests_and_reused_least_recently_used_first():
    slots = AdapterSlots(max_loras=2)
    assert slots.acquire(0) == (0, False)
    assert slots.acquire(5) == (1, True) and slots.acquire(5) == (1, False)
    assert slots.acquire(6) == (2, True)
    assert not slots.can_acquire(7) and slots.can_acquire(5)
    slots.release(1)
    assert not slots.can_acquire(7), "adapter 5 still has a running request"
    slots.release(1)
    slots.release(2)
    assert slots.acquire(6) == (2, False), "an idle slot keeps its adapter"
    assert slots.acquire(7) == (1, True), "the idle slot of adapter 5 is taken"
    slots.release(2)
    slots.forget(6)
    assert slots.acquire(6) == (2, True), "a forgotten adapter is written again"
    slots.forget(6)  # while a request still runs on slot 2
    slots.release(2)
    slots.release(1)
    assert slots.acquire(8) == (2, True), "the emptied slot is taken before adapter 7's idle one"


# ---- parity with peft ----------------------------------------------------------------------------------------------

PARITY_TOKENS = 10
# Two adapters on the tiny HF Llama: every projection (rank 4), and rsLoRA on a subset (rank 8, the slot width).
PEFT_ADAPTERS = {"everything": dict(r=4, lora_alpha=8, target_modules=list(PROJECTIONS)),
                 "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"])}


@pytest.fixture(scope="module")
def peft_models(tmp_path_factory):
    """The base folder, and per adapter its folder and the peft model (the oracle); None: the base model."""
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module)
    import peft
    import torch

    from tests.hf_models import build_tiny_hf_llama, save_hf_llama

    work = tmp_path_factory.mktemp("peft_engine")
    base = build_tiny_hf_llama("llama31", seed=0, vocab_size=512)  # the built-in tokenizer's vocabulary
    save_hf_llama(base, work / "base")
    oracles = {None: (None, base)}
    for index, (name, settings) in enumerate(PEFT_ADAPTERS.items(), start=1):
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**settings))
        torch.manual_seed(index)
        with torch.no_grad():
            for parameter_name, param in model.named_parameters():
                if ".lora_B." in parameter_name:
                    param.copy_(0.2 * torch.randn_like(param))
        model.save_pretrained(work / name)
        oracles[LoRARequest(name, index, str(work / name))] = (work / name, model.eval())
    return work / "base", oracles


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """HF's greedy tokens and the log-probability of each, from the raw logits."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=PARITY_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, generated)]
    return generated, np.array(logprobs)


@pytest.mark.parity
def test_mixed_adapters_and_base_in_one_batch_match_peft(peft_models):
    base_dir, oracles = peft_models
    llm = LLM(model=base_dir, tokenizer=BUILTIN_MODEL_DIR, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=MAX_RANK, **LIMITS)
    prompts = [[int(t) for t in np.random.default_rng(seed).integers(3, 512, size=n)] for seed, n in ((0, 7), (1, 21))]
    batch = [(prompt, request) for prompt in prompts for request in oracles]
    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params, use_tqdm=False,
                           lora_request=[r for _, r in batch])
    expected = {(tuple(p), r): hf_greedy(oracles[r][1], p) for p, r in batch}
    for prompt in prompts:
        assert len({tuple(expected[(tuple(prompt), r)][0]) for r in oracles}) == len(oracles), "adapters matter"
    for (prompt, request), output in zip(batch, outputs):
        expected_tokens, expected_logprobs = expected[(tuple(prompt), request)]
        got = output.outputs[0]
        assert list(got.token_ids) == expected_tokens, request
        got_logprobs = [step[token].logprob for step, token in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(got_logprobs, expected_logprobs, atol=2e-4)
