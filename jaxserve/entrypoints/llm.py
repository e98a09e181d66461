"""`LLM`: offline generation (and, with `runner="pooling"`, embeddings) with vLLM's calling conventions, so evaluation
scripts port over unchanged."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxserve.checkpoint import ModelPlan, plan_model
from jaxserve.config import GENERATE_RUNNER, POOLING_RUNNER, EngineConfig, config_from
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.pooling_engine import PoolingEngine
from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.openai.prompts import (TokenizedPrompt, chat_prompt, normalize_prompts, lora_per_prompt,
                                     params_per_prompt, tokenize_prompt, with_priorities)
from jaxserve.errors import ConfigError, InvalidRequestError, JaxserveError
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from jaxserve.pooler_config import sentence_transformers_pooler
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer, load_tokenizer

Conversation = list[dict[str, Any]]

log = logging.getLogger(__name__)


class LLM:
    """A model loaded for offline generation.

    `model` is an HF folder (safetensors), a folder written by `jaxserve convert` (Orbax), or None for the built-in
    tiny random model (its output is noise; it exists so that everything runs without weights).
    """

    def __init__(self, model: str | Path | None = None, *, use_tqdm_on_load: bool = True, **settings: Any):
        """`settings` are EngineConfig's fields, under vLLM's names (max_model_len, max_num_seqs, block_size, ...)."""
        self._load(config_from({**settings, "model": model}), use_tqdm_on_load)
        engine = PoolingEngine if self.config.pooling else LLMEngine  # runner="pooling": embeddings (LLM.embed)
        self.engine = engine(self.model, self.tokenizer, self.config, progress=use_tqdm_on_load)

    def _load(self, config: EngineConfig, progress: bool) -> None:
        """The weights and tokenizer of `config`, and the config with the platform's step limits and the model's
        length limit filled in."""
        # Before loading: a backend that cannot run here must not wait for the weights.
        config.attention_implementation(jax.default_backend())
        # The weights are read when the engine starts, while its step programs compile.
        self.model: ModelPlan = plan_model(Path(config.model) if config.model is not None else None,
                                           dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                                           quantization=config.quantization)
        self.tokenizer: Tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer is not None
                                                   else self.model.model_dir)
        self.config = (config.with_platform_defaults(jax.default_backend())
                       .with_model_limit(self.model.config.max_position_embeddings)
                       .with_pooler(sentence_transformers_pooler(self.model.model_dir) if config.pooling else None))
        self._request_ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, use_tqdm_on_load: bool = True) -> LLM:
        """An LLM of a config built elsewhere (a preset with flags, by the command line)."""
        return cls(use_tqdm_on_load=use_tqdm_on_load, **dataclasses.asdict(config))

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output of one sequence, the model's limit when none was asked for."""
        return self.config.require("max_model_len")

    @property
    def is_follower(self) -> bool:
        """In a multi-process group, a process other than 0: it runs process 0's steps, never requests of its own."""
        return self.engine is not None and self.engine.runner.is_follower

    def follow_leader(self) -> None:
        """Follower: runs the steps process 0 broadcasts until process 0 calls `release_followers`."""
        log.info("following the steps of process 0")
        self.engine.runner.follow()
        log.info("process 0 released its followers")

    def release_followers(self) -> None:
        """Process 0, when done: ends the other processes' `follow_leader` (nothing to do on one process)."""
        if self.engine is not None:
            self.engine.runner.stop_followers()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates one continuation per prompt; prompts are text, `{"prompt_token_ids": [...]}`, or a list.

        `priority`, as in vLLM: one per prompt, lower served earlier; only with scheduling_policy="priority".
        `lora_request`, as in vLLM: one LoRA adapter for every prompt, or one (or None) per prompt; needs
        enable_lora=True.
        """
        self._require_runner(GENERATE_RUNNER, "LLM.generate")
        prompt_list = normalize_prompts(prompts)
        tokenized = [tokenize_prompt(p, self.tokenizer) for p in prompt_list]
        return self._run(tokenized, with_priorities(params_per_prompt(sampling_params, len(tokenized)), priority),
                         use_tqdm, lora_per_prompt(lora_request, len(tokenized)))

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`; needs runner="pooling"): prompts as `generate` takes them,
        `pooling_params` one for all or one per prompt, `truncate_prompt_tokens` (keep the last k tokens; -1:
        max_model_len) overriding theirs. The vectors are the final hidden states pooled as the engine's
        pooler_config says (last token or mean), normalized unless a PoolingParams says `use_activation=False`."""
        self._require_runner(POOLING_RUNNER, "LLM.embed")
        tokenized = [tokenize_prompt(p, self.tokenizer) for p in normalize_prompts(prompts)]
        params = _pooling_per_prompt(pooling_params, len(tokenized))
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        if priority is not None:
            if len(priority) != len(params):
                raise InvalidRequestError(f"got {len(priority)} priorities for {len(params)} prompts; pass one per "
                                          "prompt", param="priority")
            params = [p.with_priority(q) for p, q in zip(params, priority)]
        return [EmbeddingRequestOutput.from_base(output) for output in self._encode(tokenized, params, use_tqdm)]

    def _encode(self, prompts: list[TokenizedPrompt], params: list[PoolingParams],
                use_tqdm: bool) -> list[PoolingRequestOutput]:
        for prompt, p in zip(prompts, params):  # every prompt is checked before any runs
            self.engine.check_request(prompt.token_ids, p)
        ids = [str(next(self._request_ids)) for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt.token_ids, p, prompt=prompt.text)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        results = self._step_until_done(ids, use_tqdm)
        return [results[request_id] for request_id in ids]

    def _require_runner(self, runner: str, method: str) -> None:
        """Refuses a method of the other runner: generation on a pooling engine, embeddings on a generating one."""
        if self.config.runner != runner:
            remedy = ("create the LLM with runner=\"pooling\" (vLLM's --runner pooling)" if runner == POOLING_RUNNER
                      else "use LLM.embed, or create the LLM without runner=\"pooling\"")
            raise ConfigError(f"{method} needs runner={runner!r}, but this LLM has runner={self.config.runner!r}: "
                              f"{remedy}")

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             priority: Sequence[int] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (a list of messages) or to a list of them; `tools`
        (OpenAI's tool definitions) reach the template, as in vLLM (the answers are not read for calls here);
        `priority` and `lora_request`: as `generate`'s, per conversation."""
        self._require_runner(GENERATE_RUNNER, "LLM.chat")
        tokenized = [chat_prompt(self.tokenizer, conversation, add_generation_prompt,
                                 **{"tools": tools, **(chat_template_kwargs or {})})
                     for conversation in _as_conversations(messages)]
        return self._run(tokenized, with_priorities(params_per_prompt(sampling_params, len(tokenized)), priority),
                         use_tqdm, lora_per_prompt(lora_request, len(tokenized)))

    def run_each(self, prompts: list[TokenizedPrompt], params: list[SamplingParams],
                 loras: list[LoRARequest | None], use_tqdm: bool = True) -> list[RequestOutput | JaxserveError]:
        """Each prompt's output, or the error that refused it while the others ran (`jaxserve run-batch`: one bad
        request never stops the rest). `generate` and `chat` refuse the whole call instead, as vLLM's do."""
        self._require_runner(GENERATE_RUNNER, "run-batch")
        refused: dict[str, JaxserveError] = {}
        ids = [str(next(self._request_ids)) for _ in prompts]
        self._add(ids, prompts, params, loras, refused)
        results = self._step_until_done([i for i in ids if i not in refused], use_tqdm, failed=refused)
        return [refused[i] if i in refused else results[i] for i in ids]

    def _run(self, prompts: list[TokenizedPrompt], params: list[SamplingParams], use_tqdm: bool,
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        for prompt, p in zip(prompts, params):
            check_prompt_tokens(prompt.token_ids, vocab_size=self.model.config.vocab_size,
                                max_model_len=self.max_model_len, generates=p.max_tokens > 0)
        ids = [str(next(self._request_ids)) for _ in prompts]
        try:
            self._add(ids, prompts, params, loras)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        results = self._step_until_done(ids, use_tqdm)
        return [results[request_id] for request_id in ids]

    def _add(self, ids: list[str], prompts: list[TokenizedPrompt], params: list[SamplingParams],
             loras: list[LoRARequest | None], refused: dict[str, JaxserveError] | None = None) -> None:
        """Adds every request to the engine; a refused one raises, or with `refused` is recorded there."""
        for p in params:  # every distinct constraint starts compiling now, side by side; add_request waits for each
            if p.structured_outputs is not None:
                self.engine.grammars.compile(p.structured_outputs)
        for request_id, prompt, p, lora in zip(ids, prompts, params, loras):
            try:
                self.engine.add_request(request_id, prompt.token_ids, p, prompt=prompt.text, lora_request=lora)
            except JaxserveError as e:
                if refused is None:
                    raise
                refused[request_id] = e

    def _step_until_done(self, ids: list[str], use_tqdm: bool,
                         failed: dict[str, JaxserveError] | None = None) -> dict[str, RequestOutput]:
        """Steps until every request ended: their outputs. A request that ends with an error of its own (a failed
        output constraint) raises it, or with `failed` is recorded there while the others go on."""
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        results[output.request_id] = output
                        bar.update()
                    for request_id, error in self.engine.pop_failed():
                        if failed is None:
                            raise error
                        failed[request_id] = error
                        bar.update()
            except BaseException:  # a failed step, or an interrupt (Ctrl-C) between steps: the next call starts clean
                self.engine.abort_all_requests()
                raise
        return results


def _pooling_per_prompt(params: PoolingParams | Sequence[PoolingParams] | None, count: int) -> list[PoolingParams]:
    """One PoolingParams for every prompt: the default, the same one repeated, or a list of matching length."""
    if params is None or isinstance(params, PoolingParams):
        return [params or PoolingParams()] * count
    params = list(params)
    if len(params) != count or not all(isinstance(p, PoolingParams) for p in params):
        raise InvalidRequestError(f"got {len(params)} pooling params for {count} prompts; pass one, or one per prompt",
                                  param="pooling_params")
    return params


def _as_conversations(messages: Any) -> list[Conversation]:
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return [messages]
    if isinstance(messages, list) and messages and all(isinstance(c, list) and c for c in messages):
        return messages
    raise InvalidRequestError("messages must be a non-empty list of message dicts, or a list of such lists",
                              param="messages")
