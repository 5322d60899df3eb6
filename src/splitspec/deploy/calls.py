"""Tool calls read from an answer as it streams, so a client sees a call's name as soon as the model has
written it and its arguments as they come (OpenAI's ``tool_calls`` deltas), and text around the calls as
content, as it comes too.

The model writes a call in one of the forms open models use: Hermes' ``<tool_call>{…}</tool_call>`` (Qwen,
Hermes, SmolLM3), a JSON object or list after Llama 3's ``<|python_tag|>`` or Mistral's ``[TOOL_CALLS]``,
or a bare JSON object or list that is the whole answer (Llama 3's other form, and what a forced call's
schema makes). Each object is ``{"name": …, "arguments" | "parameters": {…}}``. An object becomes a call
the moment its name is complete and names an offered function; a region that turns out not to be a call
(another name, another first key, malformed) is given back as content, whole. Every decision depends only
on the text so far, so reading an answer in one piece gives what streaming it gave.
Whitespace before a call and after the last one is dropped; an answer with no call is its content,
unchanged.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from splitspec.deploy.tools import Tools

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
OPENERS = (TAG_OPEN, "<|python_tag|>", "[TOOL_CALLS]")  # the last two: a JSON object or list follows
NAME, ARGUMENT_KEYS = "name", ("arguments", "parameters")


@dataclass
class CallObject:
    """One ``{…}`` read so far: spans are indices into the answer's text; an end is None while it runs."""

    name: str | None = None
    first_key: str | None = None
    arguments: tuple[int, int | None] | None = None
    end: int | None = None
    broken: bool = False


