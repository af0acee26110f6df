"""Prompt preparation shared by the gateways: off the event loop, errors naming the field."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from pdserve.structured.spec import StructuredOutputSpec
from pdserve.tokenizer import Tokenizer, TokenizerError
from router.errors import BadRequest
from router.prompts import PromptPreparer, check_text

pytestmark = pytest.mark.timeout(60)


class RecordingTokenizer:
    """Wraps a real tokenizer and records the thread each call ran on."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.current_thread().name)
        return self.inner.decode(ids, skip_special_tokens)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:  # not recorded: the encode of its text is
        if any(m["role"] == "tool" for m in messages):
            raise TokenizerError("the chat template does not accept a 'tool' message")
        return self.inner.render_chat(messages, add_generation_prompt, **kw)

    @property
    def hf(self) -> Any:
        return self.inner.hf

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if any(m["role"] == "tool" for m in messages):
            raise TokenizerError("the chat template does not accept a 'tool' message")
        return self.inner.apply_chat_template(messages, add_generation_prompt, **kw)


async def test_work_runs_on_the_tokenize_thread(tokenizer: Tokenizer) -> None:
    rec = RecordingTokenizer(tokenizer)
    prompts = PromptPreparer(rec)  # type: ignore[arg-type]
    try:
        ids = await prompts.text("Hello there", param="prompt")
        assert ids == tokenizer.encode("Hello there")
        chat = await prompts.chat([{"role": "user", "content": "Hi"}], param="messages")
        assert chat == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert await prompts.decode(ids) == tokenizer.decode(ids)
    finally:
        prompts.close()
    loop_thread = threading.current_thread().name
    assert len(rec.threads) == 3 and len(set(rec.threads)) == 1
    assert rec.threads[0].startswith("tokenize") and rec.threads[0] != loop_thread


async def test_errors_name_the_field(tokenizer: Tokenizer) -> None:
    prompts = PromptPreparer(RecordingTokenizer(tokenizer))  # type: ignore[arg-type]
    try:
        with pytest.raises(BadRequest) as e:
            await prompts.chat([{"role": "tool", "content": "x"}], param="chat")
        assert e.value.param == "chat" and "tool" in e.value.message
        with pytest.raises(BadRequest) as e:
            await prompts.text("a\udc80b", param="prompt")
        assert e.value.param == "prompt" and "U+DC80 at character 1" in e.value.message
    finally:
        prompts.close()


async def test_template_controls_errors_name_the_control(tokenizer: Tokenizer) -> None:
    prompts = PromptPreparer(tokenizer)
    msgs = [{"role": "user", "content": "Hi"}]
    try:
        with pytest.raises(BadRequest) as e:  # the last message is not the assistant's
            await prompts.chat(
                msgs,
                param="chat",
                control_prefix="chat.",
                add_generation_prompt=False,
                continue_final_message=True,
            )
        assert e.value.param == "chat.continue_final_message"
        with pytest.raises(BadRequest) as e:
            await prompts.render_chat(msgs, param="messages", chat_template_kwargs={"tools": 1})
        assert e.value.param == "chat_template_kwargs"
    finally:
        prompts.close()


def test_check_text_accepts_any_valid_unicode() -> None:
    check_text("héllo 😀 \u4e2d", "prompt")
    with pytest.raises(BadRequest):
        check_text("\ud800", "messages")


async def test_allowed_token_ids_must_meet_the_grammar_first_token(tokenizer: Tokenizer) -> None:
    """allowed_token_ids holding a token the grammar allows first passes; holding none of them
    is a 400 naming allowed_token_ids (no output could satisfy both)."""
    prompts = PromptPreparer(tokenizer)
    spec = StructuredOutputSpec.choice(["yes", "no"], "guided_choice")
    yes = tokenizer.encode("yes", add_special_tokens=False)
    try:
        await prompts.check_structured(spec)
        await prompts.check_structured(spec, (0, yes[0]))
        with pytest.raises(BadRequest) as e:
            await prompts.check_structured(spec, (0, 1))
        assert e.value.param == "allowed_token_ids" and "'guided_choice' allows" in e.value.message
    finally:
        prompts.close()
