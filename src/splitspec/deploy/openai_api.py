"""The OpenAI schema as this server speaks it: requests checked field by field, the prompt's token ids,
text handed out as it is decoded (with stop strings), and the response, chunk and error bodies.

Tools reach a local model through OpenAI's client libraries, so the bodies, the error shape and the SSE
framing follow OpenAI's exactly; nothing here needs Ray, Serve or a model.
"""

import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jinja2 import TemplateError

from splitspec.config import MAX_LOGPROBS, SEEDS, SamplingParams
from splitspec.deploy import tools

DEFAULT_MAX_TOKENS = 256  # what a request without max_tokens gets (capped by the context left)
# Fields a client may send that change the text in ways this server does not do: taken at their neutral
# values only (clients send those by default); anything else is refused, never silently ignored.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),  # the deprecated form of tools
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True,),  # an answer may hold several calls
}
# the logit shaping a request may ask for (``SamplingParams``), each at its "off" value
SHAPING_OFF = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
MAX_STOPS, ROLES = 4, ("system", "developer", "user", "assistant", "tool")  # as OpenAI allows
MAX_CHOICES = 128  # OpenAI's limit on n; the engine refuses what it cannot hold at once
MAX_STOP_IDS = 64
TEMPLATE_FLAGS = ("add_generation_prompt", "continue_final_message")  # a chat's fields for its template
# ``apply_chat_template``'s own arguments: the server's to set (the template, the form of the ids it returns),
# or a field of the request's own; ``chat_template_kwargs`` holds the template's variables only
TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "conversation", "tools", "chat_template", "tokenize", "sanitize_control_tokens", "padding"}
    | {"truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask"}
    | {"tokenizer_kwargs", *TEMPLATE_FLAGS}
)
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object, as a schema


class RequestError(Exception):
    """A request the server refuses: its HTTP status and the OpenAI error body's fields."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, retry_after_s: int = 0
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after_s = status, param, code, retry_after_s
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


Prompt = str | tuple[int, ...] | list[dict[str, str]]  # a text, token ids, or a chat's messages


@dataclass
class Request:
    """One completion request's fields, checked: its ``prompts`` (a chat's messages; a completion's text or
    token ids, or a batch of them) and ``n`` choices of each."""

    prompts: list[Prompt]
    max_tokens: int | None
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage block
    logprobs: int | None = None  # alternatives beside each token's logprob (None: no logprobs)
    echo: bool = False  # a completion's text (and logprobs) start with the prompt's
    n: int = 1
    offered: tools.Tools | None = None  # a chat's functions, unless there are none or tool_choice is "none"
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: more tokens that end the text
    ignore_eos: bool = False  # vLLM's: the model's end-of-sequence tokens do not end it
    template: dict[str, Any] = field(default_factory=dict)  # a chat's options for its template (``template_options``)

    def stops(self, model_eos: Collection[int]) -> list[int]:
        """The token ids that end this request's text."""
        return sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(model_eos)))

    @property
    def chat(self) -> bool:
        return isinstance(self.prompts[0], list)

    def choices(self) -> list[tuple[int, SamplingParams]]:
        """Each choice's prompt (an index into ``prompts``) and sampling, in OpenAI's order (a prompt's
        ``n`` choices together): with a seed, choice j of a prompt samples with seed + j, so that they
        differ and the request stays repeatable."""
        seeded = self.params.seed is not None
        return [
            (i, replace(self.params, seed=self.params.seed + j) if seeded else self.params)
            for i in range(len(self.prompts))
            for j in range(self.n)
        ]


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None, required: bool = False):
    """``body[name]`` if it is one of ``kinds`` (a bool is no number here); a 400 naming it otherwise."""
    if name not in body or body[name] is None:
        if required:
            raise RequestError(400, f"'{name}' is a required property", name, "missing_field")
        return default
    value = body[name]
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(400, f"'{name}' must be {names}, got {type(value).__name__}", name, "invalid_type")
    return value


