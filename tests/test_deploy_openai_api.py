"""The schema's text handling against the tokenizer's own decode of the whole answer: pieces handed out
as tokens arrive join into the whole answer's text, cut before a stop string."""

from __future__ import annotations

import json
import random

import pytest

from splitspec.deploy.openai_api import (
    JSON_OBJECT,
    LogprobBlocks,
    RequestError,
    TextStream,
    parse_request,
    prompt_ids,
    prompt_text,
    tokenize_ids,
    usage,
)
from splitspec.models.spec import end_ids

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
    assert stream.finish_reason(()) == "stop"


def test_a_held_stop_prefix_is_released_when_the_stop_does_not_follow(tokenizer):
    """'Rhi' could start the stop string 'Rhino' until the next token says otherwise."""
    text = TEXTS[0]
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, ["Rhino"])
    pieces = [stream.feed([t]) for t in ids] + [stream.feed([], final=True)]
    assert not stream.stopped and "".join(pieces) == text
    assert stream.finish_reason(()) == "length"


def test_logprobs_requests_parse_as_openai_defines_them():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(chat, True, "m").params.logprobs is None
    asked = parse_request(chat | {"logprobs": True, "top_logprobs": 3}, True, "m")
    assert (asked.logprobs, asked.params.logprobs, asked.params.prompt_logprobs) == (3, 3, None)
    assert parse_request(chat | {"logprobs": True}, True, "m").params.logprobs == 0
    done = {"model": "m", "prompt": "hi"}
    echoed = parse_request(done | {"logprobs": 2, "echo": True}, False, "m")
    assert (echoed.echo, echoed.params.logprobs, echoed.params.prompt_logprobs) == (True, 2, 2)
    assert parse_request(done | {"echo": True}, False, "m").params.prompt_logprobs is None  # the text alone
    for body, chat_route, param in (
        (chat | {"top_logprobs": 2}, True, "top_logprobs"),  # without logprobs: true
        (chat | {"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        (chat | {"logprobs": 1}, True, "logprobs"),  # a chat's is a bool
        (done | {"logprobs": -1}, False, "logprobs"),
        (done | {"logprobs": True}, False, "logprobs"),  # a completion's is a number
    ):
        with pytest.raises(RequestError) as e:
            parse_request(body, chat_route, "m")
        assert (e.value.status, e.value.param) == (400, param), body


def test_logprob_blocks_follow_openais_shapes(tokenizer):
    ids = tokenizer("The Danube flows east")["input_ids"]
    entries = [[t, -0.5 * i, [[t, -0.25], [ids[0], -1.0]]] for i, t in enumerate(ids)]
    blocks = LogprobBlocks(tokenizer)
    chat = blocks.chat(entries)
    assert "".join(e["token"] for e in chat["content"]) == tokenizer.decode(ids)
    first = chat["content"][1]
    assert first["logprob"] == -0.5 and bytes(first["bytes"]).decode() == first["token"]
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.25, -1.0]
    done = blocks.completion([[ids[0], None, None], *entries[1:]])
    assert done["token_logprobs"][:2] == [None, -0.5] and done["top_logprobs"][0] is None
    assert done["text_offset"] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    more = blocks.completion(entries[:1])  # a stream's next block goes on from where the last one ended
    assert more["text_offset"] == [len(tokenizer.decode(ids))]


def test_only_the_tokens_before_a_stop_string_keep_their_logprobs(tokenizer):
    text = TEXTS[0]
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, ["Rhine and"])
    for t in ids:
        stream.feed([t])
        if stream.stopped:
            break
    kept = stream.covered()
    assert tokenizer.decode(ids[:kept]).startswith(text[: text.index("Rhine and")])
    assert not tokenizer.decode(ids[: kept - 1]).startswith(text[: text.index("Rhine and")])
    open_stream = TextStream(tokenizer, [])
    open_stream.feed(ids, final=True)
    assert open_stream.covered() == len(ids)


