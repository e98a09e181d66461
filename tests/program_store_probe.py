"""One engine start against a given compilation cache folder, its program store the default one inside it (or none),
printed as one JSON object on stdout's last line: where each program came from, and what it generated.

Run by tests/test_program_store.py in fresh processes, since what is under test is what one process leaves in the
folders for the next (JAX's persistent cache and the program store), and JAX's in-memory caches would hide it.
Usage: python -m tests.program_store_probe CACHE_DIR BATCHED_TOKENS [none] (from the repository root; "none": no
program store, JAX's persistent cache alone)
"""

import dataclasses
import json
import sys

from jaxserve import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=32, max_num_seqs=1, block_size=8, num_kv_pages=8, use_tqdm_on_load=False)
PROMPTS = [[5, 9, 17, 3, 44, 7, 80, 12, 19, 2, 31], [11, 4]]
PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1),
          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, presence_penalty=0.5, logprobs=2)]


def main(cache_dir: str, batched_tokens: str, store: str | None = None) -> None:
    llm = LLM(model=None, compilation_cache_dir=cache_dir, compiled_dir=store,
              max_num_batched_tokens=int(batched_tokens), **ENGINE)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], PARAMS, use_tqdm=False)
    print(json.dumps({"sources": dataclasses.asdict(llm.engine.startup_stats.sources),
                      "tokens": [list(output.outputs[0].token_ids) for output in outputs]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
