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

import asyncio
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

    @property
    def accepts_end(self) -> bool:
        """The tokens followed so far make a whole output of the grammar (it may end here)."""
        return self._matcher.is_accepting()

    @property
    def failure(self) -> str | None:
        """Why the grammar cannot go on (the grammar engine's first line), when it failed rather than ended."""
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error().splitlines()[0]


class CompiledGrammar:
    """A constraint compiled for the engine's tokenizer: the matcher at the start of its grammar, which every
    sequence constrained by it copies."""

    def __init__(self, constraint: StructuredOutputsParams, pristine: llguidance.LLMatcher, vocab_size: int):
        self.constraint = constraint  # what was compiled
        self._pristine = pristine
        self._vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (a copy: microseconds, whatever the grammar)."""
        return GrammarMatcher(self._pristine.deep_copy(), self._vocab_size)


class GrammarCompiler:
    """Compiles constraints for a tokenizer, each once (a cache keyed by the constraint), on the compiler's own
    threads (llguidance releases the GIL), each under a wall-clock limit: a grammar that takes longer is refused.

    Two ways to wait: `check` blocks the calling thread (offline use), `compiled` awaits on the event loop (the
    server: no thread is held while a grammar compiles, so slow grammars delay only their own requests). Safe to call
    from several threads.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, compile_timeout_s: float):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s  # longest a constraint may take to compile
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self._lock = threading.Lock()  # guards the cache
        self._compiled: collections.OrderedDict[StructuredOutputsParams, concurrent.futures.Future] = (
            collections.OrderedDict())  # constraint -> its compile (a CompiledGrammar), least recently used first
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def check(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, waited for on this thread; InvalidRequestError (param: structured_outputs) if it
        cannot be compiled, or not in time."""
        try:
            return self.compile(constraint).result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow(constraint) from None

    async def compiled(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """`check` awaited on the running event loop instead of blocking a thread."""
        compiling = asyncio.wrap_future(self.compile(constraint))
        compiling.add_done_callback(_read_outcome)
        try:
            # Shielded: a waiter that gives up must not cancel the compile other requests share through the cache.
            return await asyncio.wait_for(asyncio.shield(compiling), self.compile_timeout_s)
        except TimeoutError:
            raise self._too_slow(constraint) from None

    def matcher(self, constraint: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the constraint's grammar (compiled first if it is not cached)."""
        return self.check(constraint).matcher()

    def compile(self, constraint: StructuredOutputsParams) -> concurrent.futures.Future:
        """The constraint's compile (a Future of its CompiledGrammar), started unless cached."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                compiled = self._pool.submit(_compile, self._tokenizer, constraint, self.vocab_size)
                self._compiled[constraint] = compiled
                if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(constraint)
        return compiled

    def _too_slow(self, constraint: StructuredOutputsParams) -> InvalidRequestError:
        return InvalidRequestError(f"the {constraint.kind} constraint did not compile within "
                                   f"{self.compile_timeout_s:g} s", param=PARAM)


def _read_outcome(compiling: asyncio.Future) -> None:
    """Marks a compile's failure as seen: after a waiter gave up on it, nobody else reads it (asyncio would log it)."""
    if not compiling.cancelled():
        compiling.exception()


def _compile(tokenizer: llguidance.LLTokenizer, constraint: StructuredOutputsParams, vocab_size: int
             ) -> CompiledGrammar:
    """The constraint compiled; InvalidRequestError if it does not compile (the error is kept with the cached
    compile, so the same bad constraint is refused at once the next time)."""
    grammar = _grammar_text(constraint)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidRequestError(f"the {constraint.kind} constraint is not valid: {error}", param=PARAM)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"the {constraint.kind} constraint cannot be used: {matcher.get_error()}",
                                  param=PARAM)
    return CompiledGrammar(constraint, matcher, vocab_size)


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