def _messages(value: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as the tokenizer's template takes them; text parts are joined (no images here); tool
    calls and their results as ``tools.message`` has them; a ``developer`` message (OpenAI's newer name for
    the system's) as the system's, which is the role chat templates know."""
    if not value:
        raise RequestError(400, "'messages' must hold at least one message", "messages", "invalid_value")
    out = []
    for i, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
            m = m | {"content": content}
        try:
            call = tools.message(m, i) if isinstance(m, dict) else None
        except tools.ToolError as e:
            raise RequestError(400, str(e), e.param, "invalid_value") from e
        if call is not None:
            out.append(call)
            continue
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(content, str):
            message = f"messages[{i}] must be an object with a role among {ROLES} and a text content"
            raise RequestError(400, message, f"messages[{i}]", "invalid_value")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def parse_request(body: Any, chat: bool, alias: str) -> Request:
    """Check a request body against the OpenAI schema; raises ``RequestError`` (400, or 404 for a model
    this server does not serve)."""
    _check_model(body, alias, required=True)
    if chat:
        prompts: list[Prompt] = [_messages(_get(body, "messages", (list,), required=True))]
    else:
        prompts = _completion_prompts(_get(body, "prompt", (str, list), required=True))
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, (int,))
    if max_tokens is not None and max_tokens <= 0:
        raise RequestError(400, f"'{name}' must be at least 1, got {max_tokens}", name, "invalid_value")
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_CHOICES:
        raise RequestError(400, f"'n' must be in [1, {MAX_CHOICES}], got {n}", "n", "invalid_value")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            message = f"'{name}' is not supported by this server: leave it out or send {neutral[0]!r}"
            raise RequestError(400, message, name, "unsupported_parameter")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"'stop' must be a string or up to {MAX_STOPS} non-empty strings", "stop")
    temperature, top_p = (float(_get(body, k, (int, float), 1.0)) for k in ("temperature", "top_p"))
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    logprobs, echo = _logprobs(body, chat)
    scored = logprobs if echo else None
    top_k = _get(body, "top_k", (int,), 0)  # vLLM's extension; its "no cut" is -1, ours 0
    top_k = 0 if top_k == -1 else top_k
    shaping = {name: float(_get(body, name, (int, float), off)) for name, off in SHAPING_OFF.items()}
    seed, schema = _get(body, "seed", (int,)), _json_schema(_get(body, "response_format", (dict,), {"type": "text"}))
    if seed is not None and not SEEDS[0] <= seed <= SEEDS[1] - (n - 1):  # choice j samples with seed + j
        raise RequestError(400, f"'seed' must be in [{SEEDS[0]}, {SEEDS[1] - (n - 1)}] for n = {n}", "seed")
    shaping["min_tokens"] = _get(body, "min_tokens", (int,), 0)  # vLLM's
    if max_tokens is not None and shaping["min_tokens"] > max_tokens:
        message = f"'min_tokens' ({shaping['min_tokens']}) exceeds the most tokens asked for ({max_tokens})"
        raise RequestError(400, message, "min_tokens", "invalid_value")
    try:
        bias = _logit_bias(_get(body, "logit_bias", (dict,), {}))
        shaping |= {"logit_bias": bias, **_language(body, schema)}
        params = SamplingParams(temperature, top_p, top_k, seed, logprobs, scored, **shaping)
    except ValueError as e:  # its message starts with the field's name
        raise RequestError(400, str(e), str(e).split(" ", 1)[0], "invalid_value") from e
    stream, options = _get(body, "stream", (bool,), False), _get(body, "stream_options", (dict,), {})
    use = bool(options.get("include_usage"))
    if not chat and body.get("tools"):
        raise RequestError(400, "'tools' are for /v1/chat/completions", "tools", "invalid_value")
    try:
        offered = tools.parse_tools(body) if chat else None
    except tools.ToolError as e:
        raise RequestError(400, str(e), e.param, "invalid_value") from e
    if offered is not None and offered.forced:  # the answer is a call: its schema, whatever else the request says
        params = replace(params, json_schema=offered.schema(), grammar=None, regex=None, min_tokens=0)
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if len(stop_ids) > MAX_STOP_IDS or not all(_is_id(t) for t in stop_ids):
        message = f"'stop_token_ids' must be a list of up to {MAX_STOP_IDS} token ids"
        raise RequestError(400, message, "stop_token_ids", "invalid_value")
    ignore_eos = _get(body, "ignore_eos", (bool,), False)
    ends = {"stop_token_ids": tuple(stop_ids), "ignore_eos": ignore_eos}
    ends |= {"template": template_options(body, prompts[0]) if chat else {}}
    return Request(prompts, max_tokens, params, stop, stream, use, logprobs, echo, n, offered, **ends)


def _check_model(body: Any, alias: str, required: bool) -> None:
    """A body that is a JSON object naming this server's model (where it names one, unless ``required``)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None, "invalid_body")
    model = _get(body, "model", (str,), alias, required=required)
    if model != alias:
        raise RequestError(404, f"The model '{model}' does not exist; this server serves '{alias}'", "model")


def tokenize_ids(tokenizer: Any, body: Any, alias: str) -> list[int]:
    """vLLM's ``/tokenize``: the ids a completion's ``prompt`` (with ``add_special_tokens``, default true) or a
    chat's ``messages`` (through the template, with its ``tools`` and ``template_options``) would be, so
    that a client counts its prompt against the context before it sends it."""
    _check_model(body, alias, required=False)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError(400, "send one of 'prompt' (a text) or 'messages' (a chat)", None, "invalid_value")
    if "prompt" in body:
        special = _get(body, "add_special_tokens", (bool,), True)
        return list(tokenizer(_get(body, "prompt", (str,), required=True), add_special_tokens=special)["input_ids"])
    messages = _messages(_get(body, "messages", (list,), required=True))
    try:
        offered = tools.parse_tools(body)
    except tools.ToolError as e:
        raise RequestError(400, str(e), e.param, "invalid_value") from e
    return chat_ids(tokenizer, messages, offered, template_options(body, messages))


def detokenize_text(tokenizer: Any, body: Any) -> str:
    """vLLM's ``/detokenize``: the text of ``tokens``, ids of this model's vocabulary."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(_is_id(t) and t < len(tokenizer) for t in tokens):
        message = f"'tokens' must be a list of token ids below {len(tokenizer)}, this model's vocabulary"
        raise RequestError(400, message, "tokens", "invalid_value")
    return tokenizer.decode(tokens)


def template_options(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat's keyword arguments for ``apply_chat_template``, as vLLM takes them: ``chat_template_kwargs``
    (Qwen3's ``enable_thinking``, say), and ``continue_final_message``: the answer goes on from the last
    message, the assistant's (a prefill), with no generation prompt after it."""
    extra = _get(body, "chat_template_kwargs", (dict,), {})
    taken = sorted(set(extra) & TEMPLATE_ARGUMENTS)
    if taken:
        message = f"'chat_template_kwargs' may not set {taken[0]!r}: it is the server's, or a field of its own"
        raise RequestError(400, message, "chat_template_kwargs", "invalid_value")
    go_on = _get(body, "continue_final_message", (bool,), False)
    generation = _get(body, "add_generation_prompt", (bool,), not go_on)
    if go_on and (generation or messages[-1]["role"] != "assistant"):
        message = "'continue_final_message' goes on from a last message of the assistant, with no generation prompt"
        raise RequestError(400, message, "continue_final_message", "invalid_value")
    return extra | {"add_generation_prompt": generation, "continue_final_message": go_on}


def _json_schema(value: dict[str, Any]) -> str | None:
    """OpenAI's ``response_format`` as the schema the text must follow (None: free text)."""
    kind, spec = value.get("type"), value.get("json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        return json.dumps(spec["schema"])
    message = (
        '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": …, "schema": {…}}}'
    )
    raise RequestError(400, message, "response_format", "invalid_value")


def _language(body: dict[str, Any], schema: str | None) -> dict[str, str]:
    """The language a request's text must follow (``SamplingParams``' field: its text), one at most:
    ``response_format``'s schema, llama.cpp's ``grammar`` (GBNF), vLLM's ``guided_grammar``,
    ``guided_regex`` and ``guided_choice`` (one of the texts), or its ``structured_outputs`` object with
    one of ``json``, ``grammar``, ``regex``, ``choice``."""
    given = {"response_format": ("json_schema", schema)} if schema is not None else {}
    for name, kind in (("grammar", "grammar"), ("guided_grammar", "grammar"), ("guided_regex", "regex")):
        if body.get(name) is not None:
            given[name] = (kind, _get(body, name, (str,)))
    if body.get("guided_choice") is not None:
        given["guided_choice"] = ("grammar", _choice(body["guided_choice"], "guided_choice"))
    for key, value in _get(body, "structured_outputs", (dict,), {}).items():
        name = f"structured_outputs.{key}"
        if key == "choice":
            given[name] = ("grammar", _choice(value, name))
        elif key == "json" and isinstance(value, dict | str):
            given[name] = ("json_schema", value if isinstance(value, str) else json.dumps(value))
        elif key in ("grammar", "regex") and isinstance(value, str):
            given[name] = (key, value)
        else:
            message = f"'{name}' must be one of json (a schema), grammar, regex (texts) or choice (a list of texts)"
            raise RequestError(400, message, name, "invalid_value")
    if len(given) > 1:
        message = f"the text can follow one language: {', '.join(given)} ask for {len(given)}"
        raise RequestError(400, message, next(iter(given)), "invalid_value")
    return {kind: text for kind, text in given.values()}


def _choice(value: Any, name: str) -> str:
    """vLLM's choice, one of a list of texts, as the grammar that takes each of them whole."""
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise RequestError(400, f"'{name}' must be a list of non-empty texts", name, "invalid_value")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)


def _logit_bias(value: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON's string keys) to numbers."""
    out = {}
    for key, bias in value.items():
        if not str(key).isdigit() or isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"logit_bias maps token ids to numbers, got {key!r}: {bias!r}")
        out[int(key)] = float(bias)
    return out


def _completion_prompts(value: str | list[Any]) -> list[Prompt]:
    """A completion's prompts: a text or token ids, or a list of them (how evaluation harnesses send a
    batch); each becomes its own choices."""
    if isinstance(value, str) or (value and all(_is_id(t) for t in value)):
        value = [value]
    if value and all(isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p)) for p in value):
        return [p if isinstance(p, str) else tuple(p) for p in value]
    message = "'prompt' must be a text or a list of token ids, or a list of those"
    raise RequestError(400, message, "prompt", "invalid_value")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[int | None, bool]:
    """(how many alternatives each token's logprob comes with, None for no logprobs; echo): a chat asks by
    ``logprobs: true`` and ``top_logprobs``, a completion by ``logprobs: k`` and ``echo``."""
    if chat:
        wanted, name = _get(body, "logprobs", (bool,), False), "top_logprobs"
        top = _get(body, name, (int,))
        if top is not None and not wanted:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", name, "invalid_value")
        k, echo = (top or 0) if wanted else None, False
    else:
        name = "logprobs"
        k, echo = _get(body, name, (int,)), _get(body, "echo", (bool,), False)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise RequestError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name, "invalid_value")
    return k, echo


