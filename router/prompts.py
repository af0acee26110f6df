"""Prompt preparation for both gateways: text and chat conversations to token ids, off the loop.

The HTTP and gRPC gateways both turn a request's prompt into token ids here (tokenize, chat
template with its controls and tools, and, for echo, token ids back to text) and check
structured-output specs against the tokenizer (a grammar compile). The work runs on one dedicated
thread: it takes milliseconds per prompt but seconds for a multi-MB one (and about a second for
the first structured request, which wraps the tokenizer for the grammar engine), which must never
stall the event loop (health checks, other streams).

A text too long to fit in ``max_model_len`` tokens whatever its content is refused before it is
tokenized (QA D5: a 12 MB prompt took 9.5 s to tokenize, holding up every other request, before
its 400): no token covers more than the vocabulary's longest token (``max_token_bytes``, 81 for
SmolLM2), so a text of more than ``max_model_len * max_token_bytes`` bytes has more than
``max_model_len`` tokens. Without a normalizer (byte-level BPE) that bound is exact; a
normalizer may shorten the text first (NFKC: "ﬁ" -> "fi"), so then it is taken
:data:`NORMALIZER_SLACK` times. No prompt that fits is refused; one that slips under the bound is
tokenized and refused by the exact length check as before.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pdserve.structured.grammar import GrammarCompiler, allocate_bitmask, unpack_bitmask
from pdserve.structured.spec import StructuredOutputError, StructuredOutputSpec
from pdserve.tokenizer import Tokenizer, TokenizerError
from router.errors import BadRequest, ContextLengthExceeded

_T = TypeVar("_T")

# Budget for a spec's first token mask, measured in the router (ms). Specs within
# pdserve.structured.limits take ~10 ms at most; one over this budget would cost every decode
# step about as much, stalling the other sequences of its batch, so it is refused. A backstop for
# what the static limits miss, set well above them (a{1000000} took ~300 ms): a wall-clock
# budget must not refuse a valid spec on a loaded 2-core machine, where ~10 ms can become ~50.
MAX_FIRST_MASK_MS = 200.0
# Factor on the byte bound for tokenizers with a normalizer (which may shrink the text).
NORMALIZER_SLACK = 4


def check_text(text: str, param: str) -> None:
    """Raise BadRequest naming ``param`` when ``text`` is not encodable as UTF-8.

    JSON ``\\udc80`` escapes (and raw CESU-style bytes such as ED A0 80, which Python's JSON
    decoder accepts) produce lone UTF-16 surrogates that no tokenizer can encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"'{param}' is not valid Unicode: it holds a lone surrogate "
            f"U+{ord(text[e.start]):04X} at character {e.start}",
            param=param,
        ) from None


_PROBE_TOOL = "pdserve_probe_function"  # a made-up tool name: does the template print tools?


