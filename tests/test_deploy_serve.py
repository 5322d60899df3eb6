"""The OpenAI-compatible endpoint: the real Serve app on 127.0.0.1 over a real Deployment on
``converted_small``, called with the real ``openai`` client and raw HTTP (one cluster, deployment and app
for the module: Ray and Serve take seconds to start)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from ray import serve

from scheduler_support import interruptible, wait_gone
from splitspec.config import BatchConfig, EngineConfig, SamplingParams
from splitspec.deploy.openai_api import chat_ids
from splitspec.deploy.serve import build_app, start_server
from splitspec.deploy.stopping import descendants
from splitspec.scheduler.cluster import Deployment, SchedulerConfig, connect_or_start

KEY = "sk-test-key"
ALIAS = "smol"
QUESTION = "Name three rivers of Europe."
NEW_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm-to-the-group-twice", "gcs-gone"])
def test_cli_serves_until_stopped(converted_small, stop):
    """``splitspec serve`` on its own embedded cluster (first in the file: before the module's cluster):
    it prints its URL, answers the openai client with the key (from the environment), and stops in bounded
    time with nothing left behind, whatever else the signal reached:
    - Ctrl-C: the orderly teardown;
    - SIGTERM to its whole process group (systemd's control group, ``timeout``), Ray's GCS and raylet
      included, then Ctrl-C: the second signal stops it at once (Ray's calls would wait a minute for the
      GCS);
    - the GCS killed, then one SIGTERM: the teardown hangs on Ray, and ``--stop-timeout`` ends it."""
    port = _free_port()
    cli = [sys.executable, "-m", "splitspec.deploy.cli", "serve", "--converted", str(converted_small)]
    limit = 4 if stop == "gcs-gone" else 120  # the orderly teardown takes seconds, more on a busy machine
    cli += ["--port", str(port), "--model-alias", ALIAS, "--ray-address", "local", "--stop-timeout", str(limit)]
    env = {**os.environ, "SPLITSPEC_API_KEY": KEY}
    with interruptible():
        proc = subprocess.Popen(
            cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
    with proc:
        try:  # the with-block waits for the process: a failed step kills it first
            while (line := proc.stdout.readline()) and "serving" not in line:
                pass
            assert line.strip() == f"serving '{ALIAS}' at http://127.0.0.1:{port}/v1 (Ctrl-C to stop)", line
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
            assert client.completions.create(model=ALIAS, prompt="Hi", max_tokens=4).usage.completion_tokens >= 1
            keyless = openai.OpenAI(base_url=client.base_url, api_key="sk-none", max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError):
                keyless.models.list()
            started = {pid: _cmdline(pid) for pid in descendants(proc.pid)}
            assert any("gcs_server" in c for c in started.values()), started
            assert any("splitspec.cpu_actor.service" in c for c in started.values()), started
            t0 = time.monotonic()
            if stop == "ctrl-c":
                proc.send_signal(signal.SIGINT)
            elif stop == "sigterm-to-the-group-twice":
                os.killpg(proc.pid, signal.SIGTERM)
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
            else:
                os.kill(next(pid for pid, c in started.items() if "gcs_server" in c), signal.SIGKILL)
                time.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=120)[1]
            took = time.monotonic() - t0
        except BaseException:
            proc.kill()
            raise
    assert proc.returncode == 130, err[-2000:]
    assert "stopping (Ctrl-C again to stop at once)" in err, err[-2000:]
    if stop == "ctrl-c":
        assert "interrupted" in err and "; stopping at once" not in err, err[-2000:]
    else:
        ending = "interrupted while stopping" if stop == "sigterm-to-the-group-twice" else "still stopping after 4 s"
        assert f"{ending}; stopping at once" in err, err[-2000:]
        assert took < 30, took  # Ray alone waits 60 s for a lost GCS
    left = wait_gone(started, 10)  # a killed process takes a moment to end its threads
    assert not left, {pid: started[pid] for pid in left}
    assert not _listening(port)


@pytest.fixture(scope="module")
def server(converted_small):
    """(base URL, Deployment): the scheduler's engine behind the Serve app, on a free loopback port."""
    cluster = connect_or_start(SchedulerConfig(address="local", num_cpus=4))  # room for a second deployment
    try:
        config = EngineConfig(batch=BatchConfig(max_batch=2, max_queue=1))  # small: the tests fill it
        with Deployment.start(converted_small, 8, config) as deployment:
            url = start_server(build_app(deployment.engine, converted_small, ALIAS, KEY), port=_free_port())
            try:
                yield url, deployment
            finally:
                serve.shutdown()
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer_small(converted_small):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_small)


def _greedy(server, tokenizer, ids: list[int], n: int = NEW_TOKENS) -> str:
    """What the engine itself answers, decoded: the text the endpoint must give."""
    tokens, _ = server[1].generate(ids, n, tokenizer.eos_token_id)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _post(url: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_counts_what_a_request_sends(server, client, tokenizer_small):
    """vLLM's /tokenize and /detokenize: a chat's ids are those its completion prefills (its usage's
    prompt_tokens), a text's its tokenizer's, and back; the context is in the model card; bad input is a
    400, no key a 401."""
    url = server[0]
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    status, chat = _post(url + "/tokenize", {"model": ALIAS, "messages": messages})
    assert status == 200 and chat["tokens"] == chat_ids(tokenizer_small, messages), chat
    context = EngineConfig().max_seq_len
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == context
    reply = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]
    assert client.models.list().data[0].model_extra["max_model_len"] == context
    status, text = _post(url + "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert status == 200 and text["tokens"] == tokenizer_small("Hello world", add_special_tokens=False)["input_ids"]
    assert _post(url + "/detokenize", {"tokens": text["tokens"]}) == (200, {"prompt": "Hello world"})
    for route, body, expected in (
        ("/tokenize", {"prompt": "a", "messages": messages}, "send one of 'prompt'"),
        ("/tokenize", {"messages": []}, "at least one message"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist"),
        ("/detokenize", {"tokens": [len(tokenizer_small)]}, "this model's vocabulary"),
        ("/detokenize", b"{", "not valid JSON"),
    ):
        status, error = _post(url + route, body)
        assert status in (400, 404) and expected in error["error"]["message"], (route, error)
    assert _post(url + "/tokenize", {"prompt": "a"}, key=None)[0] == 401


def test_chat_and_completion_give_the_engine_greedy_text(server, client, tokenizer_small):
    messages = [{"role": "user", "content": QUESTION}]
    ids = chat_ids(tokenizer_small, messages)
    expected = _greedy(server, tokenizer_small, ids)
    chat = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert chat.object == "chat.completion" and chat.model == ALIAS
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    use = chat.usage
    assert (use.prompt_tokens, use.total_tokens) == (len(ids), len(ids) + use.completion_tokens)
    spec = use.model_extra["speculation"]
    assert spec["checks"] >= 1 and spec["tokens_per_check"] == pytest.approx(spec["mean_accepted_per_check"] + 1)

    stream = client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected and all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == use.completion_tokens

    prompt = "The capital of France is"
    expected = _greedy(server, tokenizer_small, tokenizer_small(prompt)["input_ids"], 8)
    done = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=8, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8
    streamed = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected

    stop = expected.strip().split()[1]  # a word inside the answer: the text ends before it
    cut = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_logprobs_come_with_the_text_streamed_or_not(client, tokenizer_small):
    messages = [{"role": "user", "content": QUESTION}]
    ask = {"model": ALIAS, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": True}
    chat = client.chat.completions.create(**ask, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(chat.choices[0].message.content)
    for entry in content:  # greedy: each token is its position's likeliest
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    streamed = [e for c in client.chat.completions.create(**ask, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)

    prompt = "The capital of France is"
    echoed = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    choice, n_prompt = echoed.choices[0], len(tokenizer_small(prompt)["input_ids"])
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == n_prompt + echoed.usage.completion_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(prompt)
    ids = tokenizer_small(prompt)["input_ids"]  # as lm-evaluation-harness sends it: token ids, a batch of one
    by_ids = client.completions.create(model=ALIAS, prompt=[ids], max_tokens=4, temperature=0, logprobs=1, echo=True)
    assert by_ids.choices[0].text == choice.text
    assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [ALIAS]
    with urllib.request.urlopen(server[0] + "/health", timeout=30) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    client.completions.create(model=ALIAS, prompt="Hello", max_tokens=4, temperature=0)
    with urllib.request.urlopen(server[0] + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'splitspec_requests_total{route="completions",status="200"}' in text
    for name in (
        "splitspec_completion_tokens_total",
        "splitspec_cached_prompt_tokens_total",
        "splitspec_time_to_first_token_seconds_count",
        "splitspec_prefill_tok_s",
        "splitspec_decode_tok_s",
        "splitspec_tokens_per_check",
        "splitspec_acceptance_rate",
        "splitspec_residual_wait_ms",
        "splitspec_queue_depth 0.0",
        "splitspec_live_sequences 0.0",
        "splitspec_kv_bytes",
        "splitspec_actor_restarts 0.0",
    ):
        assert name in text, name


def test_concurrent_requests_each_get_their_own_text(server, client, tokenizer_small):
    prompts = ["The capital of France is", "Water boils at", "My favourite colour is"]
    alone = [_greedy(server, tokenizer_small, tokenizer_small(p)["input_ids"], 8) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        asks = [
            pool.submit(client.completions.create, model=ALIAS, prompt=p, max_tokens=8, temperature=0) for p in prompts
        ]
        assert [a.result().choices[0].text for a in asks] == alone


def test_a_seed_makes_sampling_repeatable(client):
    ask = {"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95}
    first, again = (client.completions.create(**ask, seed=7).choices[0].text for _ in range(2))
    assert first == again


def test_n_choices_and_a_batch_of_prompts_share_the_engine(server, client, tokenizer_small):
    """A batch of prompts and n choices each: OpenAI's choices in order, streamed or not, each the text the
    engine gives that prompt alone; seeded choices differ from each other; more than the engine can hold
    at once is refused whole."""
    prompts = ["The capital of France is", "Once upon a time"]
    ids = [tokenizer_small(p)["input_ids"] for p in prompts]
    expected = [_greedy(server, tokenizer_small, i, 6) for i in ids]
    done = client.completions.create(model=ALIAS, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in done.choices] == [0, 1] and [c.text for c in done.choices] == expected
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids[0]) + len(ids[1]), 12)
    assert done.usage.model_extra["speculation"]["checks"] >= 2
    stream = client.completions.create(model=ALIAS, prompt=prompts[0], max_tokens=6, temperature=0, n=2, stream=True)
    texts, finished = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert texts == [expected[0]] * 2 and finished == ["length", "length"]
    messages = [{"role": "user", "content": QUESTION}]
    sampled = client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=8, temperature=1.0, n=3, seed=5
    )  # fmt: skip
    answers = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len(set(answers)) > 1
    status, answer = _post(server[0] + "/v1/completions", {"model": ALIAS, "prompt": "Hi", "max_tokens": 2, "n": 4})
    assert status == 400 and "4 sequences at once; this engine holds at most 3" in answer["error"]["message"]
    assert _settle(server)["live"] == 0  # nothing of the refused request was queued


def test_end_tokens_stop_token_ids_and_ignore_eos(server, client, tokenizer_small):
    prompt = "The capital of France is"
    plain, _ = server[1].generate(tokenizer_small(prompt)["input_ids"], 8)
    ask = {"model": ALIAS, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    cut = client.completions.create(**ask, extra_body={"stop_token_ids": [plain[2]]})
    first = plain.index(plain[2])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == first + 1
    assert cut.choices[0].text == tokenizer_small.decode(plain[: first + 1], skip_special_tokens=True)
    eos = {"logit_bias": {str(tokenizer_small.eos_token_id): 100}}  # the end-of-sequence token comes first
    ended = client.completions.create(**ask, **eos)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    going = client.completions.create(**ask, **eos, extra_body={"ignore_eos": True})
    assert going.choices[0].finish_reason == "length" and going.usage.completion_tokens == 8


def test_response_format_gives_json_that_follows_the_schema(server, client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": QUESTION}]
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=24, response_format=fmt)
    doc = json.loads(reply.choices[0].message.content)
    assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and reply.choices[0].finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    status, answer = _post(
        server[0] + "/v1/chat/completions", {"model": ALIAS, "messages": messages, "response_format": bad}
    )
    assert status == 400 and answer["error"]["message"].startswith("json_schema: ")
    # vLLM's choice and llama.cpp's GBNF grammar, through the same masks
    reply = client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert reply.choices[0].message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"
    status, answer = _post(
        server[0] + "/v1/chat/completions", {"model": ALIAS, "messages": messages, "grammar": "root ::= ("}
    )
    assert status == 400 and answer["error"]["message"].startswith("grammar: ")


def test_a_thinking_block_is_the_reasoning_content(server, client, tokenizer_small):
    """A prefill that opens a thinking block (as R1's distills' templates do): the answer, which does not
    close it, is all thinking, whole or streamed, and is the engine's own text."""
    messages = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "<think>\n"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    want = _greedy(server, tokenizer_small, chat_ids(tokenizer_small, messages, None, options))
    assert want and "</think>" not in want
    ask = {"model": ALIAS, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": options}
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == want and message.content is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens  # all thinking
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert "".join(d for d in deltas if d) == want and sum(bool(d) for d in deltas) > 1


def test_tool_calls_forced_or_refused_where_the_template_hides_tools(server, client):
    weather = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    tools = [{"type": "function", "function": weather}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = {"model": ALIAS, "messages": messages, "max_tokens": 96, "tools": tools, "temperature": 0}  # ≥ 1 char a token
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(**ask, tool_choice=choice)
    assert reply.choices[0].message.tool_calls, reply.choices[0]
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    chunks = list(client.chat.completions.create(**ask, tool_choice="required", stream=True))
    deltas = [d.tool_calls[0] for c in chunks for d in [c.choices[0].delta] if c.choices and d.tool_calls]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2 and all(d.index == 0 and not d.id for d in deltas[1:])  # arguments as they come
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    back = [*messages, reply.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "sunny"}]
    assert client.chat.completions.create(model=ALIAS, messages=back, max_tokens=4).choices[0].message.content
    status, answer = _post(server[0] + "/v1/chat/completions", ask)  # "auto": the model must see the tools
    assert status == 400 and answer["error"]["param"] == "tools" and "--chat-template" in answer["error"]["message"]


def test_penalties_and_logit_bias_shape_the_text_as_the_engine_does(server, client, tokenizer_small):
    prompt = "The capital of France is"
    ids = tokenizer_small(prompt)["input_ids"]
    plain, _ = server[1].generate(ids, 12, tokenizer_small.eos_token_id)
    shaping = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.2}
    params = SamplingParams(logit_bias={plain[0]: -100.0}, **shaping)
    shaped, _ = server[1].generate(ids, 12, tokenizer_small.eos_token_id, params)
    assert plain[0] not in shaped and shaped != plain
    bias = {str(plain[0]): -100}
    done = client.completions.create(
        model=ALIAS,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logit_bias=bias,
        extra_body={"repetition_penalty": 1.2},
        frequency_penalty=0.8,
        presence_penalty=0.4,
    )
    assert done.choices[0].text == tokenizer_small.decode(shaped, skip_special_tokens=True)
    status, answer = _post(
        server[0] + "/v1/completions", {"model": ALIAS, "prompt": prompt, "logit_bias": {"999999": 5}}
    )
    assert status == 400 and "vocabulary" in answer["error"]["message"]


BAD = [  # (body, status, param or None, code)
    (b"{not json", 400, None, "invalid_json"),
    ({"model": ALIAS}, 400, "messages", "missing_field"),
    ({"model": ALIAS, "messages": "hi"}, 400, "messages", "invalid_type"),
    ({"model": ALIAS, "messages": [{"role": "user"}]}, 400, "messages[0]", "invalid_value"),
    ({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", None),
    ({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, 400, "max_tokens", None),
    ({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens", None),
    ({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature", None),
    ({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p", None),
    ({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "min_p": 2}, 400, "min_p", "invalid_value"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", None),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    url = server[0] + "/v1/chat/completions"
    for body, status, param, code in BAD:
        got, answer = _post(url, body)
        assert got == status, (body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param and (code is None or error["code"] == code), (body, error)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=ALIAS, prompt="word " * 3000, max_tokens=2)
    wrong = openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert _post(url, {"model": ALIAS, "messages": []}, key=None)[0] == 401  # no key at all
    ok = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].message.content is not None and ok.usage.completion_tokens >= 1


def _load(server) -> dict[str, int]:
    import ray

    return ray.get(server[1].engine.load.remote())


def _settle(server, timeout_s: float = 30.0) -> dict[str, int]:
    """The engine's load once no request is live or waiting (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (load := _load(server))["live"] + load["waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return load


def test_a_full_engine_answers_429_and_clients_that_leave_free_their_slots(server, client):
    """Two requests fill the batch and one the queue (the fixture's BatchConfig): the next is refused with
    429 and a Retry-After; the three clients then leave mid-stream, which frees the batch and its K/V long
    before their answers would have ended."""
    long = {"model": ALIAS, "prompt": "Tell me a very long story.", "max_tokens": 1500, "temperature": 0}
    streams = []
    try:
        for _ in range(3):  # each returns once its request is open on the engine (the response's headers)
            streams.append(client.completions.create(**long, stream=True))
        deadline = time.monotonic() + 60
        while (load := _load(server))["live"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (load["live"], load["waiting"]) == (2, 1), load
        status, answer = _post(server[0] + "/v1/completions", long | {"max_tokens": 4})
        assert status == 429 and answer["error"]["code"] == "engine_busy", answer
        with pytest.raises(openai.RateLimitError):
            client.completions.create(**long | {"max_tokens": 4})
    finally:
        for stream in streams:
            stream.close()
    load = _settle(server)
    assert (load["live"], load["waiting"]) == (0, 0), load
    assert load["kv_bytes"] == load["prefix_bytes"]  # only kept prefixes hold K/V now
    assert client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_a_second_chat_turn_reuses_the_first(server, client, tokenizer_small):
    first = [{"role": "user", "content": "Name a river in France."}]
    answer = client.chat.completions.create(model=ALIAS, messages=first, max_tokens=12, temperature=0)
    turn = [*first, {"role": "assistant", "content": answer.choices[0].message.content}]
    turn.append({"role": "user", "content": "And one in Spain?"})
    second = client.chat.completions.create(model=ALIAS, messages=turn, max_tokens=12, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(chat_ids(tokenizer_small, first)), (cached, second.usage)
    assert second.choices[0].message.content == _greedy(server, tokenizer_small, chat_ids(tokenizer_small, turn), 12)


def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(server, converted_small):
    """A second app over an engine whose CPU actor may not restart: once its stream has begun, killing
    that actor cannot change the HTTP status any more, so the failure arrives as an SSE error event, which
    OpenAI's client raises; the module's own app keeps serving."""
    no_restarts = SchedulerConfig(max_restarts=0, start_timeout_s=60)
    with Deployment.start(converted_small, 8, EngineConfig(), no_restarts) as fragile:
        app = build_app(fragile.engine, converted_small, ALIAS, KEY)
        serve.run(app, name="fragile", route_prefix="/fragile", blocking=False)
        try:
            fragile_client = openai.OpenAI(base_url=server[0] + "/fragile/v1", api_key=KEY, max_retries=0, timeout=120)
            long = {"model": ALIAS, "prompt": "Tell me a very long story.", "max_tokens": 1500, "temperature": 0}
            chunks = iter(fragile_client.completions.create(**long, stream=True))
            assert next(chunks).choices[0].text is not None  # the stream has begun: 200 and its first event
            os.kill(fragile.info()["cpu_actors"][0]["pid"], signal.SIGKILL)
            with pytest.raises(openai.APIError, match="the engine failed this request"):
                for _ in chunks:
                    pass
        finally:
            serve.delete("fragile")
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
