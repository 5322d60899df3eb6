"""Continuous batching over a real engine and CPU actor process: requests that join mid-way, run on the
loop's thread, are cancelled, expire, overflow the admission limits or reuse a kept prefix each get the
text the engine gives them alone (up to near-ties, as in ``test_gpu_actor_speculative``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from splitspec.config import BatchConfig, EngineConfig, SamplingParams, SpecConfig
from splitspec.gpu_actor.batcher import Batcher, EngineBusy, failure_status
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.prefix_cache import common_prefix
from splitspec.scheduler.local import start_local
from test_gpu_actor_speculative import _compare  # pytest puts tests/ on sys.path

NEW_TOKENS = 20


def _off(engine: SplitEngine) -> SplitEngine:
    """The session engine's model and residual, verifier alone (one token per pass: quick and exact)."""
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off"))
    return SplitEngine(engine.model, engine.residual, config, tree_stats=engine.tree_stats)


@pytest.fixture(scope="module")
def alone(engine, prompts, tokenizer):
    off = _off(engine)
    return off, [off.generate(p, NEW_TOKENS, tokenizer.eos_token_id)[0] for p in prompts]


def _drain(batcher: Batcher) -> None:
    while batcher.step():
        pass


def test_requests_joining_between_checks_get_their_own_text(alone, prompts, tokenizer):
    off, expected = alone
    batcher = Batcher(off, BatchConfig(max_batch=3))
    eos = tokenizer.eos_token_id
    first = batcher.submit(prompts[0], NEW_TOKENS, eos)
    for _ in range(4):
        batcher.step()
    assert 1 < len(first.tokens) < NEW_TOKENS  # it runs alone for a while
    later = [batcher.submit(p, NEW_TOKENS, eos) for p in prompts[1:]]
    _drain(batcher)
    tickets = [first, *later]
    outcomes = [_compare(off, p, t.tokens, e) for p, t, e in zip(prompts, tickets, expected, strict=True)]
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    passes = [{c.verify_ms for c in t.stats.checks} for t in tickets]  # a shared pass: the same timing
    assert len(passes[0] & passes[1] & passes[2]) >= len(first.stats.checks) - 4
    assert batcher.load() | {"prefix_hits": 0} == {
        "live": 0,
        "waiting": 0,
        "kv_bytes": batcher.prefixes.nbytes,
        "prefix_bytes": batcher.prefixes.nbytes,
        "prefix_hits": 0,
        "recoveries": 0,
    }


def test_choices_of_one_prompt_prefill_it_once(alone, prompts, tokenizer):
    """A request's n choices (and prompts that share most of their tokens) prefill the shared tokens once:
    the later ones wait for the first to go live and copy its K/V, then give the text they give alone."""
    off, expected = alone
    config = EngineConfig(prefill="split", prefill_chunk=16, spec=SpecConfig(mode="off"))
    chunked = SplitEngine(off.model, off.residual, config, tree_stats=off.tree_stats)
    batcher = Batcher(chunked, BatchConfig(max_batch=4, prefix_cache_bytes=0))
    eos, longer = tokenizer.eos_token_id, prompts[0] + prompts[1][1:3]
    sampled = SamplingParams(temperature=0.8, seed=3)
    asks = [(prompts[0], NEW_TOKENS, None), (prompts[0], NEW_TOKENS, sampled), (longer, NEW_TOKENS, None)]
    tickets = batcher.submit_group([*asks, (prompts[1], NEW_TOKENS, None)], eos)
    _drain(batcher)
    assert all(t.error is None for t in tickets)
    shared = min(common_prefix(prompts[0], prompts[1]), len(prompts[1]) - 1)  # e.g. a chat template's start
    assert [t.reused for t in tickets] == [0, len(prompts[0]) - 1, len(prompts[0]), shared]
    assert _compare(off, prompts[0], tickets[0].tokens, expected[0]) in ("equal", "near-tie")
    assert _compare(off, prompts[1], tickets[3].tokens, expected[1]) in ("equal", "near-tie")
    alone_longer, _ = off.generate(longer, NEW_TOKENS, eos)
    assert _compare(off, longer, tickets[2].tokens, alone_longer) in ("equal", "near-tie")
    solo = Batcher(chunked, BatchConfig(max_batch=1, prefix_cache_bytes=0))
    sampled_alone = solo.submit(prompts[0], NEW_TOKENS, eos, sampled)
    _drain(solo)
    assert tickets[1].tokens == sampled_alone.tokens  # the copied K/V samples the text its own would


