"""An OpenAI-compatible HTTP endpoint on Ray Serve, over the engine actor the scheduler placed.

People reach a local model from their own tools (editors, agents, the ``openai`` client) through the
OpenAI schema (``openai_api``): ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, plus
``/health`` and ``/metrics`` (Prometheus text). The Serve replica holds only the tokenizer and a handle
to the scheduler's engine actor: a second engine would need a second copy of the base and its own CPU
actors, and the placement already reserved this host's CPUs, so the replica asks Ray for none.

A request's choices (OpenAI's ``n`` of each of its prompts) are opened on the engine together, all or
none (it may answer 429 at once: its batch and queue are full), then their tokens are long-polled as
checks decide them (one poll of the engine for all of a replica's streams) and streamed out as text;
requests and choices running at the same time share the engine's verify passes (``gpu_actor.batcher``).
A client that leaves mid-answer cancels its request, which frees its place in the batch and its K/V.
Serve and FastAPI are imported only when a server is built, so the rest of the CLI starts without them.
"""

import argparse
import asyncio
import json
import os
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from splitspec.config import BatchConfig, EngineConfig
from splitspec.deploy.calls import CallReader
from splitspec.deploy.openai_api import (
    Chunks,
    LogprobBlocks,
    Prompt,
    Request,
    RequestError,
    TextStream,
    Wire,
    choice_body,
    detokenize_text,
    fit_context,
    parse_request,
    prompt_ids,
    prompt_text,
    response_body,
    tokenize_ids,
    usage,
)
from splitspec.deploy.reasoning import AnswerReader, Thinking, open_block, thinking_tokens
from splitspec.models.spec import end_ids, eos_ids

DEFAULT_ALIAS = "splitspec"
POLL_S = 1.0  # a long-poll's longest wait for the next tokens


class Poller:
    """One replica's long-poll of the engine for all its open answers at once (``next_many``): one call a
    verify pass however many streams it serves, where a call per stream cost the engine's core a Ray call
    per token. Each answer reads its news from a queue of its own; an engine that fails fails them all."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None

    def watch(self, engine_id: str) -> asyncio.Queue:
        queue = self._queues[engine_id] = asyncio.Queue()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return queue

    def forget(self, engine_id: str) -> None:
        self._queues.pop(engine_id, None)

    async def _run(self) -> None:
        while self._queues:
            try:
                got = await _call(self.engine.next_many.remote(list(self._queues), POLL_S))
            except Exception as e:  # whatever ends the poll ends every answer waiting on it, none waits forever
                error = e if isinstance(e, RequestError) else RequestError(500, f"the engine's poll failed: {e}")
                for queue in self._queues.values():
                    queue.put_nowait(error)
                self._queues.clear()
                return
            for engine_id, entry in got.items():
                queue = self._queues.get(engine_id)
                if queue is not None and (entry["tokens"] or entry["done"]):
                    queue.put_nowait(entry)
                    if entry["done"]:
                        self.forget(engine_id)


class Answer:
    """One choice's run on the engine: ``pieces`` yields its text as checks decide it, each piece with the
    logprobs of the tokens it comes from where the request asked (an echo's prompt first, its first token
    without one); afterwards ``summary`` and ``finish`` are set. Leaving early (a stop string, a client
    gone) cancels it."""

    def __init__(
        self,
        poller: Poller,
        engine_id: str,
        request: Request,
        text: TextStream,
        stops: list[int],
        prompt: tuple[Prompt, list[int]],  # as the request gave it, and its token ids
        reader: AnswerReader | None = None,  # a chat's thinking, content and calls, where there is more than text
    ) -> None:
        self.poller, self.id, self.request, self.text, self.stops = poller, engine_id, request, text, stops
        self.prompt, self.prompt_ids = prompt
        self.reader = reader
        self.summary: dict[str, Any] = {}
        self.finish = "length"

    async def pieces(self) -> AsyncIterator[tuple[str, list[Wire]]]:
        done, logprobs, given = False, [], 0
        news, engine = self.poller.watch(self.id), self.poller.engine
        try:
            while not done:
                got = await news.get()
                if isinstance(got, RequestError):
                    raise got
                if "error" in got:
                    raise RequestError(got["status"], f"the engine failed this request: {got['error']}")
                if self.request.echo and not self.text.tokens:  # before the first new token
                    text = prompt_text(self.text.tokenizer, self.prompt)
                    yield text, [[self.prompt_ids[0], None, None], *got.get("prompt_logprobs", ())]
                done = got["done"]
                logprobs += got.get("logprobs", ())
                piece = self.text.feed(got["tokens"], final=done)
                covered = self.text.covered() if self.request.logprobs is not None else 0
                if piece or covered > given:
                    yield piece, logprobs[given:covered]
                    given = covered
                if done:
                    self.summary = got["summary"]
                elif self.text.stopped:
                    self.summary = await _call(engine.cancel.remote(self.id)) or {}
                    done = True
        finally:
            self.poller.forget(self.id)
            if not done:  # the client left (the task was cancelled) or the engine failed
                engine.cancel.remote(self.id)
        self.finish = self.text.finish_reason(self.stops)


async def _collect(answer: Answer) -> list[tuple[str, list[Wire]]]:
    return [part async for part in answer.pieces()]


async def _body(http: Any) -> Any:
    """A request's JSON body, or a 400 that says why it is not one."""
    try:
        return json.loads(await http.body())
    except ValueError as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from e


