"""Tool calls as OpenAI's chat API asks for them: ``tools``, ``tool_choice`` and the messages that carry
calls and their results back (the calls in an answer are read by ``calls``).

The tools reach the model through its own chat template (``apply_chat_template(tools=…)``), and with
``tool_choice: "auto"`` the model decides. With ``"required"`` or a named function the text is
constrained to a call (``{"name": …, "arguments": {…}}`` under the functions' parameter schemas, as a
``json_schema`` request is), so it is one whatever the model would have written, and the answer holds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A request's tools or tool messages are malformed: the message and the field it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """The functions a chat offers (OpenAI's ``function`` objects) and how the model may call them:
    ``choice`` is "auto", "required", or the one function's name it must call."""

    functions: tuple[dict[str, Any], ...]
    choice: str

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them."""
        return [{"type": "function", "function": f} for f in self.functions]

    def schema(self) -> str | None:
        """The JSON schema of the answer when it must be a call (None under "auto")."""
        if not self.forced:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
            if self.choice in ("required", f["name"])
        ]
        return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """A chat request's ``tools`` and ``tool_choice`` (None: no tools, or "none"); ``ToolError`` when
    they are malformed."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not isinstance(tools, list):
        raise ToolError('\'tools\' must be a list of {"type": "function", "function": {…}}', "tools")
    functions = []
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": …}}}}', "tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions.append(f)
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if named not in [f["name"] for f in functions]:
            raise ToolError("'tool_choice' names a function that is not among 'tools'", "tool_choice")
        choice = named
    elif choice is None:
        choice = "auto"
    elif choice not in CHOICES:
        raise ToolError(f'\'tool_choice\' must be one of {CHOICES} or {{"type": "function", …}}', "tool_choice")
    elif choice == "required" and not functions:
        raise ToolError("'tool_choice' is 'required' but 'tools' is empty", "tool_choice")
    return Tools(tuple(functions), choice) if functions and choice != "none" else None


def message(m: dict[str, Any], i: int) -> dict[str, Any] | None:
    """A tool message, or an assistant message with calls, as chat templates take them (a call's
    arguments as an object); None for any other message."""
    if m.get("role") == "tool":
        if not isinstance(m.get("content"), str):
            raise ToolError(f"messages[{i}]: a tool message needs a text content", f"messages[{i}]")
        return {"role": "tool", "content": m["content"], "tool_call_id": str(m.get("tool_call_id", ""))}
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return None
    if not isinstance(m["tool_calls"], list):
        raise ToolError(f"messages[{i}].tool_calls must be a list of calls", f"messages[{i}]")
    calls = []
    for call in m["tool_calls"]:
        f = call.get("function") if isinstance(call, dict) else None
        try:
            arguments = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
        except (TypeError, KeyError, ValueError) as e:
            problem = f"messages[{i}].tool_calls: each needs a function's name and JSON arguments"
            raise ToolError(problem, f"messages[{i}]") from e
        function = {"name": f.get("name"), "arguments": arguments}
        calls.append({"id": call.get("id"), "type": "function", "function": function})
    return {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}