@dataclass
class Region:
    """A stretch that may hold calls: ``held`` is where its text begins (whitespace before the opener
    included, given back with it if it holds none), ``body`` where the JSON begins."""

    held: int
    body: int
    tagged: bool
    calls: list[int | None] = field(default_factory=list)  # each object's call number, None if not one


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""  # as sent so far
    done: bool = False

    def openai(self) -> dict[str, Any]:
        """The call in OpenAI's form, whole."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_object(text: str, i: int, stop: int) -> CallObject:
    """The call-shaped facts of the JSON object at ``text[i] == "{"`` within ``text[:stop]``: its first
    key, its name, the span of its arguments' value, its end. Only the top level is read; a value's
    insides are skipped by depth and strings."""
    obj, depth, j = CallObject(), 0, i
    key: str | None = None
    expect, value_start, string_start = "key", 0, 0
    in_string = escaped = False

    def value(end: int) -> None:
        if key == NAME and text[value_start] == '"':
            obj.name = _loads(text[value_start:end])
        elif key in ARGUMENT_KEYS:
            obj.arguments = (value_start, end)

    while j < stop:
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and expect == "key-string":
                    key, expect = _loads(text[string_start : j + 1]), "colon"
                    obj.first_key = obj.first_key or key
                elif depth == 1 and expect == "string":
                    value(j + 1)
                    expect = "comma"
        elif c == '"':
            in_string, string_start = True, j
            if depth == 1:
                if expect == "key":
                    expect = "key-string"
                elif expect == "value":
                    expect, value_start = "string", j
                else:
                    obj.broken = True
        elif c in "{[":
            depth += 1
            if depth == 2 and expect == "value":
                expect, value_start = "nested", j
        elif c in "}]":
            depth -= 1
            if depth == 1 and expect == "nested":
                value(j + 1)
                expect = "comma"
            elif depth == 0:
                if expect == "scalar":
                    value(j)
                obj.end = j + 1
                break
        elif depth == 1 and c == ":" and expect == "colon":
            expect = "value"
        elif depth == 1 and c == ",":
            if expect == "scalar":
                value(j)
            expect = "key"
        elif depth == 1 and not c.isspace() and expect == "value":
            expect, value_start = "scalar", j
        if key in ARGUMENT_KEYS and expect in ("nested", "string") and obj.arguments is None:
            obj.arguments = (value_start, None)
        j += 1
    if obj.name is None and obj.first_key is not None and obj.first_key not in (NAME, *ARGUMENT_KEYS):
        obj.broken = True
    return obj


def read_value(text: str, i: int, stop: int) -> tuple[list[CallObject], int | None, bool]:
    """The objects of the JSON object or list of objects at ``text[i]``, where it ends (None while it
    runs) and whether it is not call-shaped."""
    if text[i] == "{":
        obj = read_object(text, i, stop)
        return [obj], obj.end, obj.broken
    objects, j = [], i + 1
    while True:
        j = _skip_space(text, j, stop)
        if j >= stop:
            return objects, None, False
        if text[j] == "]":
            return objects, j + 1, not objects
        if objects and text[j] == ",":
            j = _skip_space(text, j + 1, stop)
            if j >= stop:
                return objects, None, False
        if text[j] != "{":
            return objects, None, True
        obj = read_object(text, j, stop)
        objects.append(obj)
        if obj.end is None or obj.broken:
            return objects, None, obj.broken
        j = obj.end


class CallReader:
    """Feeds on an answer's text, piece by piece, and gives OpenAI's deltas: ``{"content": …}`` or
    ``{"tool_calls": [{"index": k, …}]}`` (a call's id and name first, then pieces of its arguments)."""

    def __init__(self, tools: Tools) -> None:
        self.names = {f["name"] for f in tools.functions}
        self.text, self.at = "", 0  # text before ``at`` is decided: sent, or dropped beside a call
        self.region: Region | None = None
        self.calls: list[Call] = []
        self.content = False  # whether any content was sent (a bare JSON answer must come first)
        self.after_call = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._advance(final=False)

    def close(self) -> list[dict[str, Any]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.region is None:
                if not self._text(out, final):
                    return out
            elif not self._read_region(out, final):
                return out

    def _text(self, out: list[dict[str, Any]], final: bool) -> bool:
        """Content up to the next opener (a region then begins: True), keeping back what might begin one
        and trailing whitespace (it is dropped if a call follows)."""
        text, at = self.text, self.at
        first = _skip_space(text, at, len(text))
        bare = first < len(text) and text[first] in "{[" and not self.content and not self.calls
        if bare and not final and any(o.startswith(text[first:]) for o in OPENERS):
            return False  # "[TOOL_CALLS]" or a bare list: not known yet
        if bare and not text.startswith(OPENERS, first):
            self.region = Region(at, first, tagged=False)
            return True
        found = [(p, o) for o in OPENERS if (p := text.find(o, at)) >= 0]
        if found:
            p, opener = min(found)
            keep = len(text[at:p].rstrip()) + at
            self._say(out, text[at:keep])
            self.region = Region(keep, p + len(opener), opener == TAG_OPEN)
            self.at = keep
            return True
        if final:
            if not (self.after_call and text[at:].isspace()):  # whitespace after a call is dropped
                self._say(out, text[at:])
            self.at = len(text)
            return False
        end = len(text) - _opener_prefix(text, at)
        end = at + len(text[at:end].rstrip())
        self._say(out, text[at:end])
        self.at = end
        return False

    def _read_region(self, out: list[dict[str, Any]], final: bool) -> bool:
        """A region's calls as far as they are written; True when the region is over."""
        region, text = self.region, self.text
        assert region is not None
        stop, close = len(text), -1
        if region.tagged:
            close = text.find(TAG_CLOSE, region.body)
            stop = close if close >= 0 else len(text) - prefix_of(text, TAG_CLOSE)
        start = _skip_space(text, region.body, stop)
        if start >= stop:
            objects, end, broken = [], None, close >= 0 or (final and not region.tagged)
        elif text[start] not in "{[" or (region.tagged and text[start] != "{"):
            objects, end, broken = [], None, True
        else:
            objects, end, broken = read_value(text, start, stop)
        for k, obj in enumerate(objects):
            if k == len(region.calls):
                if obj.name in self.names:
                    region.calls.append(self._open_call(out, obj.name))
                elif obj.name is not None or obj.broken or obj.end is not None:
                    region.calls.append(None)
                else:
                    break
            number = region.calls[k]
            if number is not None:
                self._send_arguments(out, self.calls[number], obj, stop, final)
        opened = any(n is not None for n in region.calls)
        if not opened and (broken or None in region.calls):
            return self._give_back(out, region, final, close)
        over = (close >= 0) if region.tagged else end is not None
        if not over and not final:
            return False
        if close >= 0:
            self.at = close + len(TAG_CLOSE)
        else:  # an untagged region's end, or the answer's (the closing tag never came)
            self.at = end if end is not None and not region.tagged else len(text)
        if not opened:
            self._say(out, text[region.held : self.at])
        self.region, self.after_call = None, opened
        return True

    def _give_back(self, out: list[dict[str, Any]], region: Region, final: bool, close: int) -> bool:
        """A region that holds no call: its text is content. Untagged, the text after its opening goes
        back to being read as text (a JSON answer streams on); tagged, it waits for its closing tag."""
        if region.tagged and close < 0 and not final:
            return False
        if close >= 0:
            self.at = close + len(TAG_CLOSE)
        elif region.tagged:
            self.at = len(self.text)
        else:
            self.at = min(len(self.text), _skip_space(self.text, region.body, len(self.text)) + 1)
        self._say(out, self.text[region.held : self.at])
        self.region = None
        return True

    def _open_call(self, out: list[dict[str, Any]], name: str) -> int:
        call = Call(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        head = {"id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}
        out.append({"tool_calls": [{"index": len(self.calls) - 1} | head]})
        return len(self.calls) - 1

    def _send_arguments(self, out: list[dict[str, Any]], call: Call, obj: CallObject, stop: int, final: bool) -> None:
        """The raw text of the call's arguments as far as it runs; a string's value (JSON in a string)
        once whole; ``{}`` for a call written without any."""
        if call.done:
            return
        piece = ""
        if obj.arguments is not None:
            start, end = obj.arguments
            if self.text[start] == '"':
                if end is not None and not call.arguments:
                    value = _loads(self.text[start:end])
                    piece = value if isinstance(value, str) else self.text[start:end]
            else:
                piece = self.text[start + len(call.arguments) : end if end is not None else stop]
        elif obj.end is not None:
            piece = "{}"
        if piece:
            call.arguments += piece
            out.append({"tool_calls": [{"index": self.calls.index(call), "function": {"arguments": piece}}]})
        call.done = obj.end is not None or (final and obj.arguments is not None and obj.arguments[1] is not None)

    def _say(self, out: list[dict[str, Any]], piece: str) -> None:
        if piece:
            self.content, self.after_call = True, False
            if out and "content" in out[-1]:
                out[-1]["content"] += piece
            else:
                out.append({"content": piece})


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _skip_space(text: str, i: int, stop: int) -> int:
    while i < stop and text[i].isspace():
        i += 1
    return i


def prefix_of(text: str, word: str) -> int:
    """How many of the text's last characters could begin ``word``."""
    return max((k for k in range(1, len(word)) if text.endswith(word[:k])), default=0)


def _opener_prefix(text: str, at: int) -> int:
    return min(max(prefix_of(text, o) for o in OPENERS), len(text) - at)
