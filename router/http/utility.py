"""vLLM's utility endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models/{id}``.

``/tokenize`` takes either ``prompt`` (text; ``add_special_tokens`` default true) or chat
``messages`` (rendered by the chat template with ``add_generation_prompt``,
``continue_final_message``, ``tools``, ``chat_template_kwargs``; ``add_special_tokens`` default
false, the template writes them; messages and tools are validated and rendered as a chat
completion's are) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}``. ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``; ids outside the
vocabulary are a 400 naming ``tokens``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict

from router.chat_tools import check_tools
from router.errors import BadRequest
from router.http.handlers import check_model
from router.openai_protocol import ChatMessage, template_messages
from router.readiness import check_ready
from router.serving import Router

_STARTED = time.time()
_STRICT = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(BaseModel):
    """POST /tokenize body: ``prompt`` or ``messages``."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize body."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def model_card(router: Router) -> dict[str, Any]:
    """The ``/v1/models`` entry of the served model (with vLLM's ``max_model_len``)."""
    return {
        "id": router.model_name,
        "object": "model",
        "created": int(_STARTED),
        "owned_by": "pdserve",
        "root": router.model_name,
        "max_model_len": router.max_model_len,
    }


def add_utility_routes(
    app: FastAPI, v1: APIRouter, router: Router, dependencies: list[Any]
) -> None:
    """Register the endpoints (tokenizer work runs off the event loop, on the router's prompt
    preparation thread). ``dependencies``: e.g. the API-key check."""

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_ready(router.pool)  # like /v1/models: 503 + Retry-After until servable
        check_model(router, model_id)
        return model_card(router)

    util = APIRouter(dependencies=dependencies)

    @util.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(router, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            text = await router.prompts.render_chat(
                template_messages(body.messages),
                param="messages",
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=check_tools(body.tools) if body.tools else None,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            special = bool(body.add_special_tokens)
        else:
            text = body.prompt or ""
            special = body.add_special_tokens is not False
        ids = await router.prompts.text(
            text,
            param="prompt" if body.messages is None else "messages",
            add_special_tokens=special,
            max_model_len=router.max_model_len,
        )
        strs = (
            [router.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            if body.return_token_strs
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": router.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @util.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(router, body.model)
        router.check_token_ids(body.tokens, "tokens")
        return {"prompt": await router.prompts.decode(body.tokens, skip_special_tokens=False)}

    app.include_router(util)