def test_the_loop_thread_serves_callers_and_cancel_frees_the_slot(alone, prompts, tokenizer):
    off, expected = alone
    batcher = Batcher(off, BatchConfig(prefix_cache_bytes=0))
    batcher.start()
    try:
        results: dict[int, list[int]] = {}

        def call(i: int) -> None:
            ticket, done, got = batcher.submit(prompts[i], NEW_TOKENS, tokenizer.eos_token_id), False, []
            while not done:
                ticket, new, done = batcher.next(ticket.id)
                got += new
            results[i] = got

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, p in enumerate(prompts):
            assert _compare(off, p, results[i], expected[i]) in ("equal", "near-tie")

        # one caller polling two requests at once (a server's streams) gets each one's own text
        open_ = {batcher.submit(prompts[i], NEW_TOKENS, tokenizer.eos_token_id).id: i for i in (0, 1)}
        got = {i: [] for i in open_.values()}
        while open_:
            for ticket_id, (_, new, done) in batcher.next_many(list(open_)).items():
                got[open_[ticket_id]] += new
                if done:
                    del open_[ticket_id]
        for i in (0, 1):
            assert _compare(off, prompts[i], got[i], expected[i]) in ("equal", "near-tie")
        assert batcher.next_many(["no-such-id"]) == {"no-such-id": None}

        long = batcher.submit(prompts[0], 1500)
        _, new, _ = batcher.next(long.id, 30)
        assert new
        batcher.cancel(long.id)
        deadline = time.monotonic() + 30
        while batcher.load()["live"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert batcher.load()["live"] == 0 and batcher.load()["kv_bytes"] == 0
        assert long.cancelled and len(long.tokens) < 1500
        with pytest.raises(KeyError, match="no request"):
            batcher.next(long.id)
    finally:
        batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(prompts[0], 4)


def test_a_round_that_fails_outside_its_requests_ends_them_and_the_loop_goes_on(alone, prompts, monkeypatch):
    """A failure in a round but outside any one request's own guard (here the draft's choice, which reads
    the engine's measured costs) ends every open request with that error instead of leaving their callers
    waiting on a loop thread that died; the next request is served."""
    off, expected = alone
    batcher = Batcher(off, BatchConfig(prefix_cache_bytes=0))
    choose = off.draft_shape

    def fails_once(*args: object) -> object:
        monkeypatch.setattr(off, "draft_shape", choose)
        raise RuntimeError("the costs could not be read")

    monkeypatch.setattr(off, "draft_shape", fails_once)
    batcher.start()
    try:
        ticket = batcher.submit(prompts[0], NEW_TOKENS)
        deadline = time.monotonic() + 60
        while not (done := batcher.next(ticket.id, 1.0)[2]) and time.monotonic() < deadline:
            pass
        assert done and isinstance(ticket.error, RuntimeError) and "costs" in str(ticket.error)
        again = batcher.submit(prompts[0], NEW_TOKENS)
        got, finished = [], False
        while not finished:
            _, new, finished = batcher.next(again.id, 30)
            got += new
        assert again.error is None and got == again.tokens
        assert _compare(off, prompts[0], got, expected[0][: len(got)]) in ("equal", "near-tie")
    finally:
        batcher.close()


def test_admission_refuses_what_does_not_fit(alone, prompts):
    off, _ = alone
    batcher = Batcher(off, BatchConfig(max_batch=1, max_queue=1))
    batcher.submit(prompts[0], 8)
    batcher.submit(prompts[1], 8)  # joins when the first leaves
    with pytest.raises(EngineBusy, match="waiting") as busy:
        batcher.submit(prompts[2], 8)
    assert busy.value.retry_after_s >= 1
    config = EngineConfig(prefill="split", prefill_chunk=16, spec=SpecConfig(mode="off"))
    chunked = SplitEngine(off.model, off.residual, config, tree_stats=off.tree_stats)
    slow = Batcher(chunked, BatchConfig(max_batch=1, max_queue=1))
    joining = slow.submit(prompts[0] + prompts[1], 8)  # several forwards of 16: it joins over rounds
    slow.step()
    assert not joining.tokens and slow.load()["live"] == 1  # it holds the batch's one place meanwhile
    slow.submit(prompts[1], 8)
    with pytest.raises(EngineBusy, match="waiting"):
        slow.submit(prompts[2], 8)
    _drain(slow)
    one = Batcher(off).submit(prompts[0], 8).kv_bytes
    small = Batcher(off, BatchConfig(kv_budget_bytes=one + one // 2, prefix_cache_bytes=0))
    small.submit(prompts[0], 8)
    with pytest.raises(EngineBusy, match="K/V budget"):
        small.submit(prompts[0], 8)
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        small.submit(prompts[0], 1000)
    with pytest.raises(ValueError, match="max_seq_len"):
        small.submit(prompts[0], off.config.max_seq_len)
    _drain(small)
    small.submit(prompts[0], 8)  # room again once the first has finished
    pair = Batcher(off, BatchConfig(max_batch=2, max_queue=1))
    asks = [(prompts[0], 8, None), (prompts[1], 8, SamplingParams(temperature=0.5, seed=1))]
    first = pair.submit_group(asks)  # a client's two choices: queued together
    assert [t.prompt for t in first] == [prompts[0], prompts[1]] and first[1].params.seed == 1
    with pytest.raises(EngineBusy, match="waiting"):
        pair.submit_group(asks)  # one more place is free, not two: neither is queued
    assert pair.load()["waiting"] == 2
    with pytest.raises(ValueError, match="4 sequences at once; this engine holds at most 3"):
        pair.submit_group(asks * 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        pair.submit_group([asks[0], (prompts[1], off.config.max_seq_len, None)])
    assert pair.load()["waiting"] == 2
    _drain(pair)


def test_an_abandoned_request_expires(alone, prompts):
    off, _ = alone
    batcher = Batcher(off, BatchConfig(lease_s=0.2))
    ticket = batcher.submit(prompts[0], 8)
    time.sleep(0.3)
    assert not batcher.step()
    assert ticket.cancelled and ticket.tokens == []


def test_a_second_turn_reuses_the_first_turns_kv(alone, prompts, tokenizer):
    """The next turn of a chat prefills only what the kept sequence lacks, and gives the same text as a
    prefill from scratch."""
    off, _ = alone
    eos = tokenizer.eos_token_id
    reuse, scratch = Batcher(off), Batcher(off, BatchConfig(prefix_cache_bytes=0))
    first = reuse.submit(prompts[0], NEW_TOKENS, eos)
    _drain(reuse)
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "And in one word?"}], add_generation_prompt=True)
    second_prompt = prompts[0] + first.tokens + turn["input_ids"]
    second, fresh = reuse.submit(second_prompt, NEW_TOKENS, eos), scratch.submit(second_prompt, NEW_TOKENS, eos)
    _drain(reuse)
    _drain(scratch)
    assert second.reused == len(prompts[0]) + len(first.tokens) - 1  # all but the answer's last token
    assert fresh.reused == 0 and second.stats.prefill.tokens == len(second_prompt) - second.reused
    assert _compare(off, second_prompt, second.tokens, fresh.tokens) in ("equal", "near-tie")
    assert reuse.load()["prefix_hits"] == 1


def test_a_lost_actor_fails_its_requests_with_503_and_no_hang(converted_small, prompts):
    """Without a supervisor to reconnect to, a killed CPU actor ends the live request with an error a
    server answers 503, instead of hanging."""
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="off"))
    with start_local(converted_small, 8, config=config) as engine:
        batcher = Batcher(engine)
        ticket = batcher.submit(prompts[0], 64)
        batcher.step()
        os.kill(engine.actors[0].pid, signal.SIGKILL)
        engine.actors[0].wait(10)
        _drain(batcher)
    assert ticket.error is not None and failure_status(ticket.error) == 503


