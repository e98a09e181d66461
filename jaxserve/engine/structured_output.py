"""Constrained decoding on llguidance: a request's StructuredOutputsParams → a grammar → one matcher per sequence,
which gives the packed bitmask of tokens allowed next and follows the tokens sampled.

llguidance (the grammar engine behind guidance, also used by vLLM and SGLang) is chosen over xgrammar because its
runtime is a Rust extension with no torch dependency, it takes any tokenizer as a list of token bytes (so our
sentencepiece and HF tokenizers share one path), and it computes a mask in tens of microseconds with the GIL
released. Each distinct constraint is compiled once, on the compiler's threads with a time limit (a cache keyed by
the constraint); each sequence gets a copy of the compiled matcher, which takes microseconds.

The mask is the sampler's input `allowed` (i32[S, ceil(vocab / 32)], bit t of word t // 32 set: token t may be
drawn); rows without a constraint are all ones, so the compiled programs are the same with or without one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.errors import InvalidRequestError
from jaxserve.schedule import mask_width
from jaxserve.structured_outputs import PARAM, StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 256  # distinct constraints kept compiled
COMPILE_THREADS = 2  # constraints compiled at once; more wait their turn, within their own timeout
# JSON without optional whitespace: every output stays valid and no token goes to spaces (a schema's own
# "x-guidance" options still win).
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._width = mask_width(vocab_size)

    def next_mask(self) -> np.ndarray:  # i32[ceil(vocab / 32)]
        """The tokens the grammar allows next, as packed bits."""
        mask = np.zeros((1, self._width), np.int32)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, mask)
        return mask[0]

    def accept(self, token_id: int) -> None:
        """Follows a sampled token (one the mask allowed; any other leaves the matcher failed)."""
        self._matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """Nothing more may follow: the grammar ended (its EOS taken) or failed."""
        return self._matcher.is_stopped() or self._matcher.is_error()


class GrammarCompiler:
    """Compiles constraints for a tokenizer, each once (a cache keyed by the constraint), and hands out matchers:
    copies of the compiled one, so starting a sequence costs microseconds on the engine thread whatever the grammar.

    Compiling runs on the compiler's own threads (llguidance releases the GIL) with a wall-clock limit: a grammar
    that takes longer is refused, and the caller (a server request thread) never waits longer than that. Safe to
    call from several threads.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, compile_timeout_s: float):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s  # longest a constraint may take to compile
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self._lock = threading.Lock()  # guards the cache
        self._compiled: collections.OrderedDict[StructuredOutputsParams, concurrent.futures.Future] = (
            collections.OrderedDict())  # constraint -> its compile (pristine matcher), least recently used first
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def check(self, constraint: StructuredOutputsParams) -> None:
        """InvalidRequestError (param: structured_outputs) if the constraint cannot be compiled, or not in time."""
        self._pristine(constraint)

    def matcher(self, constraint: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the constraint's grammar."""
        return GrammarMatcher(self._pristine(constraint).deep_copy(), self.vocab_size)

    def _pristine(self, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                compiled = self._pool.submit(_compile, self._tokenizer, constraint)
                self._compiled[constraint] = compiled
                if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(constraint)
        try:
            return compiled.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(f"the {constraint.kind} constraint did not compile within "
                                      f"{self.compile_timeout_s:g} s", param=PARAM) from None


def _compile(tokenizer: llguidance.LLTokenizer, constraint: StructuredOutputsParams) -> llguidance.LLMatcher:
    """The constraint's matcher at the start of its grammar; InvalidRequestError if it does not compile (the error is
    kept with the cached compile, so the same bad constraint is refused at once the next time)."""
    grammar = _grammar_text(constraint)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidRequestError(f"the {constraint.kind} constraint is not valid: {error}", param=PARAM)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"the {constraint.kind} constraint cannot be used: {matcher.get_error()}",
                                  param=PARAM)
    return matcher


def _grammar_text(constraint: StructuredOutputsParams) -> str:
    """llguidance's grammar for the constraint (not yet checked)."""
    try:
        if constraint.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.json, defaults=_JSON_OPTIONS)
        if constraint.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if constraint.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        if constraint.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(constraint.choice)))
        return llguidance.grammar_from("grammar", constraint.grammar)
    except ValueError as error:
        raise InvalidRequestError(f"the {constraint.kind} constraint is not valid: {error}", param=PARAM) from None


class _TokenList:
    """The tokenizer as llguidance's TokenizerWrapper reads it: every id's bytes, EOS, BOS and how text encodes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        # Ids the model has beyond the tokenizer's vocabulary (padding rows of the embedding) are never allowed:
        # they get a special-token spelling no grammar can match.
        self.tokens = [tokenizer.token_bytes(i) if i < tokenizer.vocab_size else f"<|unused_{i}|>".encode()
                       for i in range(vocab_size)]
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids) | set(range(tokenizer.vocab_size, vocab_size)))

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenList(tokenizer, vocab_size)), n_vocab=vocab_size,
                                  eos_token=list(tokenizer.eos_token_ids))
