"""Structured output: a JSON schema's mask along a drafted path, and texts that follow the schema whatever
drafts them (greedy and sampled, alone and through a tree, in shared checks)."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar

from splitspec.config import EngineConfig, SamplingParams, SpecConfig
from splitspec.deploy.openai_api import JSON_OBJECT
from splitspec.gpu_actor.batcher import generate_many
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.grammar import Grammars

FLAG = json.dumps(
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def grammars(converted_small, engine):
    return Grammars(converted_small, engine.model.spec.vocab, engine.model.spec.eos_ids)


def _reference(grammars: Grammars, tokens: list[int]) -> set[int]:
    """xgrammar's own mask after ``tokens``, from a fresh matcher that accepted them one by one."""
    matcher = xgrammar.GrammarMatcher(grammars.compiled("json_schema", FLAG))
    assert all(matcher.accept_token(t) for t in tokens)
    bitmask = xgrammar.allocate_token_bitmask(1, grammars.vocab)
    matcher.fill_next_token_bitmask(bitmask)
    return {t for t in range(grammars.vocab) if bitmask[0, t // 32] >> (t % 32) & 1}


def test_the_mask_after_a_path_leaves_the_matcher_where_it_was(grammars, tokenizer):
    text = tokenizer('{"ok": true, "n": 3}')["input_ids"]  # as json.dumps writes it
    matcher = grammars.matcher("json_schema", FLAG)
    start = matcher.allowed()
    assert {tokenizer.decode([t])[0] for t in start.nonzero().flatten().tolist()} == {"{"}
    for cut in (1, 3, len(text)):
        got = matcher.allowed(text[:cut])
        assert set(got.nonzero().flatten().tolist()) == _reference(grammars, text[:cut])
        assert matcher.allowed().equal(start)  # the path was rolled back
    matcher.accept(text[:2])
    assert set(matcher.allowed(text[2:4]).nonzero().flatten().tolist()) == _reference(grammars, text[:4])
    assert matcher.allowed(tokenizer("[")["input_ids"]) is None  # a path the schema refuses
    done = matcher.allowed(text[2:])
    assert set(done.nonzero().flatten().tolist()) <= set(grammars.config_eos) | {tokenizer.eos_token_id}
    with pytest.raises(ValueError, match="breaks the grammar"):
        matcher.accept(tokenizer("]")["input_ids"])
    with pytest.raises(ValueError, match="json_schema: "):
        grammars.compiled("json_schema", '{"type": 5}')


def _with(engine: SplitEngine, **spec) -> SplitEngine:
    config = EngineConfig(prefill="split", spec=SpecConfig(**spec))
    return SplitEngine(engine.model, engine.residual, config, tree_stats=engine.tree_stats, ngram=engine.ngram)


def test_texts_follow_the_schema_whatever_drafts_them(engine, prompts, tokenizer, grammars):
    eos = tokenizer.eos_token_id
    alone, tree = _with(engine, mode="off"), _with(engine, mode="tree", draft_max=16)
    greedy = SamplingParams(json_schema=FLAG)
    texts = {}
    for name, eng in (("alone", alone), ("tree", tree)):
        tokens, _ = eng.generate(prompts[0], 24, eos, greedy)
        assert tokens[-1] == eos, tokenizer.decode(tokens)  # the document ends the text
        texts[name] = tokenizer.decode(tokens, skip_special_tokens=True)
        doc = json.loads(texts[name])
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and 0 <= doc["n"] <= 9
    assert texts["tree"] == texts["alone"]
    sampled = [SamplingParams(temperature=1.0, seed=s, json_schema=JSON_OBJECT) for s in range(3)]
    for tokens, _ in generate_many(tree, prompts, 48, eos, sampled):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        # every token, on whichever accepted tree path, one that xgrammar's own matcher takes in turn
        matcher = xgrammar.GrammarMatcher(grammars.compiled("json_schema", JSON_OBJECT))
        assert all(matcher.accept_token(t) for t in tokens), text
        if tokens[-1] == eos:  # a complete object (a random model may not close it in 48 tokens)
            assert isinstance(json.loads(text), dict)
    with pytest.raises(ValueError, match="json_schema"):
        alone.generate(prompts[0], 4, eos, SamplingParams(json_schema="{not json"))


def test_a_grammar_or_regex_holds_the_text_whatever_drafts_it(engine, prompts, tokenizer):
    """An EBNF grammar (llama.cpp's GBNF form) and a regular expression hold the text as a schema does: the
    whole text in their language and then the end, the same through a tree as alone; one that does not
    compile is refused naming its kind."""
    eos = tokenizer.eos_token_id
    alone, tree = _with(engine, mode="off"), _with(engine, mode="tree", draft_max=16)
    answer = 'root ::= ("yes" | "no") ", because " [a-z]+ "."'
    for params, language in (
        (SamplingParams(grammar=answer), r"(yes|no), because [a-z]+\."),
        (SamplingParams(regex="[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
    ):
        texts = {}
        for name, eng in (("alone", alone), ("tree", tree)):
            tokens, _ = eng.generate(prompts[0], 24, eos, params)
            texts[name] = tokenizer.decode(tokens, skip_special_tokens=True)
            assert tokens[-1] == eos and re.fullmatch(language, texts[name]), texts[name]
        assert texts["tree"] == texts["alone"]
    for params, kind in ((SamplingParams(grammar="root ::= ("), "grammar"), (SamplingParams(regex="[a-"), "regex")):
        with pytest.raises(ValueError, match=f"{kind}: "):
            alone.generate(prompts[0], 4, eos, params)
    with pytest.raises(ValueError, match="json_schema and regex: a text follows one of"):
        SamplingParams(json_schema=JSON_OBJECT, regex="a")
