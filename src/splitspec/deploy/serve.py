"""An OpenAI-compatible HTTP endpoint on Ray Serve, over the engine actor the scheduler placed.

People reach a local model from their own tools (editors, agents, the ``openai`` client) through the
OpenAI schema, so the routes, bodies, errors and SSE framing follow it: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, plus ``/health`` and ``/metrics`` (Prometheus text). The Serve
replica holds only the tokenizer and a handle to the scheduler's engine actor: a second engine would need
a second copy of the base and its own CPU actors, and the placement already reserved this host's CPUs,
so the replica asks Ray for none.

First slice: the engine actor returns a whole generation at once (``EngineService.generate``), so a
``stream`` request gets its SSE chunks, one per token, once the engine has finished (incremental streaming
needs a generator method on the engine actor); requests take the engine in turn. Serve and FastAPI are
imported only when a server is built, so the rest of the CLI starts without them.
"""

import argparse
import json
import os
import secrets
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitspec.config import EngineConfig, SamplingParams

DEFAULT_ALIAS = "splitspec"
DEFAULT_MAX_TOKENS = 256  # what a request without max_tokens gets (capped by the context left)
MAX_STOPS, ROLES = 4, ("system", "user", "assistant")  # as OpenAI allows


class RequestError(Exception):
    """A request the server refuses: its HTTP status and the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One completion request's fields, checked; ``prompt`` is the text or the chat's messages."""

    prompt: str | list[dict[str, str]]
    max_tokens: int | None
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage block


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


def _messages(value: list[Any]) -> list[dict[str, str]]:
    """Chat messages as the tokenizer's template takes them; text parts are joined (no images here)."""
    if not value:
        raise RequestError(400, "'messages' must hold at least one message", "messages", "invalid_value")
    out = []
    for i, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(content, str):
            message = f"messages[{i}] must be an object with a role among {ROLES} and a text content"
            raise RequestError(400, message, f"messages[{i}]", "invalid_value")
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(body: Any, chat: bool, alias: str) -> Request:
    """Check a request body against the OpenAI schema; raises ``RequestError`` (400, or 404 for a model
    this server does not serve)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None, "invalid_body")
    model = _get(body, "model", (str,), required=True)
    if model != alias:
        raise RequestError(404, f"The model '{model}' does not exist; this server serves '{alias}'", "model")
    if chat:
        prompt: Any = _messages(_get(body, "messages", (list,), required=True))
    else:
        prompt = _get(body, "prompt", (str,), required=True)  # one text: no batches of prompts here
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, (int,))
    if max_tokens is not None and max_tokens <= 0:
        raise RequestError(400, f"'{name}' must be at least 1, got {max_tokens}", name, "invalid_value")
    if _get(body, "n", (int,), 1) != 1:
        raise RequestError(400, "only n=1 is supported", "n", "invalid_value")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"'stop' must be a string or up to {MAX_STOPS} non-empty strings", "stop")
    temperature, top_p = (float(_get(body, k, (int, float), 1.0)) for k in ("temperature", "top_p"))
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=_get(body, "seed", (int,)))
    except ValueError as e:
        raise RequestError(400, str(e), "top_p") from e
    stream, options = _get(body, "stream", (bool,), False), _get(body, "stream_options", (dict,), {})
    return Request(prompt, max_tokens, params, stop, stream, bool(options.get("include_usage")))


def chat_ids(tokenizer: Any, messages: str | list[dict[str, str]]) -> list[int]:
    """A chat's token ids through the tokenizer's own template, ready for the answer (a str: one user turn)."""
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a dict or a list, by transformers version


def prompt_ids(tokenizer: Any, request: Request) -> list[int]:
    """The prompt's token ids: a chat through the tokenizer's own template, a text as it is."""
    if isinstance(request.prompt, str):
        return list(tokenizer(request.prompt)["input_ids"])
    return chat_ids(tokenizer, request.prompt)


def fit_context(request: Request, n_prompt: int, context: int) -> int:
    """The max_tokens to run: the request's, or the default capped by the context left; a 400 when the
    prompt or the prompt and max_tokens do not fit the engine's context."""
    param = "prompt" if isinstance(request.prompt, str) else "messages"
    if n_prompt < 1 or n_prompt >= context:
        message = f"the prompt has {n_prompt} tokens; this model's context is {context} (prompt and completion)"
        raise RequestError(400, message, param, "context_length_exceeded")
    if request.max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, context - n_prompt)
    if n_prompt + request.max_tokens > context:
        message = f"this model's context is {context} tokens: {n_prompt} in the prompt, {request.max_tokens} asked"
        raise RequestError(400, message, "max_tokens", "context_length_exceeded")
    return request.max_tokens


