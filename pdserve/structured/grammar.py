"""The grammar engine behind structured output: llguidance (token bitmasks over an Earley parser
with a derivative-based lexer; https://github.com/guidance-ai/llguidance).

Two objects:

* :class:`GrammarCompiler`, one per worker (and one in the router, to refuse bad specs with a
  400 before any worker sees them): wraps the tokenizer once (about a second for a 50k
  vocabulary) and compiles :class:`~pdserve.structured.spec.StructuredOutputSpec` s. A compiled
  grammar is an initial matcher state; it is cached per spec (LRU, ``cache_size`` entries), so a
  schema is compiled once and every request with it starts from a cheap copy.
* :class:`GrammarMatcher`, one per sequence: the grammar state after the tokens it was advanced
  over. It does not care where those tokens were sampled, so the decode worker advances a fresh
  matcher over the token the prefill worker sampled, and a re-prefill after preemption or
  migration rebuilds it from the tokens generated so far (:meth:`GrammarCompiler.matcher`).

Specs whose per-token cost would be unbounded (huge counted repetitions, too many choices or
schema properties) are refused first by :func:`~pdserve.structured.limits.check_spec_limits`.
Compile time is bounded by llguidance's parser limits (:data:`INITIAL_LEXER_FUEL`, :data:`MAX_GRAMMAR_SIZE`: lexer fuel for
building the regex automata, a cap on grammar size) and the spec size
(:data:`~pdserve.structured.spec.MAX_SPEC_BYTES`); a spec that exceeds them fails to compile
(StructuredOutputError, a 400) instead of stalling a worker. Each mask computation is likewise
bounded by llguidance's per-step fuel. JSON is generated compact (no optional whitespace, as
vLLM's ``disable_any_whitespace``): a small model given free whitespace can emit newlines until
``max_tokens``; a schema's ``x-guidance`` key may turn whitespace back on.

The bitmask layout is llguidance's (and vLLM's): int32 words, token ``t`` allowed when bit
``t % 32`` of word ``t // 32`` is set. Torch-free: masks are numpy arrays; the Sampler applies
them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from pdserve.structured.limits import check_spec_limits
from pdserve.structured.spec import StructuredOutputError, StructuredOutputSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from pdserve.config import ModelConfig

# Bounds on compile work (llguidance's units; ~50k lexer fuel per ms): ~100 ms of regex
# analysis and a grammar of at most 200k symbols.
INITIAL_LEXER_FUEL = 5_000_000
MAX_GRAMMAR_SIZE = 200_000
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per compiler (LRU)
# Defaults of the JSON compiler (a schema's "x-guidance" key can override them).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """An int32 bitmask ``[rows, bitmask_words(vocab_size)]`` with every token allowed."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool ``[rows, vocab_size]``: True where the bitmask allows the token."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


class GrammarMatcher:
    """The grammar state of one sequence. Not thread-safe (one sequence, one step thread).

    ``num_tokens``: tokens advanced over so far.
    """

    def __init__(self, ll: llguidance.LLMatcher, spec: StructuredOutputSpec) -> None:
        self._ll = ll
        self.spec = spec
        self.num_tokens = 0

    def advance(self, token_ids: Sequence[int]) -> None:
        """Move the state over ``token_ids`` (sampled here or received from another worker).

        Raises StructuredOutputError when the grammar rejects a token (the state is then
        unusable: rebuild the matcher).
        """
        if not token_ids:
            return
        if not self._ll.consume_tokens(list(token_ids)):
            raise StructuredOutputError(
                self.spec.field,
                f"'{self.spec.field}': token sequence leaves the grammar after "
                f"{self.num_tokens} tokens: "
                f"{_first_line(self._ll.get_error())}",
            )
        self.num_tokens += len(token_ids)

    @property
    def is_terminated(self) -> bool:
        """True when the grammar is complete and only an end-of-sequence token may follow."""
        return bool(self._ll.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS is allowed)."""
        return bool(self._ll.is_accepting())

    @property
    def error(self) -> str:
        """The engine's error message; empty while the state is usable."""
        return str(self._ll.get_error())

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, C-contiguous)."""
        _check_bitmask(bitmask)
        words = bitmask.shape[1]
        ptr = bitmask.ctypes.data + row * words * 4
        self._ll.unsafe_compute_mask_ptr(ptr, words * 4)


def _check_bitmask(bitmask: np.ndarray) -> None:
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
        raise ValueError("bitmask must be a C-contiguous int32 array [rows, words]")


# Parallel bitmask fill only pays with many rows on many cores (measured: 16 JSON rows take
# 0.17 ms one by one, 0.20 ms through the pool, on 2 cores).
PARALLEL_MIN_ROWS = 8
PARALLEL_MIN_CPUS = 8
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Fill ``bitmask[row]`` for every (matcher, row). Rows not named are left as they are.

    With at least PARALLEL_MIN_ROWS rows on a machine of at least PARALLEL_MIN_CPUS CPUs the
    rows are filled in parallel (llguidance's thread pool, GIL released); on fewer cores its
    spinning workers would take CPU from the forward pass for a fill that costs ~10 us a row.
    """
    global _executor
    _check_bitmask(bitmask)
    if len(matchers) < PARALLEL_MIN_ROWS or (os.cpu_count() or 1) < PARALLEL_MIN_CPUS:
        for m, row in matchers:
            m.fill_bitmask(bitmask, row)
        return
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    words = bitmask.shape[1]
    _executor.unsafe_compute_mask_ptr(
        [(m._ll, row) for m, row in matchers], bitmask.ctypes.data, words * 4, bitmask.shape[0]
    )