def test_fields_this_server_would_not_honour_are_refused_not_ignored():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "auto"}
    assert parse_request(chat | neutral | {"response_format": {"type": "text"}}, True, "m").params.top_k == 0
    assert parse_request(chat | {"parallel_tool_calls": True}, True, "m").offered is None
    for name, value in (
        ("best_of", 2),
        ("functions", [{"name": "f"}]),
        ("parallel_tool_calls", False),  # the call reader would still read several calls from an answer
    ):
        with pytest.raises(RequestError, match=f"'{name}' is not supported") as e:
            parse_request(chat | {name: value}, True, "m")
        assert (e.value.status, e.value.param, e.value.code) == (400, name, "unsupported_parameter")
    assert parse_request(chat | {"top_k": 5}, True, "m").params.top_k == 5
    assert parse_request(chat | {"top_k": -1}, True, "m").params.top_k == 0  # vLLM's "no cut"
    with pytest.raises(RequestError) as e:
        parse_request(chat | {"top_k": -2}, True, "m")
    assert e.value.param == "top_k"


def test_tokenize_refuses_a_prompt_that_is_not_a_text(tokenizer):
    assert tokenize_ids(tokenizer, {"prompt": "Hi there"}, "m") == tokenizer("Hi there")["input_ids"]
    for body in ({"prompt": None}, {"prompt": 5}):
        with pytest.raises(RequestError) as e:
            tokenize_ids(tokenizer, body, "m")
        assert (e.value.status, e.value.param) == (400, "prompt")


def test_penalties_bias_and_min_p_are_parsed_and_checked():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    off = parse_request(chat, True, "m").params
    assert not off.shaped and off.min_p == 0 and off.repetition_penalty == 1 and off.logit_bias == {}
    asked = {
        "frequency_penalty": 0.5,
        "presence_penalty": -1,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "logit_bias": {"50256": -100, "7": 2.5},
    }
    params = parse_request(chat | asked, True, "m").params
    assert params.shaped and (params.frequency_penalty, params.presence_penalty) == (0.5, -1.0)
    assert (params.repetition_penalty, params.min_p, params.logit_bias) == (1.1, 0.05, {50256: -100.0, 7: 2.5})
    for name, value in (
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("logit_bias", {"50256": -101}),
        ("logit_bias", {"a token": 1}),
        ("logit_bias", {"-3": 1}),
        ("logit_bias", {"3": "high"}),
    ):
        with pytest.raises(RequestError) as e:
            parse_request(chat | {name: value}, True, "m")
        assert (e.value.status, e.value.param, e.value.code) == (400, name, "invalid_value"), str(e.value)
    with pytest.raises(RequestError, match="'logit_bias' must be dict") as e:
        parse_request(chat | {"logit_bias": [1]}, True, "m")


def test_a_completion_prompt_may_be_token_ids_or_a_batch(tokenizer):
    done = {"model": "m", "max_tokens": 2}
    ids = tokenizer("The Danube flows east")["input_ids"]
    for prompt in (ids, [ids]):
        request = parse_request(done | {"prompt": prompt}, False, "m")
        assert len(request.prompts) == 1 and not request.chat
        assert prompt_ids(tokenizer, request.prompts[0]) == ids
        assert prompt_text(tokenizer, request.prompts[0]) == tokenizer.decode(ids)
    text = parse_request(done | {"prompt": ["The Danube"]}, False, "m").prompts[0]
    assert prompt_ids(tokenizer, text) == tokenizer("The Danube")["input_ids"]
    assert prompt_text(tokenizer, text) == "The Danube"
    batch = parse_request(done | {"prompt": ["a", ids, "b"]}, False, "m")
    assert batch.prompts == ["a", tuple(ids), "b"]
    for bad in ([], [1, -2], [1, True], [[]], [1, "a"], ["a", 3], [["a"]]):
        with pytest.raises(RequestError, match="a list of those") as e:
            parse_request(done | {"prompt": bad}, False, "m")
        assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="vocabulary") as e:
        prompt_ids(tokenizer, parse_request(done | {"prompt": [len(tokenizer)]}, False, "m").prompts[0])
    assert (e.value.status, e.value.param) == (400, "prompt")