def test_logprobs_are_the_verifiers_own_whatever_the_draft(engine, prompts, tokenizer):
    """Each new token's logprob and its likeliest alternatives, and each prompt token's, are the verifier's
    log-softmax where the token stood, as one plain forward of the whole text reads them: drafted trees,
    a shared pass, sampling and a prefill in chunks change none of them (beyond a bigger pass's order of
    summation)."""
    config = EngineConfig(prefill="split", prefill_chunk=16, spec=SpecConfig(mode="tree", draft_max=8))
    tree = SplitEngine(engine.model, engine.residual, config, tree_stats=engine.tree_stats)
    batcher = Batcher(tree)
    asks = [SamplingParams(logprobs=3, prompt_logprobs=2), SamplingParams(temperature=0.8, seed=1, logprobs=0)]
    tickets = [batcher.submit(p, NEW_TOKENS, tokenizer.eos_token_id, a) for p, a in zip(prompts, asks, strict=False)]
    _drain(batcher)
    assert sum(c.accepted for t in tickets for c in t.stats.checks) > 0  # drafts were kept
    for prompt, ticket in zip(prompts, tickets, strict=False):
        text = prompt + ticket.tokens
        logits, _ = tree.forward(torch.tensor(text[:-1]), tree.new_cache())
        rows = torch.log_softmax(logits.double(), dim=-1)
        assert [e.token for e in ticket.logprobs] == ticket.tokens
        for at, entry in enumerate(ticket.logprobs, start=len(prompt) - 1):
            assert entry.logprob == pytest.approx(rows[at, entry.token].item(), abs=2e-3)
            want = rows[at].topk(ticket.params.logprobs).values.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(want, abs=2e-3)
    scored = tickets[0].prompt_logprobs
    logits, _ = tree.forward(torch.tensor(prompts[0]), tree.new_cache())
    rows = torch.log_softmax(logits.double(), dim=-1)
    assert [e.token for e in scored] == prompts[0][1:] and tickets[1].prompt_logprobs is None
    for at, entry in enumerate(scored):
        assert entry.logprob == pytest.approx(rows[at, entry.token].item(), abs=2e-3)
        assert [lp for _, lp in entry.top] == pytest.approx(rows[at].topk(2).values.tolist(), abs=2e-3)
    assert tickets[0].reused == 0  # scored positions need their logits: no prefix reuse
    with pytest.raises(ValueError, match="Batcher"):
        tree.generate(prompts[0], 2, params=SamplingParams(logprobs=1))
    with pytest.raises(ValueError, match="logprobs must be None or in"):
        SamplingParams(logprobs=21)


