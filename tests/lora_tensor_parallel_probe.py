"""LoRA adapters under tensor parallelism on 8 simulated CPU devices, printed as one JSON object on stdout's last line.

Run by tests/test_lora_tensor_parallel.py in a subprocess, because XLA_FLAGS must give 8 host devices before JAX
starts (the pattern of tests/tensor_parallel_probe.py). Usage: python -m tests.lora_tensor_parallel_probe WORK_DIR
(from the repository root).

The built-in model (4 attention heads, 2 KV heads) runs at TP 1, 2 and 4 with two adapter slots. Each engine runs
mixed batches (base model and two adapters in one batch); an engine runs batches with other adapters after the first,
so slots are rewritten while the step programs stay the same.
"""

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from jaxserve.checkpoint.random_lora import write_random_lora_adapter  # noqa: E402
from jaxserve.parallel.collectives import all_gather_shapes, count_collectives  # noqa: E402
from tests.test_lora_engine import MAX_RANK, builtin_config  # noqa: E402

# Two slots, and buckets of at most 16 tokens (9 step programs per engine): prompts of more than 16 tokens prefill in
# chunks beside other sequences' decodes.
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK, dtype="float32", max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=16, use_tqdm_on_load=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
PROMPTS = ("The weather today", "Once upon a time, in a land far away, there lived a")
# Adapter name -> what it adapts. "attn" and "mlp" cover every projection between them; "no_kv" leaves out k_proj and
# v_proj. At TP 4 the model runs its 2 KV heads repeated to 4, and "attn"'s k_proj and v_proj rows with them.
ADAPTERS = {"attn": dict(rank=4, projections=("q_proj", "k_proj", "v_proj", "o_proj")),
            "mlp": dict(rank=8, projections=("q_proj", "gate_proj", "up_proj", "down_proj"), seed=3, lora_alpha=32),
            "no_kv": dict(rank=6, projections=("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=5,
                          use_rslora=True)}
# Each engine's batches: every batch mixes the base model (None) with two adapters.
BATCHES = {1: (("attn", "mlp"), ("no_kv", "mlp"), ("attn", "no_kv")), 2: (("attn", "mlp"), ("no_kv", "mlp")),
           4: (("no_kv", "mlp"), ("attn", "no_kv"))}


def write_adapters(work_dir: Path) -> dict[str, LoRARequest]:
    config = builtin_config()
    requests = {}
    for lora_id, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        write_random_lora_adapter(work_dir / name, config, **spec)
        requests[name] = LoRARequest(name, lora_id, str(work_dir / name))
    return requests


def run_batch(llm: LLM, adapters: dict[str, LoRARequest], names: tuple[str, ...]) -> dict:
    """Greedy tokens and their log-probabilities for every prompt with the base model and each named adapter, all in
    one batch."""
    mixed = [(prompt, adapters.get(name)) for name in (None, *names) for prompt in PROMPTS]
    outputs = llm.generate([p for p, _ in mixed], GREEDY, use_tqdm=False, lora_request=[r for _, r in mixed])
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outputs],
                logprobs=[[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                          for o in outputs])


def stack_report(llm: LLM) -> dict:
    """Per projection and leaf (a, b): the sharding's spec and one device's shard shape."""
    lora = llm.engine.runner.lora.stack
    return {leaf: {p: dict(spec=list(array.sharding.spec), shard_shape=list(array.addressable_shards[0].data.shape),
                           shape=list(array.shape))
                   for p, array in arrays.items()}
            for leaf, arrays in (("a", lora.a), ("b", lora.b))}


def collectives_report(llm: LLM) -> dict:
    """The collectives of the 16-token greedy step program, combined (tuple) all-reduces included."""
    runner = llm.engine.runner
    text = runner.programs.step(runner.buckets.select(16, 4)).as_text()
    return dict(counted=count_collectives(text), all_gather_shapes=all_gather_shapes(text))


def engine_report(adapters: dict[str, LoRARequest], tp: int) -> dict:
    llm = LLM(tensor_parallel_size=tp, **ENGINE)
    report = dict(batches={",".join(names): run_batch(llm, adapters, names) for names in BATCHES[tp]},
                  stack=stack_report(llm), collectives=collectives_report(llm),
                  kv_heads=llm.model.config.num_key_value_heads)
    report["compiles_after_warmup"] = llm.engine.compiles_after_warmup
    return report


def main(work_dir: Path) -> None:
    adapters = write_adapters(work_dir)
    print(json.dumps({tp: engine_report(adapters, tp) for tp in BATCHES}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