def token_pieces(tokenizer: Any, tokens: Sequence[int]) -> list[str]:
    """Each token's share of the decoded text, special tokens left out (a character split across tokens
    comes with its last), so that streamed pieces join into the text a non-streamed answer gets."""
    pieces, previous = [], ""
    for i in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:i], skip_special_tokens=True)
        whole = text.startswith(previous) and not (text.endswith("\ufffd") and i < len(tokens))
        pieces.append(text[len(previous) :] if whole else "")
        previous = text if whole else previous
    return pieces


def apply_stop(pieces: list[str], stop: Sequence[str], ended_by_eos: bool) -> tuple[list[str], str]:
    """(the pieces cut before the first stop string, finish_reason): a stop string or the end-of-sequence
    token is "stop", running out of max_tokens "length"."""
    text = "".join(pieces)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    if not cuts:
        return pieces, "stop" if ended_by_eos else "length"
    left, kept = min(cuts), []
    for piece in pieces:
        if left <= 0:
            break
        kept.append(piece[:left])
        left -= len(kept[-1])
    return kept, "stop"


def usage(n_prompt: int, n_completion: int, summary: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage block with the speculation figures of this generation beside it."""
    checks, drafted, accepted = int(summary.get("checks", 0)), summary.get("drafted", 0.0), summary.get("accepted", 0.0)
    speculation = {
        "checks": checks,
        "draft_tokens": round(drafted * checks),
        "accepted_tokens": round(accepted * checks),
    }
    speculation |= {"mean_accepted_per_check": accepted, "tokens_per_check": summary.get("tokens_per_check", 0.0)}
    use = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
    return use | {"speculation": speculation | {"draft_shape": summary.get("shape")}}


def response_body(chat: bool, rid: str, model: str, text: str, finish: str, use: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice], "usage": use}


def sse_events(
    chat: bool, rid: str, model: str, pieces: list[str], finish: str, use: dict[str, Any] | None
) -> Iterator[str]:
    """The SSE events of a streamed answer as OpenAI sends them: a chunk per piece of text (a chat's first
    names the role), one with the finish_reason, the usage chunk when asked for, then ``[DONE]``."""
    kind, created = ("chat.completion.chunk" if chat else "text_completion"), int(time.time())

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    def choice(text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if not chat:
            return out | {"text": text or ""}
        delta = {"role": "assistant"} if role else {}
        return out | {"delta": delta | ({"content": text} if text is not None else {})}

    if chat:
        yield event([choice("", None, role=True)])
    for piece in pieces:
        if piece:
            yield event([choice(piece, None)])
    yield event([choice(None, finish)])
    if use is not None:
        yield event([], usage=use)
    yield "data: [DONE]\n\n"


class Metrics:
    """Prometheus figures in a registry of their own (a second server in one process keeps its names)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = r = CollectorRegistry()
        self.requests = Counter("splitspec_requests", "HTTP requests", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("splitspec_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter("splitspec_completion_tokens", "tokens generated", registry=r)
        self.decode_tok_s = Gauge("splitspec_decode_tokens_per_second", "decode tok/s of the last request", registry=r)
        self.tokens_per_check = Gauge("splitspec_tokens_per_check", "tokens per check of the last request", registry=r)

    def record(self, n_prompt: int, n_completion: int, summary: dict[str, Any]) -> None:
        self.prompt_tokens.inc(n_prompt)
        self.completion_tokens.inc(n_completion)
        decode_s = summary.get("generate_s", 0.0) - summary.get("prefill_ms", 0.0) / 1e3
        if n_completion > 1 and decode_s > 0:  # the first token comes from the prefill
            self.decode_tok_s.set((n_completion - 1) / decode_s)
        if summary.get("checks"):
            self.tokens_per_check.set(summary["tokens_per_check"])

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def build_app(
    engine: Any, folder: str | Path, alias: str = DEFAULT_ALIAS, api_key: str | None = None, context: int = 0
):
    """The Serve application over ``engine`` (the scheduler's engine actor handle); ``context``: the
    engine's ``max_seq_len`` (0: ``EngineConfig``'s default). ``/health`` and ``/metrics`` answer without
    the API key (probes and scrapers carry none); the ``/v1`` routes need it when one is set."""
    import ray
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from ray import serve

    app = FastAPI(title="splitspec")

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    @serve.ingress(app)
    class OpenAIServer:
        def __init__(self, engine: Any, folder: str, alias: str, api_key: str | None, context: int) -> None:
            from transformers import AutoTokenizer

            self.engine, self.alias, self.api_key = engine, alias, api_key
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.context = context or EngineConfig().max_seq_len
            self.metrics = Metrics()

        def _error(self, route: str, e: RequestError) -> JSONResponse:
            self.metrics.requests.labels(route, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)

        def _check_key(self, request: HttpRequest) -> None:
            given, wanted = request.headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()
            if self.api_key is not None and not secrets.compare_digest(given, wanted):
                raise RequestError(401, "Incorrect API key provided", None, "invalid_api_key")

        @app.get("/health")
        async def health(self) -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics(self) -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models(self, request: HttpRequest) -> Any:
            try:
                self._check_key(request)
            except RequestError as e:
                return self._error("models", e)
            card = {"id": self.alias, "object": "model", "created": 0, "owned_by": "splitspec"}
            return {"object": "list", "data": [card]}

        @app.post("/v1/completions")
        async def completions(self, request: HttpRequest) -> Any:
            return await self._complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: HttpRequest) -> Any:
            return await self._complete(request, chat=True)

        async def _complete(self, http: HttpRequest, chat: bool) -> Any:
            route = "chat" if chat else "completions"
            try:
                self._check_key(http)
                try:
                    body = json.loads(await http.body())
                except ValueError as e:
                    raise RequestError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from e
                request = parse_request(body, chat, self.alias)
                ids = prompt_ids(self.tokenizer, request)
                max_tokens = fit_context(request, len(ids), self.context)
                eos = self.tokenizer.eos_token_id
                try:
                    tokens, summary = await self.engine.generate.remote(ids, max_tokens, eos, request.params)
                except ray.exceptions.RayActorError as e:
                    raise RequestError(503, f"the engine is not running: {e}", None, "engine_unavailable") from e
                except ray.exceptions.RayTaskError as e:
                    raise RequestError(500, f"the engine failed: {str(e).splitlines()[0]}") from e
            except RequestError as e:
                return self._error(route, e)
            pieces, finish = apply_stop(token_pieces(self.tokenizer, tokens), request.stop, tokens[-1:] == [eos])
            use = usage(len(ids), len(tokens), summary)
            self.metrics.record(len(ids), len(tokens), summary)
            self.metrics.requests.labels(route, "200").inc()
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if request.stream:
                events = sse_events(chat, rid, self.alias, pieces, finish, use if request.include_usage else None)
                return StreamingResponse(events, media_type="text/event-stream")
            return response_body(chat, rid, self.alias, "".join(pieces), finish, use)

    return OpenAIServer.bind(engine, str(folder), alias, api_key, context)


def start_server(app: Any, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Run ``app`` on Ray Serve at ``host:port`` (loopback unless told otherwise); returns its URL.
    Needs a connected Ray cluster; ``ray.serve.shutdown`` ends it."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="splitspec", route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand and its flags (the CLI module stays small)."""
    from splitspec.deploy.args import device_name, positive_int, residual_width  # light: the CLI's own

    p = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP endpoint (Ray Serve)")
    p.add_argument("--converted", required=True, help="a folder written by `splitspec convert`")
    p.add_argument("--bits", type=residual_width, default=8, help="residual width to serve: 6, 7 or 8")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=positive_int, default=8000)
    key = os.environ.get("SPLITSPEC_API_KEY")  # an environment variable keeps the key out of `ps`
    p.add_argument("--api-key", default=key, help="require `Authorization: Bearer KEY` on /v1 ($SPLITSPEC_API_KEY)")
    p.add_argument("--model-alias", default=DEFAULT_ALIAS, help="the model name clients ask for")
    p.add_argument("--device", type=device_name, default=EngineConfig.device, help="cpu, cuda or cuda:N")
    p.add_argument("--cpu-actors", type=positive_int, default=1, help="CPU actor processes sharing the residual rows")
    p.add_argument("--ray-address", help="Ray cluster to use (default: a running one, else embedded; 'local')")
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """Place the engine, serve it until Ctrl-C, then end Serve, the actors and the cluster this started."""
    from ray import serve

    from splitspec.deploy.args import CliError
    from splitspec.scheduler.cluster import Deployment, SchedulerConfig, SchedulerError, connect_or_start

    if not (Path(args.converted) / "manifest.json").is_file():
        raise CliError(f"{args.converted}: not a converted folder (no manifest.json); run `splitspec convert`")
    scheduler = SchedulerConfig(address=args.ray_address, cpu_actors=args.cpu_actors)
    config, cluster = EngineConfig(device=args.device), connect_or_start(scheduler)
    try:
        with Deployment.start(args.converted, args.bits, config, scheduler) as deployment:
            app = build_app(deployment.engine, args.converted, args.model_alias, args.api_key, config.max_seq_len)
            url = start_server(app, args.host, args.port)
            signal.signal(signal.SIGTERM, signal.default_int_handler)  # a service manager's stop: as Ctrl-C
            try:
                print(f"serving '{args.model_alias}' at {url}/v1 (Ctrl-C to stop)", flush=True)
                while True:
                    time.sleep(3600)
            finally:
                serve.shutdown()
    except SchedulerError as e:  # the cluster cannot hold the actors, or one could not start
        raise CliError(str(e).splitlines()[0]) from e
    finally:
        cluster.shutdown()
