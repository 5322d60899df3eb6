"""The ShareGPT split: reading the cut-off file, a split that never overlaps, and the token builders."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from splitspec.config import DataConfig
from splitspec.models import data
from splitspec.models.data import (
    Conversation,
    Split,
    calibration_tokens,
    continuation_sequence,
    dev_sequences,
    evaluation_sequences,
    heldout_prompts,
    kind,
    make_split,
    read_conversations,
    read_prompts,
    render,
    tree_prompts,
)


def _record(id_: str, *turns: tuple[str, str]) -> dict:
    return {"id": id_, "conversations": [{"from": r, "value": v} for r, v in turns]}


def _conv(id_: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(id=id_, messages=tuple({"role": r, "content": c} for r, c in turns))


@pytest.fixture(scope="module")
def default_split() -> Split:
    return make_split()


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_truncated_file_keeps_records_before_the_cut(tmp_path, monkeypatch, chunk_chars):
    # A 7-character chunk makes every record straddle reads: the re-read path must be exact too.
    monkeypatch.setattr(data, "_CHUNK_CHARS", chunk_chars)
    records = [_record(f"r{i}", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text.index("answer 2") + 3  # ends inside a string, like the shipped file
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())

    convs = read_conversations(path)
    assert [c.id for c in convs] == ["r0", "r1"]
    assert convs.stats.records == 2 and convs.stats.kept == 2
    assert convs.stats.truncated_tail and convs.stats.tail_chars > 0


def test_roles_are_mapped_and_bad_conversations_skipped_with_reasons(tmp_path):
    records = [
        _record("good", ("human", "hi"), ("gpt", "hello"), ("human", "more"), ("gpt", "sure")),
        _record("system", ("system", "be brief"), ("human", "hi"), ("gpt", "hello")),
        _record("bing", ("human", "hi"), ("bing", "hello")),
        _record("blank", ("human", "hi"), ("gpt", "  \n")),
        _record("no_reply", ("human", "hi")),
        _record("gpt_first", ("gpt", "as I said"), ("human", "ok")),
        _record("empty"),
        {"conversations": [{"from": "human", "value": "no id"}]},
        "not an object",
    ]
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(records))

    convs = read_conversations(path)
    assert [c.id for c in convs] == ["good"]
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant", "user", "assistant"]
    assert convs[0].messages[3]["content"] == "sure"
    assert convs.stats.skipped == {
        "empty_conversation": 1,
        "empty_message": 1,
        "malformed": 2,
        "no_assistant": 1,
        "not_user_first": 1,
        "unknown_role": 2,
    }
    assert convs.stats.records == len(records) and not convs.stats.truncated_tail
    assert len(read_conversations(path, limit=2)) == 1
    assert read_conversations(path, limit=2).stats.records == 2


def test_missing_and_non_sharegpt_files_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        read_conversations(missing)
    for name, content in [
        ("prose.json", b"hello, world"),
        ("object.json", b'{"id": "x"}'),
        ("garbage.json", b"[ not json"),
        ("binary.json", b"[\xff\xfe\x00"),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            read_conversations(path)


def test_default_split_is_deterministic_and_disjoint(default_split):
    cfg = DataConfig()
    assert make_split() == default_split
    parts = [default_split.calibration, default_split.tree, default_split.evaluation]
    ids = [{c.id for c in part} for part in parts]
    sources = [{c.source_id for c in part} for part in parts]
    assert sum(map(len, sources)) == len(set().union(*sources))  # no chat in two parts (nor twice)
    assert sum(map(len, ids)) == len(set().union(*ids))
    assert len(default_split.tree) == cfg.tree_conversations
    assert len(default_split.evaluation) == cfg.eval_conversations + cfg.eval_reserve_conversations
    chars = sum(c.num_chars for c in default_split.calibration)
    assert chars >= cfg.calib_sequences * cfg.calib_seq_len * cfg.calib_chars_per_token
    assert default_split.read_stats.records == cfg.max_conversations_read
    assert make_split(DataConfig(seed=1)).tree != default_split.tree


def test_dev_and_heldout_are_frozen_disjoint_and_leave_the_other_parts_alone(default_split):
    cfg = DataConfig()
    parts = [default_split.calibration, default_split.tree, default_split.evaluation]
    parts += [default_split.dev, default_split.heldout]
    sources = [{c.source_id for c in part} for part in parts]
    assert sum(map(len, sources)) == len(set().union(*sources))
    assert len(default_split.dev) == cfg.dev_conversations
    kinds = [kind(c) for c in default_split.heldout]
    assert kinds == ["chat"] * cfg.heldout_per_kind + ["code"] * cfg.heldout_per_kind
    assert all(len(c.messages[0]["content"]) <= cfg.heldout_max_prompt_chars for c in default_split.heldout)
    # more dev conversations move the held-out part, never calibration, tree or evaluation
    other = make_split(dataclasses.replace(cfg, dev_conversations=cfg.dev_conversations + 5))
    assert [other.calibration, other.tree, other.evaluation] == parts[:3]
    assert other.dev[: cfg.dev_conversations] == default_split.dev
    assert not {c.source_id for c in other.heldout} & {c.source_id for c in other.dev}


def test_dev_sequences_and_heldout_prompts(default_split, tokenizer):
    seqs = dev_sequences(default_split, tokenizer)
    assert 0 < len(seqs) <= len(default_split.dev) and all(s.num_scored for s in seqs)
    assert {s.conversation_id for s in seqs} <= {c.id for c in default_split.dev}
    prompts = heldout_prompts(default_split)
    assert [p.id for p in prompts] == [c.id for c in default_split.heldout]
    for prompt, conv in zip(prompts, default_split.heldout, strict=True):
        assert prompt.kind == kind(conv) and prompt.messages == conv.messages[:1]
        assert prompt.ids(tokenizer) == render(conv.messages[:1], tokenizer, add_generation_prompt=True)


def test_continuation_sequence_scores_exactly_the_continuation():
    seq = continuation_sequence("p", [5, 6, 7], [8, 9])
    assert seq.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert seq.score_mask.tolist() == [False, False, True, True, False]  # logits at 7 and 8 predict 8 and 9
    with pytest.raises(ValueError, match="non-empty"):
        continuation_sequence("p", [5], [])


def test_read_prompts_takes_messages_and_text(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    lines = [
        {"kind": "code", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
        {"text": "Once upon a time"},
    ]
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    chat, raw = read_prompts(path)
    assert (chat.kind, raw.kind) == ("code", "prompt") and chat.id.endswith(":1") and raw.id.endswith(":3")
    assert chat.ids(tokenizer) == render(lines[0]["messages"], tokenizer, add_generation_prompt=True)
    assert raw.ids(tokenizer) == tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("{not json", r":1: not JSON"),
        ('["a list"]', "either"),
        ('{"text": "a", "messages": []}', "either"),
        ('{"kind": "chat"}', "either"),
        ('{"text": "  "}', "non-empty string"),
        ('{"text": "a", "kind": 3}', "kind"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role"),
        ('{"messages": [{"role": "user", "content": 5}]}', "role"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}', "assistant"),
    ],
)
def test_read_prompts_names_the_bad_line(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=error) as info:
        read_prompts(path)
    assert str(path) in str(info.value)


def test_read_prompts_refuses_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file"):
        read_prompts(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(tmp_path / "empty.jsonl")


def test_parts_of_one_chat_never_land_in_two_parts():
    answers = ["a", "```py\nx = 1\n```"]  # half the chats are code, for the held-out part
    convs = [_conv(f"c{i}_{p}", ("user", "q" * 50), ("assistant", answers[i % 2])) for i in range(16) for p in (0, 1)]
    cfg = DataConfig(
        calib_sequences=1,
        calib_seq_len=1,
        tree_conversations=2,
        eval_conversations=3,
        dev_conversations=2,
        heldout_per_kind=2,
    )
    split = make_split(dataclasses.replace(cfg, eval_reserve_conversations=0), convs)
    everything = split.calibration + split.tree + split.evaluation + split.dev + split.heldout
    assert len({c.source_id for c in everything}) == len(everything) == 12
    assert [kind(c) for c in split.heldout] == ["chat", "chat", "code", "code"]
    assert split.duplicates_dropped == 16
    with pytest.raises(ValueError, match="max_conversations_read"):
        make_split(cfg, convs)  # 16 chats cannot fill 1 + 2 + 3 + 96
    with pytest.raises(ValueError, match="short of chat and code"):
        make_split(dataclasses.replace(cfg, eval_reserve_conversations=0, heldout_per_kind=5), convs)


def test_calibration_tokens_shape_and_determinism(default_split, tokenizer):
    cfg = DataConfig(calib_sequences=4, calib_seq_len=128)
    split = make_split(cfg)
    blocks = calibration_tokens(split, tokenizer, cfg)
    assert blocks.shape == (4, 128) and blocks.dtype == torch.long
    assert torch.equal(blocks, calibration_tokens(make_split(cfg), tokenizer, cfg))
    first = render(split.calibration[0], tokenizer)[: blocks.numel()]
    assert blocks.flatten()[: len(first)].tolist() == first  # whole conversations, in split order
    tiny = Split(calibration=(_conv("t", ("user", "hi"), ("assistant", "yo")),), tree=(), evaluation=())
    with pytest.raises(ValueError, match="calib_chars_per_token"):
        calibration_tokens(tiny, tokenizer, cfg)


def test_score_mask_marks_exactly_the_replies(tokenizer):
    conv = _conv("x", ("user", "hi"), ("assistant", "\n\nhello there"), ("user", "more"), ("assistant", "ok"))
    split = Split(calibration=(), tree=(), evaluation=(conv,))
    cfg = DataConfig(eval_conversations=1, eval_min_tokens=1)
    (seq,) = evaluation_sequences(split, tokenizer, cfg)
    assert seq.input_ids.tolist() == render(conv, tokenizer)
    targets = seq.input_ids[1:][seq.score_mask[:-1]]
    eot = tokenizer.eos_token
    assert tokenizer.decode(targets).endswith(f"hello there{eot}ok{eot}")
    assert not seq.score_mask[-1]


def test_default_evaluation_reaches_the_scored_token_floor(default_split, tokenizer):
    cfg = DataConfig()
    seqs = evaluation_sequences(default_split, tokenizer, cfg)
    assert len(seqs) >= cfg.eval_conversations
    assert sum(s.num_scored for s in seqs) >= cfg.eval_min_tokens
    by_id = {c.id: c for c in default_split.evaluation}
    for s in seqs:
        assert s.input_ids.shape == s.score_mask.shape and s.score_mask.dtype == torch.bool
        assert 0 < len(s.input_ids) <= cfg.eval_max_seq_len
        assert s.input_ids.tolist() == render(by_id[s.conversation_id], tokenizer)[: cfg.eval_max_seq_len]


def test_tree_prompts_stop_at_the_first_reply(default_split, tokenizer):
    prompts = tree_prompts(default_split, tokenizer)
    assert len(prompts) == len(default_split.tree)
    for conv, prompt in zip(default_split.tree, prompts, strict=True):
        text = tokenizer.decode(prompt)
        assert text.endswith("<|im_start|>assistant\n")  # the default template's generation prompt
        assert tokenizer.decode(render(conv, tokenizer)).startswith(text)
        assert conv.messages[0]["content"] in text


def test_new_data_config_fields_are_validated():
    with pytest.raises(ValueError, match="calib_chars_per_token"):
        DataConfig(calib_chars_per_token=0)
    with pytest.raises(ValueError, match="eval_reserve_conversations"):
        DataConfig(eval_reserve_conversations=-1)
    with pytest.raises(ValueError, match="max_conversations_read"):
        DataConfig(max_conversations_read=0)
    with pytest.raises(ValueError, match="heldout_per_kind"):
        DataConfig(heldout_per_kind=0)
    with pytest.raises(ValueError, match="dev_conversations"):
        DataConfig(dev_conversations=0)