def chat_ids(
    tokenizer: Any,
    messages: str | list[dict[str, Any]],
    offered: tools.Tools | None = None,
    options: dict[str, Any] | None = None,
) -> list[int]:
    """A chat's token ids through the tokenizer's own template, ready for the answer (a str: one user turn),
    with the functions ``offered`` where a request has some and its ``template_options``."""
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    kwargs = {"add_generation_prompt": True} | (options or {})
    try:
        ids = tokenizer.apply_chat_template(messages, tools=offered.template() if offered else None, **kwargs)
    # transformers' word on options the template cannot take (a final message's form), or the template's own
    # (``raise_exception``: roles that do not alternate, say)
    except (ValueError, TemplateError) as e:
        raise RequestError(400, f"the chat template refused the request: {e}", "messages", "invalid_value") from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a dict or a list, by transformers version


def prompt_ids(
    tokenizer: Any, prompt: Prompt, offered: tools.Tools | None = None, options: dict[str, Any] | None = None
) -> list[int]:
    """A prompt's token ids: a chat through the tokenizer's own template (with the functions ``offered``),
    a text as it is, token ids as given (each checked against the vocabulary)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, tuple):
        if max(prompt) >= len(tokenizer):
            message = f"'prompt' holds token id {max(prompt)}; this model's vocabulary has {len(tokenizer)}"
            raise RequestError(400, message, "prompt", "invalid_value")
        return list(prompt)
    return chat_ids(tokenizer, prompt, offered, options)


def prompt_text(tokenizer: Any, prompt: Prompt) -> str:
    """A completion's prompt as text (what ``echo`` returns): as given, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))