_shared: dict[tuple[str, int, tuple[int, ...]], GrammarCompiler] = {}
_shared_lock = threading.Lock()


def shared_compiler(model: str, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """The process's compiler for ``model``'s tokenizer (built on first use, about a second).

    Raises StructuredOutputError (field ``structured_outputs``) when the model has no loadable
    tokenizer (e.g. ``--load-format dummy``).
    """
    from pdserve.config import ConfigError
    from pdserve.tokenizer import load_tokenizer

    key = (model, vocab_size, tuple(eos_token_ids))
    with _shared_lock:
        found = _shared.get(key)
        if found is None:
            try:
                tok = load_tokenizer(model)
            except ConfigError as e:
                raise StructuredOutputError(
                    "structured_outputs", f"structured output needs the model's tokenizer: {e}"
                ) from None
            found = GrammarCompiler(tok.hf, vocab_size, eos_token_ids or tok.eos_token_ids)
            _shared[key] = found
        return found


def resume_matcher(
    model: str,
    model_config: ModelConfig,
    spec: StructuredOutputSpec | None,
    token_ids: Sequence[int],
    num_output_tokens: int,
) -> GrammarMatcher | None:
    """A worker's matcher for a request: None without ``spec``; else compiled (cached per spec)
    by :func:`shared_compiler` for ``model``'s tokenizer and ``model_config``'s vocabulary and
    EOS ids, and advanced over the last ``num_output_tokens`` of ``token_ids`` (the output
    generated before a re-prefill). Raises StructuredOutputError."""
    if spec is None:
        return None
    k = num_output_tokens
    compiler = shared_compiler(model, model_config.vocab_size, model_config.eos_token_ids)
    return compiler.matcher(spec, token_ids[len(token_ids) - k :] if k else ())


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe.

    ``hf_tokenizer``: a fast Hugging Face tokenizer. ``vocab_size``: the model's vocabulary (the
    sampler's; ids past the tokenizer's are never allowed). ``eos_token_ids``: the ids that end a
    sequence (allowed once the grammar is complete). ``cache_size``: compiled grammars kept.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if not eos_token_ids:
            raise ValueError("structured output needs at least one end-of-sequence token id")
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL, max_grammar_size=MAX_GRAMMAR_SIZE
        )
        self._cache: OrderedDict[StructuredOutputSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses since start
        self.compile_s = 0.0  # seconds spent compiling since start

    def compile(self, spec: StructuredOutputSpec) -> None:
        """Compile ``spec`` into the cache (a no-op when cached).

        Raises StructuredOutputError naming ``spec.field`` when the engine cannot compile it.
        """
        self._initial(spec)

    def matcher(self, spec: StructuredOutputSpec, token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A new matcher for ``spec``, advanced over ``token_ids`` (output generated so far).

        Raises StructuredOutputError when the spec does not compile or the grammar rejects one
        of ``token_ids``.
        """
        initial = self._initial(spec)
        with self._lock:
            m = GrammarMatcher(initial.deep_copy(), spec)
        m.advance(token_ids)
        return m

    def _initial(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        start = time.perf_counter()
        check_spec_limits(spec)
        grammar = _grammar_text(spec)
        ll = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if ll.is_error():
            raise StructuredOutputError(
                spec.field, f"'{spec.field}' cannot be compiled: {_first_line(ll.get_error())}"
            )
        with self._lock:
            self.num_compiled += 1
            self.compile_s += time.perf_counter() - start
            self._cache[spec] = ll
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return ll

    @property
    def cache_len(self) -> int:
        """Compiled grammars held now."""
        with self._lock:
            return len(self._cache)


def _first_line(message: str, limit: int = 300) -> str:
    """The engine's error without its state dump: first line, at most ``limit`` characters, and
    when that line only introduces the cause (a regex parse error points at the spot on the next
    lines, then says ``error: unclosed group``), that cause."""
    lines = [s.strip() for s in message.strip().splitlines()] or ["unknown error"]
    line = lines[0]
    if line.endswith(":"):
        cause = next((s for s in lines[1:] if s.startswith("error:")), "")
        line = f"{line} {cause.removeprefix('error:').strip()}".rstrip(" :")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _grammar_text(spec: StructuredOutputSpec) -> str:
    """llguidance's grammar definition for ``spec``. Raises StructuredOutputError."""
    try:
        if spec.kind == "json_schema":
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_DEFAULTS)
            )
        if spec.kind == "json_object":
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_DEFAULTS
                )
            )
        if spec.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec.value))
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            lark = "start: " + " | ".join(json.dumps(c) for c in choices)
            return str(llguidance.LLMatcher.grammar_from_lark(lark))
        return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.value)))
    except StructuredOutputError:
        raise
    except Exception as e:  # the GBNF converter and JSON front end raise various types
        raise StructuredOutputError(spec.field, f"'{spec.field}' cannot be compiled: {e}") from e
