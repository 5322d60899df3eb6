"""Structured output: the text a request asks for must follow a JSON schema (OpenAI's ``response_format``),
an EBNF grammar (llama.cpp's GBNF form) or a regular expression (vLLM's guided decoding).

xgrammar compiles the language against the tokenizer's vocabulary into a matcher that, at each step, gives
the set of tokens that keep the text a prefix of some valid document, and accepts tokens and rolls them
back. The engine applies that set as a mask on the verifier's logits where a request's logits are shaped
(``sampling.Shaping``): at each node of a check the matcher takes the drafted path down to it, gives its
mask, and rolls the path back, so both acceptance walks (and the draft's proposals) see exactly the
constrained distribution of the text had it got there. When the document is complete only the model's
end tokens are allowed, so the text ends there. JSON is written compactly (no free whitespace), which
also keeps a weak model from padding it without end.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from splitspec.models.spec import end_ids

_BITS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Compiled languages of one model folder's tokenizer, kept by their kind and text; the tokenizer's
    vocabulary is read once, on the first one (xgrammar is imported only then)."""

    def __init__(self, folder: str | Path, vocab: int, config_eos: Sequence[int]) -> None:
        self.folder, self.vocab, self.config_eos = Path(folder), vocab, config_eos
        self._compiled: dict[str, Any] = {}

    @cached_property
    def _compiler(self) -> Any:
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        ends = sorted(end_ids(tokenizer, self.config_eos))  # a complete document allows only these
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab, stop_token_ids=ends)
        return xgrammar.GrammarCompiler(info)

    def compiled(self, kind: str, text: str) -> Any:
        """A language compiled: ``kind`` one of ``config.CONSTRAINTS``; ``ValueError`` naming the kind and
        what is wrong with one that does not compile."""
        if (kind, text) not in self._compiled:
            build = {
                "json_schema": lambda: self._compiler.compile_json_schema(text, any_whitespace=False),
                "grammar": lambda: self._compiler.compile_grammar(text),
                "regex": lambda: self._compiler.compile_regex(text),
            }[kind]
            try:
                self._compiled[kind, text] = build()
            except (RuntimeError, ValueError) as e:
                lines = str(e).strip().splitlines() or [type(e).__name__]
                raise ValueError(f"{kind}: {lines[-1]}") from e
        return self._compiled[kind, text]

    def matcher(self, kind: str, text: str) -> Matcher:
        import xgrammar

        return Matcher(xgrammar.GrammarMatcher(self.compiled(kind, text)), self.vocab)


class Matcher:
    """One sequence's place in its grammar: the tokens it has emitted accepted (``accept``), and the mask
    of the next token after any further path (``allowed``)."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        import xgrammar

        self._matcher, self.vocab = matcher, vocab
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def accept(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not self._matcher.is_terminated() and not self._matcher.accept_token(t):
                raise ValueError(f"token {t} breaks the grammar: it should have been masked")

    def allowed(self, path: Sequence[int] = ()) -> torch.Tensor | None:
        """bool [vocab]: the tokens allowed after the accepted ones and ``path``; None where the grammar
        refuses ``path`` itself (a drafted node the constrained verifier can never reach) or has ended
        (an end token taken: what follows is cut from the text)."""
        taken = 0
        for t in path:
            if self._matcher.is_terminated() or not self._matcher.accept_token(t):
                break
            taken += 1
        try:
            if taken < len(path) or self._matcher.is_terminated():
                return None
            self._matcher.fill_next_token_bitmask(self._bitmask)
        finally:
            if taken:
                self._matcher.rollback(taken)
        return ((self._bitmask[0, :, None] >> _BITS) & 1).bool().flatten()[: self.vocab]
