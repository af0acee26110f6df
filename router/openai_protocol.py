"""OpenAI-compatible request and response models (pydantic), as in the OpenAI API reference.

Requests are validated strictly (a string where a number belongs is a 400, never coerced); fields
OpenAI defines but pdserve cannot honour (``suffix``, non-text content, ...) are refused with a
400 naming the field rather than silently ignored, and so are vLLM's extensions that would change
the output but are not implemented here (``truncate_prompt_tokens``, ``bad_words``,
``use_beam_search``, a request's own ``chat_template``, ...: :data:`UNSUPPORTED`). Other unknown
fields are ignored with a warning in the server's log naming them, as vLLM does.
Sampling extensions that vLLM accepts in the body (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``,
``allowed_token_ids``, ``prompt_logprobs``, ``structured_outputs`` and the ``guided_*`` fields)
are accepted with the same names and meanings; so are vLLM's chat-template controls
(``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``, ``documents``,
``echo``). Structured output: :mod:`router.structured_request`; tools: :mod:`router.chat_tools`.

Responses are built as plain dicts by :mod:`router.http.responses` (one per streamed token: no
pydantic round trip on the hot path); their shapes are documented there.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from pdserve.structured.spec import StructuredOutputSpec
from router.chat_tools import check_tool_calls
from router.errors import BadRequest
from router.prompts import check_text
from router.structured_request import logit_bias_pairs, structured_spec, top_field

_STRICT = ConfigDict(strict=True, extra="ignore")
log = logging.getLogger(__name__)

# Fields of OpenAI's API or vLLM's extensions that pdserve does not implement, each with the value
# that means "not used": a request that sets one to anything else gets a 400 naming it (rather
# than an answer that silently ignored it). Chat-only ones are refused on chat requests only.
UNSUPPORTED: dict[str, object] = {
    "truncate_prompt_tokens": None,
    "bad_words": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "guided_whitespace_pattern": None,
    "priority": 0,
}
CHAT_UNSUPPORTED: dict[str, object] = {
    "chat_template": None,  # vLLM too refuses a request's template unless told to trust it
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "functions": None,  # the legacy form of 'tools'
    "function_call": None,  # ... and of 'tool_choice'
}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds one usage chunk (empty choices) before [DONE]."""

    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true (see UNSUPPORTED)


class TextPart(BaseModel):
    """One content part of a chat message. Only ``type: "text"`` is supported."""

    model_config = _STRICT
    type: str
    text: str | None = None


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)  # the roles OpenAI's chat API defines


