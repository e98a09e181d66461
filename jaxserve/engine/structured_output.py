"""Constrained decoding on llguidance: a request's StructuredOutputsParams → a grammar → one matcher per sequence,
which gives the packed bitmask of tokens allowed next and follows the tokens sampled.

llguidance (the grammar engine behind guidance, also used by vLLM and SGLang) is chosen over xgrammar because its
runtime is a Rust extension with no torch dependency, it takes any tokenizer as a list of token bytes (so our
sentencepiece and HF tokenizers share one path), and it computes a mask in tens of microseconds with the GIL
released. Each distinct constraint is compiled once, on the compiler's threads with a time limit (a cache keyed by
the constraint); each sequence gets a copy of the compiled matcher, which takes microseconds.

The mask is the sampler's input `allowed` (i32[S, ceil(vocab / 32)], bit t of word t // 32 set: token t may be
drawn); rows without a constraint are all ones, so the compiled programs are the same with or without one. A step's
masks are filled together (MaskFiller), each straight into its row of the step's array, and a step with many rows of a
large vocabulary on llguidance's thread pool over the host's cores: one thread filling 64 masks over a 128k
vocabulary took as long as the forward pass they should hide behind (10 ms per step on an H100 host).

llguidance's copies of one matcher share its lexer (a cache of lexer states built as masks need them) behind a lock
held for the whole of a mask's computation: copies of one matcher never compute masks at once, however many threads
there are (measured: two threads each filling its own copy take as long as one thread filling both, while two
independent matchers fill in parallel). So a compiled grammar keeps several independent matchers at its start, one
per mask thread, and hands their copies out in turn; the parallel fill gives each thread the rows of one lexer where
it can.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import json
import os
import threading
import time
from collections.abc import Mapping

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.errors import InvalidRequestError
from jaxserve.runner.token_masks import FilledMasks, all_allowed
from jaxserve.schedule import mask_width
from jaxserve.structured_outputs import PARAM, StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 256  # distinct constraints kept compiled
COMPILE_THREADS = 2  # constraints compiled at once; more wait their turn, within their own timeout
LEXER_SHARE_OF_TIMEOUT = 0.25  # of a constraint's compile time limit, what building its extra lexers may take
MAX_MASK_THREADS = 32  # most threads filling a step's masks: the cap of llguidance's own default pool size
# Least rows x vocabulary a step's masks must cover to be filled in parallel: 8 rows of Llama 3's 128k vocabulary
# (sequential, tens of microseconds a row: about the pool's hand-over cost), never a 512-token vocabulary's.
PARALLEL_FROM_TOKENS = 1 << 20
# JSON without optional whitespace: every output stays valid and no token goes to spaces (a schema's own
# "x-guidance" options still win).
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, lexer: int = 0):
        self._matcher = matcher
        self._width = mask_width(vocab_size)
        # Which lexer it shares with the other copies of the same start matcher (their masks are computed one at a
        # time): an identity, equal only between matchers that share one.
        self.lexer = lexer

    def next_mask(self) -> np.ndarray:  # i32[ceil(vocab / 32)]
        """The tokens the grammar allows next, as packed bits."""
        mask = np.zeros((1, self._width), np.int32)
        self.fill_mask(mask, 0)
        return mask[0]

    def fill_mask(self, masks: np.ndarray, row: int) -> None:  # masks: i32[S, ceil(vocab / 32)]
        """Writes `next_mask` into masks[row] (the whole row), on this thread."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, masks, row)

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


class MaskFiller:
    """Fills a step's masks: each constrained row's grammar writes its next mask straight into that row of the step's
    i32[S, W] array, the other rows allowing everything.

    With more than one thread, a step with enough to fill (rows x vocabulary >= `parallel_from_tokens`) is filled in
    parallel on llguidance's executor (a Rust thread pool; the GIL is released, and the calling thread only waits, so
    the pool may take every core). Otherwise the rows are filled one after the other on the calling thread: the
    simple path, kept as the reference the parallel one must equal, and the faster one for small steps, since
    handing a step to the pool costs its idle threads' wake-up (0.3-0.5 ms measured on a 2-core virtual machine,
    where masks over a 512-token vocabulary take microseconds).
    """

    def __init__(self, vocab_size: int, threads: int | None = None, parallel_from_tokens: int = PARALLEL_FROM_TOKENS):
        self.vocab_size = vocab_size
        self.width = mask_width(vocab_size)  # W: words of a row's mask
        self.threads = threads if threads is not None else default_mask_threads()  # 1: the sequential path only
        self.parallel_from_tokens = parallel_from_tokens  # least rows x vocabulary a step fills on the pool
        # llguidance's pool of `threads` threads; None on the sequential path
        self._executor = llguidance.LLExecutor(self.threads) if self.threads > 1 else None

    def filled(self, grammars: Mapping[int, GrammarMatcher], num_rows: int) -> FilledMasks:
        """The step's masks (num_rows rows), each grammar's row filled (row -> its sequence's matcher, not done)."""
        allowed = all_allowed(num_rows, self.width)
        if self._executor is None or len(grammars) * self.vocab_size < self.parallel_from_tokens:
            for row, grammar in grammars.items():
                grammar.fill_mask(allowed, row)
        else:
            # Rows sharing a lexer side by side: the pool splits the list into contiguous runs, one per thread.
            by_lexer = sorted(grammars.items(), key=lambda row_grammar: row_grammar[1].lexer)
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(grammar._matcher, row) for row, grammar in by_lexer], allowed)
        return FilledMasks(allowed, frozenset(grammars))