async def _call(ref: Any) -> Any:
    """An engine call's result; an engine that is gone is a 503, one that failed a 500."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayActorError as e:
        raise RequestError(503, f"the engine is not running: {e}", None, "engine_unavailable") from e
    except ray.exceptions.RayTaskError as e:
        raise RequestError(500, f"the engine failed: {str(e).splitlines()[0]}") from e


def build_app(
    engine: Any,
    folder: str | Path,
    alias: str = DEFAULT_ALIAS,
    api_key: str | None = None,
    context: int = 0,
    chat_template: str | None = None,
    reasoning: bool = True,
):
    """The Serve application over ``engine`` (the scheduler's engine actor handle); ``context``: the
    engine's ``max_seq_len`` (0: ``EngineConfig``'s default); ``chat_template``: a Jinja template that
    replaces the tokenizer's own (None: the model's); ``reasoning``: a chat's thinking block goes to
    ``reasoning_content`` (``reasoning``), not into its content. ``/health`` and ``/metrics`` answer without
    the API key (probes and scrapers carry none); the ``/v1`` routes need it when one is set."""
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from ray import serve

    from splitspec.deploy.metrics import Metrics

    app = FastAPI(title="splitspec")

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    @serve.ingress(app)
    class OpenAIServer:
        def __init__(
            self, engine: Any, folder: str, alias: str, api_key: str | None, context: int, template, reasoning: bool
        ) -> None:
            from transformers import AutoConfig, AutoTokenizer

            self.engine, self.alias, self.api_key, self.reasoning = engine, alias, api_key, reasoning
            self.poller = Poller(engine)
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.end_ids = end_ids(self.tokenizer, eos_ids(AutoConfig.from_pretrained(folder)))
            if template is not None:
                self.tokenizer.chat_template = template
            self.context = context or EngineConfig().max_seq_len
            self.metrics = Metrics()

        def _error(self, route: str, e: RequestError) -> JSONResponse:
            self.metrics.requests.labels(route, str(e.status)).inc()
            headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)

        def _check_key(self, request: HttpRequest) -> None:
            given, wanted = request.headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()
            if self.api_key is not None and not secrets.compare_digest(given, wanted):
                raise RequestError(401, "Incorrect API key provided", None, "invalid_api_key")

        @app.get("/health")
        async def health(self) -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics(self) -> Response:
            load = await _call(self.engine.load.remote())
            return Response(self.metrics.render(load), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models(self, request: HttpRequest) -> Any:
            try:
                self._check_key(request)
            except RequestError as e:
                return self._error("models", e)
            card = {"id": self.alias, "object": "model", "created": 0, "owned_by": "splitspec"}
            return {"object": "list", "data": [card | {"max_model_len": self.context}]}  # vLLM's field

        @app.post("/tokenize")
        async def tokenize(self, request: HttpRequest) -> Any:
            try:
                self._check_key(request)
                ids = tokenize_ids(self.tokenizer, await _body(request), self.alias)
            except RequestError as e:
                return self._error("tokenize", e)
            return {"count": len(ids), "max_model_len": self.context, "tokens": ids}

        @app.post("/detokenize")
        async def detokenize(self, request: HttpRequest) -> Any:
            try:
                self._check_key(request)
                text = detokenize_text(self.tokenizer, await _body(request))
            except RequestError as e:
                return self._error("detokenize", e)
            return {"prompt": text}

        @app.post("/v1/completions")
        async def completions(self, request: HttpRequest) -> Any:
            return await self._complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: HttpRequest) -> Any:
            return await self._complete(request, chat=True)

        async def _open(self, http: HttpRequest, chat: bool) -> tuple[list[Answer], int]:
            """(the request's choices running on the engine, its prompts' tokens), or the RequestError to
            answer; the engine queues all the choices or none."""
            self._check_key(http)
            request = parse_request(await _body(http), chat, self.alias)
            offered = request.offered
            if offered is not None and not offered.forced and "tools" not in (self.tokenizer.chat_template or ""):
                message = (
                    "this model's chat template does not show the model tools: serve it with --chat-template "
                    "FILE (one that does), or send tool_choice 'required' or a function's name"
                )
                raise RequestError(400, message, "tools", "invalid_value")
            ids = [prompt_ids(self.tokenizer, p, offered, request.template) for p in request.prompts]
            limits = [fit_context(request, len(i), self.context) for i in ids]
            stops, choices = request.stops(self.end_ids), request.choices()
            asks = [(ids[p], limits[p], params) for p, params in choices]
            opened = await _call(self.engine.open.remote(asks, stops))
            if "error" in opened:
                code = "engine_busy" if opened["status"] == 429 else None
                raise RequestError(opened["status"], opened["error"], None, code, opened.get("retry_after_s", 0))
            answers = []
            for engine_id, (p, _) in zip(opened["ids"], choices, strict=True):
                text, reader = TextStream(self.tokenizer, request.stop), self._reader(request, ids[p])
                prompt = (request.prompts[p], ids[p])
                answers.append(Answer(self.poller, engine_id, request, text, stops, prompt, reader))
            return answers, sum(map(len, ids))

        def _reader(self, request: Request, ids: list[int]) -> AnswerReader | None:
            """A chat choice's reader of thinking (unless the server leaves it in the text) and calls (where
            the request offers tools); None: the text is the content."""
            if not request.chat or not (self.reasoning or request.offered):
                return None
            thinking = Thinking(open_block(self.tokenizer.decode(ids[-16:]))) if self.reasoning else None
            return AnswerReader(thinking, CallReader(request.offered) if request.offered else None)

        async def _complete(self, http: HttpRequest, chat: bool) -> Any:
            route = "chat" if chat else "completions"
            try:
                answers, n_prompt = await self._open(http, chat)
            except RequestError as e:
                return self._error(route, e)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if answers[0].request.stream:
                return StreamingResponse(self._stream(route, answers, rid, n_prompt), media_type="text/event-stream")
            tasks = [asyncio.create_task(_collect(a)) for a in answers]
            try:
                parts = await asyncio.gather(*tasks)
            except RequestError as e:
                return self._error(route, e)
            finally:
                for task in tasks:  # the others, when one failed: each cancels its engine request
                    task.cancel()
            blocks = LogprobBlocks(self.tokenizer) if answers[0].request.logprobs is not None else None
            choices = []
            for index, (answer, pieces) in enumerate(zip(answers, parts, strict=True)):
                text, entries = "".join(p for p, _ in pieces), [e for _, es in pieces for e in es]
                logprobs = blocks.block(chat, entries) if blocks else None
                thought, content, found = answer.reader.whole(text) if answer.reader else (None, text, [])
                choices.append(choice_body(chat, index, content, answer.finish, logprobs, found, thought))
            return response_body(chat, rid, self.alias, choices, self._done(route, answers, n_prompt))

        async def _stream(self, route: str, answers: list[Answer], rid: str, n_prompt: int) -> AsyncIterator[str]:
            """The choices' pieces as they come, each chunk naming its choice; one that fails ends them all."""
            request = answers[0].request
            chunks = Chunks(request.chat, rid, self.alias)
            blocks = LogprobBlocks(self.tokenizer) if request.logprobs is not None else None
            for event in chunks.start(len(answers)):
                yield event
            news: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, answer: Answer) -> None:
                try:
                    async for piece, entries in answer.pieces():
                        news.put_nowait((index, piece, entries))
                    news.put_nowait((index, None, None))
                except RequestError as e:
                    news.put_nowait(e)

            tasks = [asyncio.create_task(pump(i, a)) for i, a in enumerate(answers)]
            left = len(answers)
            readers = [a.reader for a in answers]
            try:
                while left:
                    got = await news.get()
                    if isinstance(got, RequestError):
                        self.metrics.requests.labels(route, str(got.status)).inc()
                        for event in chunks.error(got):
                            yield event
                        return
                    index, piece, entries = got
                    reader = readers[index]
                    logprobs = blocks.block(chunks.chat, entries) if blocks and piece is not None else None
                    if reader is None and piece is not None:
                        yield chunks.choice(piece, logprobs=logprobs, index=index)
                    elif reader is not None:  # thinking, content and calls as the text shows them
                        deltas = reader.feed(piece) if piece is not None else reader.close()
                        for delta in deltas or ([{}] if logprobs and entries else []):
                            yield chunks.delta(delta, index, logprobs)
                            logprobs = None
                    if piece is None:  # that choice is done
                        left -= 1
                        reason = "tool_calls" if reader is not None and reader.called else answers[index].finish
                        yield chunks.finish(index, reason)
            finally:
                for task in tasks:
                    task.cancel()
            use = self._done(route, answers, n_prompt)
            for event in chunks.end(use if request.include_usage else None):
                yield event

        def _done(self, route: str, answers: list[Answer], n_prompt: int) -> dict[str, Any]:
            """The usage block of a finished request, its figures recorded."""
            for answer in answers:
                self.metrics.record(len(answer.prompt_ids), len(answer.text.tokens), answer.summary)
            self.metrics.requests.labels(route, "200").inc()
            n = sum(len(a.text.tokens) for a in answers)
            thinking = [a.reader.thinking for a in answers if a.reader is not None and a.reader.thinking]
            reasoning = None if not thinking else sum(self._thought(a) for a in answers)
            return usage(n_prompt, n, [a.summary for a in answers], reasoning)

        def _thought(self, answer: Answer) -> int:
            """The answer's tokens its thinking took (0 without a block)."""
            thinking = answer.reader.thinking if answer.reader is not None else None
            if thinking is None or thinking.closing is None:
                return 0
            return thinking_tokens(self.tokenizer, answer.text.tokens, thinking.closing)

    return OpenAIServer.bind(engine, str(folder), alias, api_key, context, chat_template, reasoning)