class PromptPreparer:
    """Tokenizes prompts for the gateways on one thread of its own.

    ``chat_template``: a Jinja template used instead of the model's (``--chat-template``).
    ``max_mask_ms``: the budget for a structured-output spec's first token mask (ms).

    NOTE: one thread, so the (Rust) tokenizer is never used by two preparations at once.
    Errors are BadRequest naming the request field (``param``) the prompt came from.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        max_mask_ms: float = MAX_FIRST_MASK_MS,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_mask_ms = max_mask_ms
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._grammar: GrammarCompiler | None = None  # built on the first structured request
        self._bytes_per_token: int | None = None  # bound on input bytes one token covers
        self._renders_tools: bool | None = None  # the chat template shows a request's tools

    async def _run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    async def text(
        self,
        text: str,
        param: str,
        add_special_tokens: bool = True,
        max_model_len: int | None = None,
    ) -> list[int]:
        """Token ids of a plain-text prompt (no chat template). With ``max_model_len``, a text
        that cannot fit in that many tokens is a ContextLengthExceeded (400) naming ``param``,
        raised without tokenizing it."""
        check_text(text, param)
        try:
            return await self._run(self._encode, text, add_special_tokens, max_model_len, param)
        except TokenizerError as e:
            raise BadRequest(str(e), param=param) from None

    def _encode(
        self, text: str, add_special_tokens: bool, max_model_len: int | None, param: str
    ) -> list[int]:
        if max_model_len is not None:
            self._check_length(text, max_model_len, param)
        return self.tokenizer.encode(text, add_special_tokens)

    def max_prompt_bytes(self, max_model_len: int) -> int:
        """UTF-8 bytes above which no text fits in ``max_model_len`` tokens (see the module
        docstring). The first call scans the vocabulary (~0.3 s for 49k tokens)."""
        if self._bytes_per_token is None:
            hf = self.tokenizer.hf
            longest = 1
            for i in range(len(hf)):  # the token's string and its text, whichever is longer
                piece = hf.convert_ids_to_tokens(i) or ""
                text = hf.decode([i], clean_up_tokenization_spaces=False)
                longest = max(longest, len(piece.encode()), len(text.encode()))
            slack = 1 if hf.backend_tokenizer.normalizer is None else NORMALIZER_SLACK
            self._bytes_per_token = longest * slack
        return max_model_len * self._bytes_per_token

    def _check_length(self, text: str, max_model_len: int, param: str) -> None:
        bound = self.max_prompt_bytes(max_model_len)
        if len(text) <= bound // 4:  # at most 4 bytes a character
            return
        size = len(text) if len(text) > bound else len(text.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise ContextLengthExceeded(
                f"'{param}' is {size} bytes long, more than any prompt within this model's "
                f"maximum context length (--max-model-len) of {max_model_len} tokens can be "
                f"(at most {bound} bytes with this tokenizer); shorten the prompt",
                param=param,
            )

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        param: str,
        control_prefix: str = "",
        **controls: Any,
    ) -> str:
        """The prompt text the chat template makes of a conversation (``{'role', 'content', ...}``
        dicts, oldest first). ``controls``: keyword arguments of ``Tokenizer.render_chat``
        (``add_generation_prompt``, ``continue_final_message``, ``tools``, ``documents``,
        ``chat_template_kwargs``); the configured template override is added. A template error
        names ``param``, or ``control_prefix`` + the control at fault."""
        return await self._template(
            self.tokenizer.render_chat, messages, param, control_prefix, controls
        )

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        param: str,
        control_prefix: str = "",
        max_model_len: int | None = None,
        **controls: Any,
    ) -> list[int]:
        """Token ids of a conversation with the chat template applied (by default with the
        assistant turn opened); arguments as :meth:`render_chat`. With ``max_model_len``, a
        rendered prompt that cannot fit is refused before it is tokenized (as :meth:`text`)."""

        def apply(conversation: list[dict[str, Any]], **kw: Any) -> list[int]:
            text = self.tokenizer.render_chat(conversation, **kw)
            # the template writes any BOS itself (as Tokenizer.apply_chat_template)
            return self._encode(text, False, max_model_len, param)

        return await self._template(apply, messages, param, control_prefix, controls)

    async def _template(
        self,
        fn: Callable[..., _T],
        messages: Sequence[Mapping[str, Any]],
        param: str,
        control_prefix: str,
        controls: Mapping[str, Any],
    ) -> _T:
        conversation = self._conversation(messages, param)
        try:
            return await self._run(fn, conversation, chat_template=self.chat_template, **controls)
        except TokenizerError as e:
            raise BadRequest(str(e), param=_param(e, param, control_prefix)) from None

    async def renders_tools(self) -> bool:
        """Whether the chat template writes a request's ``tools`` into the prompt (some, such
        as SmolLM2's, ignore them, so the model never learns of the tools). Probed once with a
        made-up function; a template that fails on it counts as not rendering tools."""
        if self._renders_tools is None:
            probe = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
            try:
                text = await self._run(
                    self.tokenizer.render_chat,
                    [{"role": "user", "content": "hi"}],
                    tools=[probe],
                    chat_template=self.chat_template,
                )
            except TokenizerError:
                text = ""
            self._renders_tools = _PROBE_TOOL in text
        return self._renders_tools

    @staticmethod
    def _conversation(messages: Sequence[Mapping[str, Any]], param: str) -> list[dict[str, Any]]:
        for m in messages:
            check_text(m.get("content") or "", param)  # None: an assistant turn of tool calls
        return [dict(m) for m in messages]

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (for echo); the ids must already be checked against the vocab."""
        return await self._run(self.tokenizer.decode, list(token_ids), skip_special_tokens)

    async def check_structured(
        self, spec: StructuredOutputSpec, allowed_token_ids: Sequence[int] | None = None
    ) -> None:
        """Compile ``spec`` against the tokenizer (cached per spec) so a spec the grammar engine
        cannot compile, or whose first token mask takes longer than ``max_mask_ms``, is a 400
        naming its field before any worker sees it. So is a spec that matches no output: it
        allows no first token but EOS while the empty output does not match it (the regex
        ``a[^\\s\\S]``; llguidance then allows EOS alone). So is ``allowed_token_ids`` (vLLM's
        extension) holding none of the tokens the grammar allows first, a request no output can
        satisfy (past token 1 the grammar wins over it, as over ``logit_bias``; see
        :mod:`pdserve.sampling_masks`). Raises BadRequest."""
        try:
            await self._run(self._compile, spec, allowed_token_ids)
        except StructuredOutputError as e:
            raise BadRequest(str(e), param=e.field) from None

    def _compile(
        self, spec: StructuredOutputSpec, allowed_token_ids: Sequence[int] | None = None
    ) -> None:
        if self._grammar is None:  # only ever built on the one thread
            tok = self.tokenizer
            self._grammar = GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids)
        matcher = self._grammar.matcher(spec)
        mask = allocate_bitmask(1, self._grammar.vocab_size)
        start = time.perf_counter()
        matcher.fill_bitmask(mask, 0)
        ms = (time.perf_counter() - start) * 1e3
        if ms > self.max_mask_ms:
            raise StructuredOutputError(
                spec.field,
                f"'{spec.field}' is too expensive to enforce: its first token mask took "
                f"{ms:.0f} ms (the limit is {self.max_mask_ms:g} ms per token)",
            )
        first = unpack_bitmask(mask, self._grammar.vocab_size)[0]
        text_tokens = first.copy()
        text_tokens[[t for t in self.tokenizer.eos_token_ids if t < len(first)]] = False
        if not text_tokens.any() and not matcher.is_accepting:  # llguidance then allows EOS
            raise StructuredOutputError(
                spec.field,
                f"'{spec.field}' matches no output: no token can start a string it accepts",
            )
        if allowed_token_ids is not None:
            ids = [t for t in allowed_token_ids if 0 <= t < len(first)]
            if not first[ids].any():
                raise StructuredOutputError(
                    "allowed_token_ids",
                    f"'allowed_token_ids' holds none of the tokens '{spec.field}' allows as the "
                    f"first output token ({int(first.sum())} tokens), so no output can satisfy "
                    "both",
                )

    def close(self) -> None:
        """Stop the thread once queued work is done."""
        self._thread.shutdown(wait=False)


def _param(error: TokenizerError, param: str, control_prefix: str) -> str:
    """The request field a template error names: the control at fault, else the messages."""
    return control_prefix + error.param if error.param else param
