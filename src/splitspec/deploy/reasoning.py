"""A reasoning model's thinking kept apart from its answer, as DeepSeek's API and the vLLM and llama.cpp
servers return it: the text of a ``<think>…</think>`` block (Qwen3, QwQ, DeepSeek R1's distills, EXAONE 4,
OLMo 3 Think; ``<seed:think>`` for Seed-OSS) is the message's ``reasoning_content``, so that a client
shows it apart or not at all, and the answer's content and tool calls are read from what follows.

Only a block at the start of the answer is thinking: a tag later on is text. Some templates open the
block in the prompt itself (R1's distills and QwQ end it with ``<think>\\n``), so the reading starts
inside it where the prompt's last opening tag is not closed; a block the answer never closes (max_tokens)
is all thinking. Whitespace between the block and the answer is dropped. As with calls, every decision
depends only on the text so far, so a whole answer reads as its streamed pieces do.
"""

from __future__ import annotations

from typing import Any

from splitspec.deploy.calls import CallReader, prefix_of

TAGS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"))


def open_block(prompt_tail: str) -> str | None:
    """The tag that closes the thinking block a prompt ends inside of (its template opened it), or None."""
    for opening, closing in TAGS:
        at = prompt_tail.rfind(opening)
        if at >= 0 and prompt_tail.rfind(closing) < at:
            return closing
    return None


class Thinking:
    """Splits an answer's text, piece by piece, into (thinking, the rest)."""

    def __init__(self, closing: str | None = None) -> None:
        self.closing = closing  # the tag that ends the block being read
        self.state = "inside" if closing else "start"  # then "after" (whitespace), then "answer"
        self.pending = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.pending += piece
        thought = ""
        if self.state == "start":
            head = self.pending.lstrip()
            opening = next((o for o, _ in TAGS if head.startswith(o)), None)
            if opening is not None:
                self.closing = dict(TAGS)[opening]
                self.pending, self.state = head[len(opening) :], "inside"
            elif not final and any(o.startswith(head) for o, _ in TAGS):
                return "", ""  # whitespace, or what may still become an opening tag
            else:
                self.state = "answer"
        if self.state == "inside":
            assert self.closing is not None
            at = self.pending.find(self.closing)
            if at < 0:
                keep = len(self.pending) if final else len(self.pending) - prefix_of(self.pending, self.closing)
                thought, self.pending = self.pending[:keep], self.pending[keep:]
                return thought, ""
            thought, self.pending, self.state = self.pending[:at], self.pending[at + len(self.closing) :], "after"
        if self.state == "after":
            self.pending = self.pending.lstrip()
            if not self.pending:
                return thought, ""
            self.state = "answer"
        said, self.pending = self.pending, ""
        return thought, said


def thinking_tokens(tokenizer: Any, tokens: list[int], closing: str) -> int:
    """How many of an answer's first tokens its thinking took: those up to the one whose text closes the
    block (``closing``), or all of them where it is never closed. A block's text only grows with more
    tokens, so the first prefix holding the tag is found by bisection, a few decodes."""
    if closing not in tokenizer.decode(tokens):
        return len(tokens)
    lo, hi = 0, len(tokens)  # decode(tokens[:hi]) holds the tag, decode(tokens[:lo]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if closing in tokenizer.decode(tokens[:mid]):
            hi = mid
        else:
            lo = mid
    return hi


class AnswerReader:
    """A chat choice's text as OpenAI's deltas: ``{"reasoning_content": …}`` from its thinking block
    (``thinking``, where the server separates it), then content or tool calls (``calls``, where the request
    offers tools) from the rest."""

    def __init__(self, thinking: Thinking | None, calls: CallReader | None) -> None:
        self.thinking, self.calls = thinking, calls

    def feed(self, piece: str) -> list[dict[str, Any]]:
        return self._read(piece, final=False)

    def close(self) -> list[dict[str, Any]]:
        return self._read("", final=True)

    def _read(self, piece: str, final: bool) -> list[dict[str, Any]]:
        thought, said = self.thinking.feed(piece, final) if self.thinking else ("", piece)
        out: list[dict[str, Any]] = [{"reasoning_content": thought}] if thought else []
        if self.calls is not None:
            return out + self.calls.feed(said) + (self.calls.close() if final else [])
        return out + ([{"content": said}] if said else [])

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(thinking, content, calls in OpenAI's form) of a whole answer; content is None where it is empty
        beside thinking or calls."""
        deltas = self.feed(text) + self.close()
        thought = "".join(d.get("reasoning_content", "") for d in deltas) or None
        content = "".join(d.get("content", "") for d in deltas)
        found = [c.openai() for c in self.calls.calls] if self.calls is not None else []
        return thought, (content or None) if thought or found else content, found

    @property
    def called(self) -> bool:
        """Whether the answer so far holds a tool call (its finish reason is then ``tool_calls``)."""
        return self.calls is not None and bool(self.calls.calls)
