"""Chat-template controls: continue_final_message, add_generation_prompt, tools and tool
messages, documents, chat_template_kwargs, a template override and --chat-template loading.
Uses the bundled SmolLM2 tokenizer (loaded once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.config import ConfigError
from pdserve.tokenizer import Tokenizer, TokenizerError, load_chat_template, load_tokenizer

pytestmark = pytest.mark.timeout(120)

# A Hermes/Qwen2.5-style template: tools in the system turn, calls as <tool_call> JSON, tool
# results as <tool_response>, documents and a template variable.
TOOL_TEMPLATE = (Path(__file__).parent / "fixtures" / "hermes_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_continue_final_message_leaves_the_turn_open(tok: Tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Write a haiku about autumn"},
        {"role": "assistant", "content": "Crimson leaves drift down"},
    ]
    closed = tok.apply_chat_template(msgs, add_generation_prompt=False)
    open_ = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert len(open_) < len(closed)
    assert tok.decode(open_, skip_special_tokens=False).endswith("Crimson leaves drift down")
    assert closed[: len(open_)] == open_


def test_bad_controls_name_their_field(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(TokenizerError) as e:
        tok.render_chat(msgs, True, continue_final_message=True)
    assert e.value.param == "continue_final_message" and "both" in str(e.value)
    with pytest.raises(TokenizerError) as e:
        tok.render_chat(msgs[:1], False, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    with pytest.raises(TokenizerError) as e:
        tok.render_chat(msgs, chat_template_kwargs={"messages": []})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(TokenizerError) as e:
        tok.render_chat([{"role": "user"}])
    assert e.value.param is None and "content" in str(e.value)


def test_tools_tool_calls_and_tool_messages_render(tok: Tokenizer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    text = tok.render_chat(msgs, tools=[WEATHER], chat_template=TOOL_TEMPLATE)
    assert '"name": "get_weather"' in text  # the tool definition reached the template
    # arguments given as JSON text were handed to the template as an object
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # arguments nested past the JSON depth bound stay text (no RecursionError in the template)
    deep = "[" * 1500 + "]" * 1500
    call["function"]["arguments"] = deep  # type: ignore[index]
    text = tok.render_chat(msgs, tools=[WEATHER], chat_template=TOOL_TEMPLATE)
    assert deep in text


def test_documents_and_template_kwargs(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Summarise"}]
    docs = [{"title": "Doc A", "text": "alpha"}]
    text = tok.render_chat(
        msgs,
        documents=docs,
        chat_template=TOOL_TEMPLATE,
        chat_template_kwargs={"enable_thinking": True},
    )
    assert "[Doc A] alpha" in text and text.endswith("<think>\n")
    plain = tok.render_chat(msgs, chat_template=TOOL_TEMPLATE)
    assert "Doc A" not in plain and "<think>" not in plain


def test_load_chat_template(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(ConfigError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
