"""Tool calls read from an answer: the forms open models write them in, content around them, and the
same content and calls whether the answer is read whole or streamed in any pieces."""

from __future__ import annotations

import json
import random

import pytest

from splitspec.deploy.calls import CallReader
from splitspec.deploy.reasoning import AnswerReader
from splitspec.deploy.tools import parse_tools

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
OFFERED = parse_tools({"tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]})

HERMES = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWERS = {  # text -> (content, [(name, arguments)])
    HERMES: ("Let me look.", [("get_weather", '{"city": "Paris"}')]),
    '<|python_tag|>{"name": "add", "parameters": {"a": 3}}': (None, [("add", '{"a": 3}')]),
    '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]': (
        None,
        [("add", '{"a": 1}'), ("add", '{"a": 2}')],
    ),
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome \\"}\\" x"}}]': (
        None,
        [("get_weather", '{"city": "Rome \\"}\\" x"}')],
    ),
    '{"name": "add", "arguments": "{\\"a\\": 5}"}': (None, [("add", '{"a": 5}')]),  # JSON in a string
    '{"arguments": {"a": 2}, "name": "add"}': (None, [("add", '{"a": 2}')]),
    '{"name": "add"}': (None, [("add", "{}")]),
    '<tool_call>{"name": "add", "arguments": {"a": 1': (None, [("add", '{"a": 1')]),  # cut off by max_tokens
    '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call> and': (" and", [("add", '{"a": 1')]),  # unclosed
    'A\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\nB <tool_call>{"name": "x"}</tool_call> C': (
        'A\nB <tool_call>{"name": "x"}</tool_call> C',
        [("add", '{"a": 1}')],
    ),
}
NOT_CALLS = [
    "The weather is fine.",
    '{"name": "launch", "arguments": {}}',
    "<tool_call>{oops</tool_call>",
    "[]",
    '  {"city": 1} then',
    "[1] Intro",
    "Text with < and [ and { inside",
    "ends with <tool_ca",
    "x <|python_tag|>print(1)",
    "   ",
]


def _streamed(text: str, rng: random.Random) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    reader, deltas, i = CallReader(OFFERED), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        deltas += reader.feed(text[i : i + k])
        i += k
    deltas += reader.close()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in (d for delta in deltas for d in delta.get("tool_calls", ())):
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"]["arguments"]
    return (content or None) if calls else content, [tuple(c) for _, c in sorted(calls.items())], deltas


@pytest.mark.parametrize("text", [*ANSWERS, *NOT_CALLS])
def test_an_answer_streamed_in_any_pieces_reads_as_it_does_whole(text):
    thought, content, found = AnswerReader(None, CallReader(OFFERED)).whole(text)
    assert thought is None
    pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in found]
    assert (content, pairs) == ANSWERS.get(text, (text, []))
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in found)
    rng = random.Random(text)
    for _ in range(25):
        assert _streamed(text, rng)[:2] == (content, pairs)


def test_a_call_streams_its_name_first_then_its_arguments_as_they_come():
    reader = CallReader(OFFERED)
    assert reader.feed("Let me look.\n<tool_") == [{"content": "Let me look."}]  # the tag's start is held back
    assert reader.feed('call>\n{"name": "get_wea') == []
    head = reader.feed('ther", "arguments": {"ci')
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert head[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    rest = reader.feed('ty": "Paris"}}\n</tool_call>') + reader.close()
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest) == 'ty": "Paris"}'
    reader = CallReader(OFFERED)  # a JSON answer that is not a call streams on once that is plain
    assert reader.feed('{"city"') == [{"content": '{"city"'}] and reader.feed(": 1}") == [{"content": ": 1}"}]


def test_long_arguments_arrive_in_many_pieces():
    arguments = json.dumps({"city": "x" * 300})
    text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    content, pairs, deltas = _streamed(text, random.Random(0))
    assert content is None and pairs == [("get_weather", arguments)]
    assert sum("tool_calls" in d for d in deltas) > 30