def test_a_long_prompt_is_prefilled_between_the_checks_of_those_decoding(alone, prompts, tokenizer):
    """A request whose prompt takes several forwards joins one forward per round: the sequence already
    decoding gets a check after each, and both texts are what each gets alone."""
    off, expected = alone
    config = EngineConfig(prefill="split", prefill_chunk=16, spec=SpecConfig(mode="off"))
    chunked = SplitEngine(off.model, off.residual, config, tree_stats=off.tree_stats)
    batcher = Batcher(chunked, BatchConfig(prefix_cache_bytes=0))
    eos = tokenizer.eos_token_id
    first = batcher.submit(prompts[0], NEW_TOKENS, eos)
    while not first.tokens:  # its own prompt may take more than one forward
        batcher.step()
    long_prompt = prompts[1] + prompts[2] + prompts[1]  # several forwards of 16
    shared = common_prefix(prompts[0], long_prompt)  # the chat template's start: copied from the live one
    forwards = -(-(len(long_prompt) - shared) // 16)
    late = batcher.submit(long_prompt, NEW_TOKENS, eos)
    during = []
    while not late.tokens:
        before = len(first.tokens)
        batcher.step()
        during.append(len(first.tokens) - before)
    assert len(during) == forwards and all(d == 1 for d in during[:-1]), during  # a token after each forward
    _drain(batcher)
    assert _compare(off, prompts[0], first.tokens, expected[0]) in ("equal", "near-tie")
    alone_late, _ = off.generate(long_prompt, NEW_TOKENS, eos)
    assert _compare(off, long_prompt, late.tokens, alone_late) in ("equal", "near-tie")
    assert late.reused == shared and late.stats.prefill_path == "split"
    assert late.stats.prefill.tokens == len(long_prompt) - shared
    whole = Batcher(chunked, BatchConfig(prefix_cache_bytes=0, prefill_per_round=10**6))  # as before chunking
    first = whole.submit(prompts[0], NEW_TOKENS, eos)
    whole.step()
    late = whole.submit(long_prompt, NEW_TOKENS, eos)
    whole.step()
    assert late.tokens and late.stats.prefill.tokens == len(long_prompt) - shared  # all of it in one round
    _drain(whole)
    with pytest.raises(ValueError, match="prefill_per_round"):
        BatchConfig(prefill_per_round=0)
    alone_on_the_loop = Batcher(chunked, BatchConfig(prefix_cache_bytes=0))
    alone_on_the_loop.start()  # nothing else live: the loop must not idle between the prompt's forwards
    try:
        start, (ticket, _, _) = (
            time.perf_counter(),
            alone_on_the_loop.next(alone_on_the_loop.submit(long_prompt, 1, eos).id, wait_s=30),
        )
        assert ticket.tokens and time.perf_counter() - start < 0.5 * forwards, ticket.stats.prefill
    finally:
        alone_on_the_loop.close()