def test_a_chat_s_template_options_reach_its_template(tokenizer):
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) and ``continue_final_message``."""
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\\nassistant: ' }}{% if enable_thinking %}<think>{% endif %}{% endif %}"
    )
    user = {"role": "user", "content": "Why?"}
    chat = {"model": "m", "messages": [user]}

    def text(body: dict) -> str:
        request = parse_request(chat | body, True, "m")
        return tokenizer.decode(prompt_ids(tokenizer, request.prompts[0], None, request.template))

    assert text({}) == "user: Why?\nassistant: "
    assert text({"chat_template_kwargs": {"enable_thinking": True}}).endswith("assistant: <think>")
    prefill = {"messages": [user, {"role": "assistant", "content": "Because"}], "continue_final_message": True}
    assert text(prefill) == "user: Why?\nassistant: Because"
    for body, param in (
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),  # the server's
        ({"chat_template_kwargs": {"return_tensors": "pt"}}, "chat_template_kwargs"),  # the ids' form
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
        (prefill | {"add_generation_prompt": True}, "continue_final_message"),
    ):
        with pytest.raises(RequestError) as e:
            parse_request(chat | body, True, "m")
        assert (e.value.status, e.value.param) == (400, param), body
    # a developer message is the system's; a template's own refusal (raise_exception) is the request's error
    developer = {"messages": [{"role": "developer", "content": "Be brief."}, user]}
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') if messages[0].role == 'system' }}"
    request = parse_request(chat | developer, True, "m")
    assert request.prompts[0][0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(RequestError, match="roles must alternate") as e:
        prompt_ids(tokenizer, request.prompts[0], None, request.template)
    assert (e.value.status, e.value.param) == (400, "messages")


def test_n_choices_each_a_prompt_s_with_their_own_seeds():
    done = {"model": "m", "prompt": ["a", "b"], "n": 3, "temperature": 0.8}
    request = parse_request(done | {"seed": 10}, False, "m")
    assert [(p, params.seed) for p, params in request.choices()] == [
        (0, 10), (0, 11), (0, 12), (1, 10), (1, 11), (1, 12)
    ]  # fmt: skip
    assert all(params.temperature == 0.8 for _, params in request.choices())
    unseeded = parse_request(done, False, "m").choices()
    assert len(unseeded) == 6 and all(params.seed is None for _, params in unseeded)
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, True, "m")
    assert chat.chat and len(chat.choices()) == 2
    for n in (0, 129, "2"):
        with pytest.raises(RequestError) as e:
            parse_request(done | {"n": n}, False, "m")
        assert (e.value.status, e.value.param) == (400, "n")
    # every choice's seed is one torch's generator takes
    assert parse_request(done | {"seed": 2**64 - 3}, False, "m").choices()[-1][1].seed == 2**64 - 1
    for seed in (2**64 - 2, -(2**63) - 1):
        with pytest.raises(RequestError) as e:
            parse_request(done | {"seed": seed}, False, "m")
        assert (e.value.status, e.value.param) == (400, "seed")


def test_response_format_becomes_the_schema_the_text_follows():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt, expected in (
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, JSON_OBJECT),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}, json.dumps(schema)),
    ):
        params = parse_request(chat | ({"response_format": fmt} if fmt else {}), True, "m").params
        assert params.json_schema == expected and params.shaped == (expected is not None)
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": "{}"}}):
        with pytest.raises(RequestError, match="'response_format' must be") as e:
            parse_request(chat | {"response_format": bad}, True, "m")
        assert (e.value.status, e.value.param) == (400, "response_format")


def test_grammars_regexes_and_choices_by_llama_cpp_s_and_vllm_s_fields():
    """llama.cpp's ``grammar``, vLLM's ``guided_*`` and ``structured_outputs``: one language for the text, a
    choice as the grammar of its texts; two at once, or a malformed one, is a 400 naming the field; a forced
    tool call's schema replaces them."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    gbnf = 'root ::= "a" | "b"'
    for extra, expected in (
        ({"grammar": gbnf}, ("grammar", gbnf)),
        ({"guided_grammar": gbnf}, ("grammar", gbnf)),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"guided_choice": ["yes", 'no "way"', "ça"]}, ("grammar", 'root ::= "yes" | "no \\"way\\"" | "ça"')),
        ({"structured_outputs": {"choice": ["x"]}}, ("grammar", 'root ::= "x"')),
        ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
        ({"structured_outputs": {"json": {"type": "object"}}}, ("json_schema", '{"type": "object"}')),
    ):
        params = parse_request(chat | extra, True, "m").params
        assert params.constraint == expected and params.shaped, extra
    for extra, param in (
        ({"grammar": gbnf, "guided_regex": "a"}, "grammar"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
        ({"structured_outputs": {"regex": ["a"]}}, "structured_outputs.regex"),
    ):
        with pytest.raises(RequestError) as e:
            parse_request(chat | extra, True, "m")
        assert (e.value.status, e.value.param) == (400, param), (extra, e.value)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    forced = parse_request(chat | {"grammar": gbnf, "tools": [tool], "tool_choice": "required"}, True, "m").params
    assert forced.constraint[0] == "json_schema" and forced.grammar is None


def test_min_tokens_is_vllm_s_and_fits_the_answer():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(chat | {"min_tokens": 4}, True, "m").params.min_tokens == 4
    for extra in ({"min_tokens": 5, "max_tokens": 4}, {"min_tokens": -1}, {"min_tokens": 2, "guided_regex": "a"}):
        with pytest.raises(RequestError) as e:
            parse_request(chat | extra, True, "m")
        assert (e.value.status, e.value.param) == (400, "min_tokens"), (extra, e.value)


def test_the_tokens_that_end_a_text(tokenizer):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ends = end_ids(tokenizer, (7, 9))
    assert ends == {7, 9, tokenizer.eos_token_id}
    assert parse_request(chat, True, "m").stops(ends) == sorted(ends)
    asked = parse_request(chat | {"stop_token_ids": [5, 9]}, True, "m")
    assert asked.stops(ends) == sorted(ends | {5})
    assert parse_request(chat | {"stop_token_ids": [5], "ignore_eos": True}, True, "m").stops(ends) == [5]
    assert parse_request(chat | {"ignore_eos": True}, True, "m").stops(ends) == []
    for bad in ([-1], ["5"], [True], list(range(65))):
        with pytest.raises(RequestError) as e:
            parse_request(chat | {"stop_token_ids": bad}, True, "m")
        assert (e.value.status, e.value.param) == (400, "stop_token_ids")
    stream = TextStream(tokenizer, [])
    stream.feed([42, 9], final=True)
    assert stream.finish_reason({9}) == "stop" and stream.finish_reason({42}) == "length"


def test_usage_sums_the_choices():
    one = {"checks": 4, "drafted": 3.0, "accepted": 1.0, "tokens_per_check": 2.0, "reused_prompt_tokens": 5}
    two = {"checks": 12, "drafted": 7.0, "accepted": 3.0, "tokens_per_check": 4.0, "shape": "tree16"}
    use = usage(10, 30, [one | {"shape": "tree16"}, two])
    assert (use["prompt_tokens"], use["completion_tokens"], use["total_tokens"]) == (10, 30, 40)
    assert use["prompt_tokens_details"] == {"cached_tokens": 5}
    spec = use["speculation"]
    assert (spec["checks"], spec["draft_tokens"], spec["accepted_tokens"]) == (16, 4 * 3 + 12 * 7, 4 + 36)
    assert spec["mean_accepted_per_check"] == pytest.approx(40 / 16)
    assert spec["tokens_per_check"] == pytest.approx((8 + 48) / 16) and spec["draft_shape"] == "tree16"
    assert usage(3, 0, [{}])["speculation"]["checks"] == 0
