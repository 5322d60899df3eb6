"""A reasoning model's thinking kept apart from its answer: a block at the answer's start (or opened by the
prompt), its content and calls after it, and the same split whether the answer is read whole or streamed."""

from __future__ import annotations

import random

import pytest

from splitspec.deploy.calls import CallReader
from splitspec.deploy.reasoning import AnswerReader, Thinking, open_block, thinking_tokens
from splitspec.deploy.tools import parse_tools

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
OFFERED = parse_tools({"tools": [{"type": "function", "function": ADD}]})

ANSWERS = {  # (text, the prompt opened the block) -> (thinking, content)
    ("<think>\nWhy? Rayleigh.\n</think>\n\nThe sky is blue.", False): ("\nWhy? Rayleigh.\n", "The sky is blue."),
    ("  <think>a</think>b", False): ("a", "b"),
    ("Rayleigh.\n</think>\n\nBlue.", True): ("Rayleigh.\n", "Blue."),  # R1's distills, QwQ
    ("<seed:think>budget</seed:think>Done", False): ("budget", "Done"),  # Seed-OSS
    ("<think>cut off by max_tok", False): ("cut off by max_tok", None),
    ("still thinking", True): ("still thinking", None),
    ("<think></think>\n\nNo thought.", False): (None, "No thought."),  # Qwen3 with thinking off
    ("Plain answer.", False): (None, "Plain answer."),
    ("Later <think>is text</think>.", False): (None, "Later <think>is text</think>."),
    ("<thin", False): (None, "<thin"),
    ("", False): (None, ""),
}


def _streamed(reader: AnswerReader, text: str, rng: random.Random) -> tuple[str | None, str | None, list[dict]]:
    deltas, i = [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        deltas += reader.feed(text[i : i + k])
        i += k
    deltas += reader.close()
    thought = "".join(d.get("reasoning_content", "") for d in deltas) or None
    content = "".join(d.get("content", "") for d in deltas)
    return thought, (content or None) if thought else content, deltas


@pytest.mark.parametrize(("text", "opened"), list(ANSWERS))
def test_thinking_streamed_in_any_pieces_splits_as_it_does_whole(text, opened):
    closing = "</think>" if opened else None
    thought, content, found = AnswerReader(Thinking(closing), None).whole(text)
    assert (thought, content) == ANSWERS[text, opened] and found == []
    rng = random.Random(text)
    for _ in range(25):
        assert _streamed(AnswerReader(Thinking(closing), None), text, rng)[:2] == (thought, content)


def test_a_call_after_the_thinking_is_read_from_the_answer_alone():
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}'
    text = f"<think>The user wants a sum: <tool_call> comes next.</think>\n{call}"
    thought, content, found = AnswerReader(Thinking(), CallReader(OFFERED)).whole(text)
    assert thought == "The user wants a sum: <tool_call> comes next." and content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in found] == [("add", '{"a": 2}')]
    _, _, deltas = _streamed(AnswerReader(Thinking(), CallReader(OFFERED)), text, random.Random(0))
    assert "reasoning_content" in deltas[0] and "tool_calls" in deltas[-1]


def test_a_prompt_that_opens_the_block_is_read_from_its_tail():
    assert open_block("<|im_start|>assistant\n<think>\n") == "</think>"
    assert open_block("<seed:think>") == "</seed:think>"
    assert open_block("<think>\n\n</think>\n\n") is None  # Qwen3's template with enable_thinking off
    assert open_block("<|im_start|>assistant\n") is None


def test_thinking_is_streamed_as_it_comes():
    thinking = Thinking()
    assert thinking.feed("<thi") == ("", "")
    assert thinking.feed("nk>Step one") == ("Step one", "")
    assert thinking.feed(" and two</th") == (" and two", "")
    assert thinking.feed("ink>\n\n") == ("", "")
    assert thinking.feed("Answer") == ("", "Answer")


THOUGHTS = ["<think>\nWhy? Rayleigh.\n</think>\n\nBlue.", "a</think>b", "still thinking", "</think>"]


@pytest.mark.parametrize("text", THOUGHTS)
def test_thinking_tokens_are_those_up_to_the_closing_tag(tokenizer, text):
    """usage's reasoning_tokens: the answer's tokens up to the one that completes the closing tag (a few
    tokens in SmolLM2's vocabulary), all of them where the block never closes; against a token-by-token
    scan."""
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    scan = next((k for k in range(len(tokens) + 1) if "</think>" in tokenizer.decode(tokens[:k])), len(tokens))
    assert thinking_tokens(tokenizer, tokens, "</think>") == scan
    assert (scan < len(tokens)) == (not text.endswith(("thinking", "</think>")))
