"""`ReferenceLLM`: `LLM`'s offline API over the dense reference decoder, the oracle the engine is tested against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jaxserve.config import config_from
from jaxserve.engine.logprobs import candidate_logprobs
from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.engine.sequence import Sequence as GeneratingSequence
from jaxserve.entrypoints.llm import LLM
from jaxserve.openai.prompts import TokenizedPrompt
from jaxserve.errors import InvalidRequestError
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.reference.dense_decoder import DecodeRequest, DenseDecoder
from jaxserve.sampling_params import SamplingParams


class ReferenceLLM(LLM):
    """Loads as `LLM` does (the same settings) and answers `generate` / `chat` alike, but decodes with the simple
    dense-cache decoder: whole-batch prefill, one token per step, numpy sampling. `max_num_seqs` is its batch."""

    def __init__(self, model: str | Path | None = None, *, use_tqdm_on_load: bool = False, **settings: Any):
        self._load(config_from({**settings, "model": model}), use_tqdm_on_load)
        self.engine = None
        loaded = self.model.load(use_tqdm_on_load)
        self._decoder = DenseDecoder(loaded.config, loaded.graphdef, loaded.params, loaded.dtype,
                                     max_batch=self.config.max_num_seqs, seed=self.config.seed)

    def _run(self, prompts: list[TokenizedPrompt], params: list[SamplingParams], use_tqdm: bool,
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        if any(lora is not None for lora in loras):
            raise InvalidRequestError("the reference decoder runs no LoRA adapters", param="lora_request")
        for prompt in prompts:
            check_prompt_tokens(prompt.token_ids, vocab_size=self.model.config.vocab_size,
                                max_model_len=self.max_model_len)
        if any(p.n > 1 for p in params):
            raise InvalidRequestError("the reference decoder does not support n > 1", param="n")
        eos = self.tokenizer.eos_token_ids
        budgets = [min(p.max_tokens, self.max_model_len - len(t.token_ids)) for t, p in zip(prompts, params)]
        sequences = [GeneratingSequence(self.tokenizer, t.token_ids, p, n) for t, p, n in zip(prompts, params, budgets)]
        requests = [DecodeRequest(t.token_ids, p, n, eos) for t, p, n in zip(prompts, params, budgets)]
        # None for the first prompt token (nothing predicts it); the decoder reports the others.
        prompt_logprobs = [[None] if p.prompt_logprobs is not None else None for p in params]

        def on_prompt_scores(index, scores) -> None:
            prompt_logprobs[index] += [candidate_logprobs(token, self.tokenizer) for token in scores]

        with tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm) as bar:
            def on_token(index, token) -> bool:
                sequence = sequences[index]
                sequence.append(token)
                bar.update(int(sequence.finished))
                return sequence.finished
            self._decoder.decode(requests, on_token, on_prompt_scores)
        return [
            RequestOutput(request_id=str(next(self._request_ids)), prompt=t.text, prompt_token_ids=t.token_ids,
                          outputs=[s.to_output()], finished=True, prompt_logprobs=scored)
            for t, s, scored in zip(prompts, sequences, prompt_logprobs)
        ]