def default_mask_threads() -> int:
    """The cores this process may run on (up to MAX_MASK_THREADS): the engine thread waits while the masks fill."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_MASK_THREADS))


class CompiledGrammar:
    """A constraint compiled for the engine's tokenizer: independent matchers at the start of its grammar (each with
    a lexer of its own), which the sequences constrained by it copy in turn."""

    def __init__(self, constraint: StructuredOutputsParams, pristine: list[llguidance.LLMatcher], vocab_size: int):
        self.constraint = constraint  # what was compiled
        self._pristine = pristine
        self._vocab_size = vocab_size
        self._turns = itertools.count()  # whose copy the next sequence gets (next() is atomic: any thread may call)

    @property
    def num_lexers(self) -> int:
        """Independent matchers whose copies the sequences get: at most this many masks are computed at once."""
        return len(self._pristine)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (a copy: microseconds, whatever the grammar)."""
        pristine = self._pristine[next(self._turns) % len(self._pristine)]
        return GrammarMatcher(pristine.deep_copy(), self._vocab_size, lexer=id(pristine))


class GrammarCompiler:
    """Compiles constraints for a tokenizer, each once (a cache keyed by the constraint), on the compiler's own
    threads (llguidance releases the GIL), each under a wall-clock limit: a grammar that takes longer is refused.

    Two ways to wait: `check` blocks the calling thread (offline use), `compiled` awaits on the event loop (the
    server: no thread is held while a grammar compiles, so slow grammars delay only their own requests). Safe to call
    from several threads. `masks` fills the steps' masks from the matchers (`mask_threads`: its threads, by default
    the host's cores; 1 fills them one by one).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, compile_timeout_s: float,
                 mask_threads: int | None = None):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s  # longest a constraint may take to compile
        self.masks = MaskFiller(vocab_size, mask_threads)  # fills each step's masks from its rows' matchers
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
                compiled = self._pool.submit(_compile, self._tokenizer, constraint, self.vocab_size,
                                             self.masks.threads, self.compile_timeout_s * LEXER_SHARE_OF_TIMEOUT)
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


def _compile(tokenizer: llguidance.LLTokenizer, constraint: StructuredOutputsParams, vocab_size: int,
             lexers: int, extra_lexers_s: float) -> CompiledGrammar:
    """The constraint compiled, with up to `lexers` independent start matchers (the ones after the first built
    within `extra_lexers_s`); InvalidRequestError if it does not compile (the error is kept with the cached compile,
    so the same bad constraint is refused at once the next time)."""
    grammar = _grammar_text(constraint)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise InvalidRequestError(f"the {constraint.kind} constraint is not valid: {error}", param=PARAM)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"the {constraint.kind} constraint cannot be used: {matcher.get_error()}",
                                  param=PARAM)
    return CompiledGrammar(constraint, [matcher, *_more_lexers(tokenizer, grammar, lexers - 1, extra_lexers_s)],
                           vocab_size)


def _more_lexers(tokenizer: llguidance.LLTokenizer, grammar: str, count: int,
                 budget_s: float) -> list[llguidance.LLMatcher]:
    """Up to `count` more matchers of an accepted grammar, each built anew (a lexer of its own), until `budget_s` is
    spent: each costs what the first did (under a millisecond for a small JSON Schema), so a grammar that is slow to
    build gets fewer rather than its compile running out of time."""
    matchers, deadline = [], time.monotonic() + budget_s
    while len(matchers) < count and time.monotonic() < deadline:
        matchers.append(llguidance.LLMatcher(tokenizer, grammar, log_level=0))
    return matchers


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