class ChatMessage(BaseModel):
    """A chat message. ``content`` is a string or a list of text parts."""

    model_config = _STRICT
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self, index: int) -> str:
        """The message text; raises BadRequest naming ``messages[index]`` for non-text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise BadRequest(
                    f"messages[{index}].content[{j}] has type {part.type!r}; only 'text' parts are "
                    "supported by this model",
                    param=f"messages.{index}.content.{j}.type",
                )
            if part.text is None:
                raise BadRequest(
                    f"messages[{index}].content[{j}] is a 'text' part without 'text'",
                    param=f"messages.{index}.content.{j}.text",
                )
            pieces.append(part.text)
        return "".join(pieces)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as plain dicts for the chat template: 'role', 'content', and 'name',
    'tool_calls', 'tool_call_id' where given. Raises BadRequest naming a non-text content part
    or a malformed tool call (``messages[i].tool_calls[j].function.name`` ...)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text(i)}
        if m.tool_calls:  # content stays "" when absent: templates concatenate it
            check_tool_calls(m.tool_calls, f"messages[{i}].tool_calls", f"messages.{i}.tool_calls")
            msg["tool_calls"] = m.tool_calls
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _warn_ignored(cls, data: Any) -> Any:
        """Log the top-level fields this request model does not know (a typo such as
        ``max_token`` is then visible in the log), as vLLM does; they stay ignored."""
        if isinstance(data, dict):
            ignored = sorted(str(k) for k in data if k not in cls.model_fields)
            if ignored:
                shown = ", ".join(repr(k[:64]) for k in ignored[:10])
                more = f" and {len(ignored) - 10} more" if len(ignored) > 10 else ""
                log.warning("request fields ignored (not known to %s): %s%s",
                            cls.__name__, shown, more)  # fmt: skip
        return data

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # structured output (OpenAI's response_format; vLLM's structured_outputs and guided_*)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # not implemented: refused when set (UNSUPPORTED)
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    guided_whitespace_pattern: str | None = None
    priority: int = 0

    _unsupported: ClassVar[dict[str, object]] = UNSUPPORTED

    def _check_unsupported(self) -> None:
        """Raise BadRequest naming the first field of :attr:`_unsupported` the request sets."""
        for name, unused in self._unsupported.items():
            value = getattr(self, name)
            if value != unused and value != []:
                raise BadRequest(f"'{name}' is not supported by this server", param=name)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise BadRequest(
                "'stream_options.continuous_usage_stats' is not supported by this server",
                param="stream_options.continuous_usage_stats",
            )

    def _structured(self, extra: StructuredOutputSpec | None = None) -> StructuredOutputSpec | None:
        """The request's output constraint (``extra``: one from tool_choice). Raises BadRequest."""
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        spec = structured_spec(self.response_format, self.structured_outputs, guided)
        if spec is not None and extra is not None:
            field = top_field(spec.field)
            raise BadRequest(
                f"'{field}' cannot be combined with a 'tool_choice' that forces a call",
                param=field,
            )
        return spec or extra

    def _check_common(self) -> None:
        self._check_unsupported()
        if self.stream_options is not None and not self.stream:
            raise BadRequest(
                "'stream_options' is only allowed with 'stream': true", param="stream_options"
            )
        if self.max_tokens is not None and self.max_tokens < (0 if self._echo_only_ok else 1):
            raise BadRequest(
                f"'max_tokens' must be >= 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.n < 1:
            raise BadRequest(f"'n' must be >= 1, got {self.n}", param="n")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise BadRequest("'stop_token_ids' must be >= 0", param="stop_token_ids")

    def _stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for i, s in enumerate(stops):
            if not s:
                raise BadRequest(f"'stop'[{i}] must be a non-empty string", param="stop")
            check_text(s, "stop")
        return tuple(stops)

    @property
    def _echo_only_ok(self) -> bool:
        """Whether ``max_tokens: 0`` is allowed (completions with ``echo``: score the prompt)."""
        return False

    def _sampling(
        self,
        max_tokens: int | None,
        logprobs: bool,
        top_logprobs: int,
        structured: StructuredOutputSpec | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Build SamplingParams; SamplingError (a ValueError naming ``field``) on a bad range."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self._stops(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias_pairs(self.logit_bias),
            allowed_token_ids=(
                tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None
            ),
            structured=structured,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template controls
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    echo: bool = False
    modalities: list[str] | None = None
    # not implemented: refused when set (CHAT_UNSUPPORTED)
    chat_template: str | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    _unsupported: ClassVar[dict[str, object]] = {**UNSUPPORTED, **CHAT_UNSUPPORTED}

    def _check_unsupported(self) -> None:
        super()._check_unsupported()
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise BadRequest("'modalities' may only hold 'text' on this server", param="modalities")

    def to_sampling_params(self, tool_spec: StructuredOutputSpec | None = None) -> SamplingParams:
        """Sampling settings; ``tool_spec``: the constraint a forcing ``tool_choice`` needs.
        Raises BadRequest / SamplingError naming the field."""
        self._check_common()
        structured = self._structured(tool_spec)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(
                f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                param="top_logprobs",
            )
        max_tokens = self.max_completion_tokens
        param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = self.max_tokens, "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"'{param}' must be >= 1, got {max_tokens}", param=param)
        return self._sampling(max_tokens, self.logprobs, top, structured, self.prompt_logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (:func:`template_messages`)."""
        return template_messages(self.messages)

    def template_controls(self) -> dict[str, Any]:
        """Keyword arguments for ``Tokenizer.render_chat`` beyond the messages and tools."""
        return {
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
            "chat_template_kwargs": self.chat_template_kwargs,
        }


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Common):
    """POST /v1/completions body. ``logprobs`` is the number of top alternatives (0..20)."""

    prompt: Prompt
    # 16 when absent, the OpenAI completions API's documented default (vLLM's too); an explicit
    # null means the rest of the context, as chat's absent max_tokens does
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @property
    def _echo_only_ok(self) -> bool:
        return self.echo

    @property
    def echo_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: return the prompt (and its logprobs), generate
        nothing. Workers still sample one token, which the gateway drops."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        """Sampling settings. ``echo`` with ``logprobs`` asks for prompt logprobs with that
        many alternatives. Raises BadRequest / SamplingError naming the field."""
        self._check_common()
        structured = self._structured()
        if self.suffix:
            raise BadRequest("'suffix' is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("'best_of' other than 'n' is not supported", param="best_of")
        top = self.logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(
                f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="logprobs"
            )
        prompt_top = self.prompt_logprobs
        if self.echo and top is not None:
            prompt_top = max(top, prompt_top or 0)
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling(max_tokens, top is not None, top or 0, structured, prompt_top)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as texts or token-id lists. Raises BadRequest for an empty prompt list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        out: list[str | list[int]] = []
        for item in p:
            if isinstance(item, list) and not item:
                raise BadRequest("'prompt' holds an empty token list", param="prompt")
            out.append(item)  # type: ignore[arg-type]
        return out
