"""The model families under tensor parallelism on 8 simulated CPU devices, printed as one JSON object on stdout's
last line: greedy tokens and their logprobs of each run in RUNS, by style and run name.

Run by tests/test_model_families_tp.py in a subprocess, because XLA_FLAGS must give 8 host devices before JAX
starts. The parent writes the checkpoints with transformers (this process needs no torch). Usage:
python -m tests.model_families_probe WORK_DIR STYLE... (from the repository root; WORK_DIR/STYLE holds each model)
"""

import os
import sys

# Only when run: the tests import RUNS and prompts from here, and an 8-device XLA_FLAGS in the pytest process would
# reach every process it starts (a `jaxserve generate --tensor-parallel-size 2` expected to fail would then run).
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.checkpoint import BUILTIN_MODEL_DIR  # noqa: E402

PALLAS = dict(attention_backend="pallas", pallas_interpret=True)  # the Pallas kernel, run by its interpreter on CPU
# style -> (run name, tensor parallel size, engine switches): every family at TP 2 and 4 (TP 1 is
# tests/test_model_families.py's engine parity, in process). What the sharding adds: Qwen2's q biases split with
# their heads and its k/v biases repeated with the KV heads at TP 4 (2 KV heads); Qwen3's q/k norms replicated;
# Mistral's window masked by the Pallas kernel (interpreted) inside shard_map at TP 2, by XLA's at TP 4.
RUNS: dict[str, tuple[tuple[str, int, dict], ...]] = {
    "qwen2": (("tp2", 2, {}), ("tp4", 4, {})),
    "qwen3": (("tp2", 2, {}), ("tp4", 4, {})),
    "mistral": (("tp2-pallas", 2, PALLAS), ("tp4", 4, {})),
}
# Chunked prefill (prompts of up to 30 tokens in 16-token steps) and prefix caching on; 7 small programs per engine.
ENGINE = dict(tokenizer=str(BUILTIN_MODEL_DIR), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, block_size=8, num_kv_pages=24, use_tqdm_on_load=False)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def prompts() -> list[list[int]]:
    """Four prompts, two sharing a 16-token prefix; the same the parent gives HF."""
    import numpy as np

    rng = np.random.default_rng(11)
    shared = [int(t) for t in rng.integers(3, 512, size=16)]
    own = [[int(t) for t in rng.integers(3, 512, size=n)] for n in (4, 21, 9, 14)]
    return [shared + own[0], own[1], shared + own[2], own[3]]


def run(folder: Path, tp: int, **switches) -> dict:
    llm = LLM(model=str(folder), tensor_parallel_size=tp, **ENGINE, **switches)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    return dict(tokens=[list(c.token_ids) for c in completions],
                logprobs=[[step[t].logprob for step, t in zip(c.logprobs, c.token_ids)] for c in completions],
                compiles_after_warmup=llm.engine.compiles_after_warmup)


def main(work_dir: Path, styles: list[str]) -> None:
    report = {style: {name: run(work_dir / style, tp, **switches) for name, tp, switches in RUNS[style]}
              for style in styles}
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
