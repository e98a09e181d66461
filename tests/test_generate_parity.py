"""32 greedy tokens from jaxserve's decoder equal HF transformers' `generate` on tiny random Llamas."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.checkpoint import BUILTIN_MODEL_DIR  # noqa: E402
from jaxserve.reference.reference_llm import ReferenceLLM  # noqa: E402
from tests.hf_models import save_tiny_hf_llama  # noqa: E402

pytestmark = pytest.mark.parity
NEW_TOKENS = 32


# The reference decoder on every style; the paged engine (small limits: few programs to compile) on one.
@pytest.mark.parametrize("style, engine", [("llama2", False), ("llama31", False), ("tied", False), ("llama31", True)])
def test_greedy_tokens_match_hf_generate(tmp_path, style, engine):
    # vocab 512 so the built-in tokenizer can serve these checkpoints.
    hf_model = save_tiny_hf_llama(tmp_path, style, vocab_size=512)
    prompts = [list(np.random.default_rng(seed).integers(3, 512, size=n)) for seed, n in ((0, 7), (1, 19))]
    llm = (LLM if engine else ReferenceLLM)(model=tmp_path, tokenizer=BUILTIN_MODEL_DIR, dtype="float32",
                                            max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
                                            use_tqdm_on_load=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected
