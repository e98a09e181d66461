"""`Sequence`: one continuation being generated — its tokens, text, log-probabilities and why it stopped."""

from __future__ import annotations

from jaxserve.engine.logprobs import SampledToken, candidate_logprobs
from jaxserve.engine.stop_strings import StopStringMatcher
from jaxserve.outputs import CompletionOutput, Logprob
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer, streaming_detokenizer


class Sequence:
    """Accumulates sampled tokens and decides when generation ends (EOS, stop ids, stop strings, length)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: tuple[int, ...], params: SamplingParams,
                 max_new_tokens: int, index: int = 0):
        self.index = index
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._tokenizer = tokenizer
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
        self._detokenizer = streaming_detokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._stop_strings = StopStringMatcher(params.stop, params.include_stop_str_in_output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, sampled: SampledToken, grammar_done: bool = False) -> str:
        """Records one token; returns the text it releases (possibly empty). `grammar_done`: the request's grammar
        allows nothing after this token, so the sequence stops with it (EOS, when sampled, stops it first)."""
        if self.max_new_tokens == 0:
            # Only the prompt is scored: the token its last position sampled is not an output.
            self._finish("length", None)
            return ""
        token = sampled.token_id
        self.token_ids.append(token)
        if self.logprobs is not None:
            self._record_logprobs(sampled)
        if token in self._stop_ids:
            # Like vLLM: the stop token stays in token_ids but not in the text; stop_reason names only explicit ids.
            self._finish("stop", token if token in self.params.stop_token_ids else None)
            return self._release(self._stop_strings.flush())
        last = len(self.token_ids) >= self.max_new_tokens or grammar_done
        if not last and not self.params.stop:
            # Most tokens: no stop string to look for and nothing ends here (the rest below would return the same).
            return self._release(self._detokenizer.push(token))
        text = self._detokenizer.push(token) + (self._detokenizer.flush() if last else "")
        if len(self.token_ids) < self.params.min_tokens:
            # As in vLLM, nothing stops a sequence before min_tokens: stop strings are looked for only after it.
            delta, matched = self._stop_strings.flush() + text, None
        else:
            delta, matched = self._stop_strings.feed(text)
        if matched is not None:
            self._finish("stop", matched)
        elif last:
            self._finish("stop" if grammar_done else "length", None)
            delta += self._stop_strings.flush()
        return self._release(delta)

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=tuple(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _release(self, delta: str) -> str:
        self.text += delta
        return delta

    def _record_logprobs(self, sampled: SampledToken) -> None:
        self.cumulative_logprob += sampled.logprob
        self.logprobs.append(candidate_logprobs(sampled, self._tokenizer))
