"""Tool calls: the request's tools and choice, the messages that carry calls back, and the schema a forced
call follows (the calls read from an answer: ``test_deploy_calls``)."""

from __future__ import annotations

import json

import pytest

from splitspec.deploy.openai_api import RequestError, chat_ids, parse_request
from splitspec.deploy.tools import ToolError, message, parse_tools

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def test_tools_and_the_choice_are_parsed_and_checked():
    assert parse_tools({}) is None and parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    auto = parse_tools({"tools": TOOLS})
    assert auto.choice == "auto" and not auto.forced and auto.schema() is None
    assert auto.template() == TOOLS
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.choice == "add" and json.loads(named.schema())["properties"]["name"] == {"const": "add"}
    assert json.loads(named.schema())["properties"]["arguments"] == ADD["parameters"]
    required = json.loads(parse_tools({"tools": TOOLS, "tool_choice": "required"}).schema())
    assert [c["properties"]["name"]["const"] for c in required["anyOf"]] == ["get_weather", "add"]
    for body, param in (
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
    ):
        with pytest.raises(ToolError) as e:
            parse_tools(body)
        assert e.value.param == param


def test_a_forced_call_is_a_schema_and_auto_leaves_the_text_free():
    forced = parse_request(CHAT | {"tools": TOOLS, "tool_choice": "required"}, True, "m")
    assert forced.offered.forced and forced.params.json_schema == forced.offered.schema()
    auto = parse_request(CHAT | {"tools": TOOLS, "response_format": {"type": "json_object"}}, True, "m")
    assert not auto.offered.forced and auto.params.json_schema == '{"type": "object"}'
    assert parse_request(CHAT | {"tools": TOOLS, "tool_choice": "none"}, True, "m").offered is None
    with pytest.raises(RequestError, match="for /v1/chat/completions") as e:
        parse_request({"model": "m", "prompt": "hi", "tools": TOOLS}, False, "m")
    assert e.value.param == "tools"
    with pytest.raises(RequestError) as e:
        parse_request(CHAT | {"tools": [{"type": "nope"}]}, True, "m")
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "invalid_value")


def test_calls_and_results_go_back_to_the_template():
    sent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    ]}  # fmt: skip
    assert message(sent, 1) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}],
    }
    assert message({"role": "tool", "content": "4", "tool_call_id": "call_1"}, 2) == {
        "role": "tool", "content": "4", "tool_call_id": "call_1"
    }  # fmt: skip
    assert message({"role": "user", "content": "hi"}, 0) is None
    bad = {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{not json"}}]}
    with pytest.raises(ToolError, match="JSON arguments"):
        message(bad, 3)
    with pytest.raises(ToolError, match="text content"):
        message({"role": "tool"}, 4)
    with pytest.raises(ToolError, match="must be a list"):
        message({"role": "assistant", "tool_calls": 5}, 5)
    parts = [{"type": "text", "text": "4"}]  # a result as text parts, which OpenAI allows too
    request = parse_request(
        CHAT | {"messages": [CHAT["messages"][0], sent, {"role": "tool", "content": parts}]}, True, "m"
    )
    assert [m["role"] for m in request.prompts[0]] == ["user", "assistant", "tool"]
    assert request.prompts[0][2]["content"] == "4"


def test_a_template_that_renders_tools_shows_them_to_the_model(tokenizer):
    template = (
        "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = template
    offered = parse_tools({"tools": TOOLS})
    text = tokenizer.decode(chat_ids(tokenizer, CHAT["messages"], offered))
    assert text.startswith("Tools: get_weather add") and text.endswith("assistant:")
    assert "Tools" not in tokenizer.decode(chat_ids(tokenizer, CHAT["messages"]))