def fit_context(request: Request, n_prompt: int, context: int) -> int:
    """The max_tokens to run: the request's, or the default capped by the context left; a 400 when the
    prompt or the prompt and max_tokens do not fit the engine's context."""
    param = "messages" if request.chat else "prompt"
    if n_prompt < 1 or n_prompt >= context:
        message = f"the prompt has {n_prompt} tokens; this model's context is {context} (prompt and completion)"
        raise RequestError(400, message, param, "context_length_exceeded")
    if request.max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, context - n_prompt)
    if n_prompt + request.max_tokens > context:
        message = f"this model's context is {context} tokens: {n_prompt} in the prompt, {request.max_tokens} asked"
        raise RequestError(400, message, "max_tokens", "context_length_exceeded")
    return request.max_tokens


_CONTEXT_TOKENS = 4  # tokens of context before a decode window


def _held(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class TextStream:
    """The decoded text of a growing token list, handed out in final pieces: a piece never holds half a
    character nor the start of a stop string that the next tokens might complete, so the pieces join into
    the text a whole answer gets, cut before the first stop string (``stopped`` then).

    Each feed decodes only a window of recent tokens (incremental detokenization): the window starts a few
    tokens before the new ones, because a token's text can depend on its neighbours (a leading space, a
    character split across byte tokens), and its own text is subtracted. A whole-list decode per poll
    would cost the answer's length at every token."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of tokens[: self._read]
        self._prefix = self._read = 0  # the window: tokens[_prefix:_read] are context, already in text
        self.sent = 0  # characters handed out
        self.stopped = False

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        """Append the text of the tokens after ``_read``, unless it ends in half a character."""
        context = self._decode(self.tokens[self._prefix : self._read])
        window = self._decode(self.tokens[self._prefix :])
        if window.endswith("\ufffd") and not final:
            return  # half a character: the next token completes it
        self.text += window[len(context) :]
        self._read = len(self.tokens)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)

    def feed(self, tokens: Sequence[int], final: bool = False) -> str:
        """The text that ``tokens`` (the next ones) make final; with ``final`` all that is left."""
        self.tokens += tokens
        self._advance(final)
        text = self.text
        cuts = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]  # none starts before sent
        if cuts:
            self.stopped, end = True, min(cuts)
        elif final:
            end = len(text)
        else:
            end = len(text) - _held(text, self.stop)
        piece = text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece

    def covered(self) -> int:
        """How many tokens the text handed out so far comes from (the last one perhaps in part)."""
        if self._read == len(self.tokens) and self.sent == len(self.text):
            return len(self.tokens)
        return self.tokens_for(self.sent)

    def tokens_for(self, chars: int) -> int:
        """How many of the first tokens it takes to decode at least ``chars`` characters: those a stop string
        leaves in the answer (the one it starts in included)."""
        lo, hi = 0, len(self.tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(self.tokens[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def finish_reason(self, stops: Collection[int]) -> str:
        """ "stop" for a stop string or a token that ends the text, "length" for running out of max_tokens."""
        return "stop" if self.stopped or (bool(self.tokens) and self.tokens[-1] in stops) else "length"


Wire = Sequence[Any]  # a token's logprob from the engine: [token, logprob, [[token, logprob], ...]]


class LogprobBlocks:
    """OpenAI's logprobs blocks from the engine's entries (``TokenLogprob.to_wire``). A token's text is its
    own decode, special tokens kept; a chat's entries carry its UTF-8 bytes (None for a token that holds
    part of a character), a completion's its offset in the text the answer returns (``offset`` runs on
    from block to block of one stream)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _chat_token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": None if "\ufffd" in text else list(text.encode())}

    def chat(self, entries: Sequence[Wire]) -> dict[str, Any]:
        content = [
            self._chat_token(token, logprob) | {"top_logprobs": [self._chat_token(t, lp) for t, lp in top]}
            for token, logprob, top in entries
        ]
        return {"content": content, "refusal": None}

    def completion(self, entries: Sequence[Wire]) -> dict[str, Any]:
        """Entries with a None logprob and top (an echoed prompt's first token) are listed as such."""
        block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in entries:
            text = self._text(token)
            block["tokens"].append(text)
            block["token_logprobs"].append(logprob)
            block["top_logprobs"].append(None if top is None else {self._text(t): lp for t, lp in top})
            block["text_offset"].append(self.offset)
            self.offset += len(text)
        return block

    def block(self, chat: bool, entries: Sequence[Wire]) -> dict[str, Any]:
        return self.chat(entries) if chat else self.completion(entries)