def start_server(app: Any, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Run ``app`` on Ray Serve at ``host:port`` (loopback unless told otherwise); returns its URL.
    Needs a connected Ray cluster; ``ray.serve.shutdown`` ends it."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="splitspec", route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand and its flags (the CLI module stays small)."""
    from splitspec.deploy.args import (  # the CLI's own
        context_args,
        device_name,
        draft_args,
        placement_args,
        positive_int,
        residual_width,
    )

    p = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP endpoint (Ray Serve)")
    p.add_argument("--converted", required=True, help="a folder written by `splitspec convert`")
    p.add_argument("--bits", type=residual_width, default=8, help="residual width to serve: 6, 7 or 8")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=positive_int, default=8000)
    key = os.environ.get("SPLITSPEC_API_KEY")  # an environment variable keeps the key out of `ps`
    p.add_argument("--api-key", default=key, help="require `Authorization: Bearer KEY` on /v1 ($SPLITSPEC_API_KEY)")
    p.add_argument("--model-alias", default=DEFAULT_ALIAS, help="the model name clients ask for")
    context_args(p)
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file (default: the model's own)")
    p.add_argument(
        "--reasoning-format",
        choices=("auto", "none"),
        default="auto",
        help="auto: a chat's <think> block is returned as reasoning_content; none: it stays in the content",
    )
    p.add_argument("--device", type=device_name, default=EngineConfig.device, help="cpu, cuda or cuda:N")
    p.add_argument("--cuda-graphs", action="store_true", help="replay draft steps and checks as CUDA graphs (cuda)")
    placement_args(p)
    draft_args(p, sampling=False)  # a request samples as it asks
    batch = BatchConfig()
    p.add_argument("--max-batch", type=positive_int, default=batch.max_batch, help="requests sharing each check")
    p.add_argument("--max-queue", type=int, default=batch.max_queue, help="requests waiting; beyond: HTTP 429")
    mib = batch.kv_budget_bytes // 2**20
    p.add_argument("--kv-budget-mb", type=positive_int, default=mib, help="K/V memory for requests and kept prefixes")
    p.add_argument(
        "--prefill-per-round",
        type=positive_int,
        help="prompt tokens prefilled between two checks (default: one forward, EngineConfig.prefill_chunk)",
    )
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """Place the engine, serve it until Ctrl-C, then end Serve, the actors and the cluster this started."""
    from ray import serve

    from splitspec.deploy.args import CliError, checked, connected, engine_config, scheduler_config
    from splitspec.deploy.stopping import Stopping
    from splitspec.quantize.format import folder_spec
    from splitspec.scheduler.cluster import Deployment, SchedulerError
    from splitspec.scheduler.cpus import check_engine_cpus

    if not (Path(args.converted) / "manifest.json").is_file():
        raise CliError(f"{args.converted}: not a converted folder (no manifest.json); run `splitspec convert`")
    try:
        template = args.chat_template.read_text() if args.chat_template else None
    except OSError as e:
        raise CliError(f"--chat-template {args.chat_template}: cannot read it ({e.strerror})") from e
    with socket.socket() as probe:  # before any actor starts: Serve would retry a taken port for ever
        try:
            probe.bind((args.host, args.port))
        except OSError as e:
            raise CliError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); choose another --port") from e
    scheduler = scheduler_config(args)
    try:
        budget = args.kv_budget_mb * 2**20
        kept = min(BatchConfig.prefix_cache_bytes, budget // 4)
        batch = BatchConfig(args.max_batch, args.max_queue, budget, kept, prefill_per_round=args.prefill_per_round)
    except ValueError as e:
        raise CliError(str(e)) from e
    config = engine_config(args, batch=batch)
    checked(config.check_context, folder_spec(args.converted).max_positions)
    checked(check_engine_cpus, config.engine_cpus)
    cluster = connected(scheduler)
    # after ray.init, which gives SIGTERM to its own failure handler: a service manager's stop is a Ctrl-C
    with Stopping("serve", scheduler.stop_timeout_s) as stopping:
        try:
            with Deployment.start(args.converted, args.bits, config, scheduler) as deployment:
                served = (args.model_alias, args.api_key, config.max_seq_len, template, args.reasoning_format == "auto")
                app = build_app(deployment.engine, args.converted, *served)
                url = start_server(app, args.host, args.port)
                try:
                    print(f"serving '{args.model_alias}' at {url}/v1 (Ctrl-C to stop)", flush=True)
                    while True:
                        time.sleep(3600)
                finally:
                    stopping.arm()
                    serve.shutdown()
        except SchedulerError as e:  # the cluster cannot hold the actors, or one could not start
            raise CliError(str(e).splitlines()[0]) from e
        finally:
            stopping.arm()
            cluster.shutdown()
