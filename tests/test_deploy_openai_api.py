"""The schema's text handling against the tokenizer's own decode of the whole answer: pieces handed out
as tokens arrive join into the whole answer's text, cut before a stop string."""

from __future__ import annotations

import random

import pytest

from splitspec.deploy.openai_api import TextStream

TEXTS = [
    "The Danube, the Rhine and the Volga — three rivers of Europe.",
    "Ünïcödé: 日本語のテキスト, emoji 🌍🚀 and a tab\tbetween.",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))",
]


def _pieces(stream: TextStream, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ``ids`` in random chunks of 1-3 tokens, as checks decide them, then the final call."""
    out, i = [], 0
    while i < len(ids) and not stream.stopped:
        k = rng.randint(1, 3)
        out.append(stream.feed(ids[i : i + k]))
        i += k
    if not stream.stopped:
        out.append(stream.feed([], final=True))
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_into_the_whole_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for seed in range(3):
        pieces = _pieces(TextStream(tokenizer, []), ids, random.Random(seed))
        assert "".join(pieces) == whole
        assert all("\ufffd" not in p for p in pieces)  # no half characters, though emoji span byte tokens


def test_a_stop_string_across_tokens_cuts_the_text_and_is_never_sent(tokenizer):
    text = TEXTS[0]
    ids = tokenizer(text)["input_ids"]
    stop = "Rhine and"
    stream = TextStream(tokenizer, [stop, "never there"])
    pieces = _pieces(stream, ids, random.Random(0))
    assert stream.stopped
    assert "".join(pieces) == text[: text.index(stop)]
    assert stream.finish_reason(eos_id=None) == "stop"


def test_a_held_stop_prefix_is_released_when_the_stop_does_not_follow(tokenizer):
    """'Rhi' could start the stop string 'Rhino' until the next token says otherwise."""
    text = TEXTS[0]
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, ["Rhino"])
    pieces = [stream.feed([t]) for t in ids] + [stream.feed([], final=True)]
    assert not stream.stopped and "".join(pieces) == text
    assert stream.finish_reason(eos_id=None) == "length"