def usage(
    n_prompt: int, n_completion: int, summaries: Sequence[dict[str, Any]], reasoning: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage block (prompt tokens whose K/V were reused count as ``cached_tokens``, as OpenAI's
    prompt caching reports them; ``reasoning`` of the completion's tokens were thinking, where the server
    reads it apart) with the speculation figures of the generations beside it: summed over a request's
    choices, the means per check weighted by each one's checks."""
    checks = sum(int(s.get("checks", 0)) for s in summaries)

    def mean(key: str) -> float:
        return sum(s.get(key, 0.0) * int(s.get("checks", 0)) for s in summaries) / checks if checks else 0.0

    drafted, accepted = mean("drafted"), mean("accepted")
    speculation = {
        "checks": checks,
        "draft_tokens": round(drafted * checks),
        "accepted_tokens": round(accepted * checks),
    }
    speculation |= {"mean_accepted_per_check": accepted, "tokens_per_check": mean("tokens_per_check")}
    use = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
    cached = sum(int(s.get("reused_prompt_tokens", 0)) for s in summaries)
    use["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        use["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    shape = summaries[0].get("shape") if summaries else None
    return use | {"speculation": speculation | {"draft_shape": shape}}


def choice_body(
    chat: bool,
    index: int,
    text: str | None,
    finish: str,
    logprobs: dict | None = None,
    calls: list | None = None,
    thought: str | None = None,
) -> dict[str, Any]:
    """One choice of a whole (not streamed) answer; a chat's ``calls`` and ``thought`` (its tool calls and
    its thinking, as ``reasoning.AnswerReader.whole`` reads them)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": "tool_calls" if calls else finish, "logprobs": logprobs}
    if not chat:
        return choice | {"text": text}
    message = {"role": "assistant", "content": text} | ({"reasoning_content": thought} if thought is not None else {})
    message |= {"tool_calls": calls} if calls else {}
    return choice | {"message": message}


def response_body(chat: bool, rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict:
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, "usage": use}


class Chunks:
    """The SSE events of one streamed answer as OpenAI sends them: a chat's first chunk names the role,
    then a chunk per piece of text, one with the finish_reason, the usage chunk when asked for, ``[DONE]``."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat, self.rid, self.model = chat, rid, model
        self.kind, self.created = ("chat.completion.chunk" if chat else "text_completion"), int(time.time())

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model}
        return f"data: {json.dumps(chunk | {'choices': choices} | extra)}\n\n"

    def choice(
        self,
        text: str | None,
        reason: str | None = None,
        role: bool = False,
        logprobs: dict | None = None,
        index: int = 0,
    ) -> str:
        """One choice's chunk: its text."""
        out: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
        if not self.chat:
            return self.event([out | {"text": text or ""}])
        delta = {"role": "assistant"} if role else {}
        return self.delta(delta | ({"content": text} if text is not None else {}), index, logprobs, reason)

    def delta(self, delta: dict[str, Any], index: int, logprobs: dict | None = None, reason: str | None = None) -> str:
        """A chat choice's chunk as given: content, or a piece of a tool call (``calls.CallReader``)."""
        return self.event([{"index": index, "finish_reason": reason, "logprobs": logprobs, "delta": delta}])

    def start(self, choices: int = 1) -> list[str]:
        return [self.choice("", role=True, index=i) for i in range(choices)] if self.chat else []

    def finish(self, index: int, reason: str) -> str:
        return self.choice(None, reason, index=index)

    def end(self, use: dict[str, Any] | None) -> list[str]:
        return [*([self.event([], usage=use)] if use is not None else []), "data: [DONE]\n\n"]

    @staticmethod
    def error(e: "RequestError") -> list[str]:
        """A failure after the stream began: OpenAI's clients raise on an event that carries an error."""
        return [f"data: {json.dumps(e.body())}\n\n", "data: [DONE]\n\n"]
