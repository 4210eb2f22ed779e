"""Structured outputs: a grammar's next-token mask as a logits option of the exactness contract.

A request's ``SamplingParams.structured_outputs`` is ``(kind, spec)``: ``json`` (a JSON schema),
``json_object`` (any JSON object), ``regex``, ``choice`` (a JSON list of strings) or ``grammar``
(EBNF). Masks come from xgrammar (chosen by measured mask cost at this vocabulary:
docs/bench/grammar-libraries-2026-12-02.md). The mask at a position is a function of the tokens
before it, like a penalty: every process that runs the request's LogitsPipeline (the target
for p at each verified position, the drafter for q at each drafted one) holds its own matcher
and applies the same mask, so target and draft agree by construction (docs/design.md section
"Structured outputs"). A matcher follows the histories it is asked about: it advances along new
tokens and rolls back what a rejection took away, whatever order the calls come in.

Tokens the grammar forbids get -inf; once the grammar is complete only the stop tokens are
allowed, so the request ends with its end-of-sequence token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from functools import cache, lru_cache

import torch

from specray.sampling.grammar_spec import GrammarError, check_spec

COMPILED_CACHE = 256  # compiled grammars kept per process
BITS = 32  # tokens per word of a packed mask (xgrammar's int32 layout)
ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # the Makefile installs it; a bare `pip install specray` may not
        raise GrammarError(
            "structured outputs need xgrammar (pip install --no-deps xgrammar==0.2.9 "
            "apache-tvm-ffi)"
        ) from None
    return xgrammar


def _ebnf_of_choice(spec: str) -> str:
    # JSON string literals are EBNF string literals (the same escapes)
    return "root ::= " + " | ".join(json.dumps(item) for item in json.loads(spec))


@lru_cache(maxsize=COMPILED_CACHE)
def check_compiles(kind: str, spec: str) -> None:
    """Raise GrammarError if the library cannot build the grammar (no tokenizer needed)."""
    check_spec(kind, spec)
    xgr = _xgrammar()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_ebnf_of_choice(spec))
    except (RuntimeError, ValueError, TypeError) as error:
        detail = str(error).splitlines()[-1] if str(error) else type(error).__name__
        raise GrammarError(f"the {kind} spec is not usable: {detail[-300:]}") from None


def lazy_grammars(
    tokenizer, vocab_size: int, stop_token_ids: Iterable[int]
) -> Callable[[], Grammars] | None:
    """A process's compiler over ``tokenizer``, built on first use (xgrammar's import and the
    vocabulary scan take about a second); None without a tokenizer (no structured outputs)."""
    if tokenizer is None:
        return None
    return cache(lambda: Grammars.for_tokenizer(tokenizer, vocab_size, sorted(stop_token_ids)))


class Grammars:
    """One process's grammar compiler over its tokenizer's vocabulary; compiled grammars are
    cached by spec. Build it with :meth:`for_tokenizer` or :meth:`for_vocab`."""

    def __init__(self, info, vocab_size: int):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS  # int32 words per packed mask row
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._compile = lru_cache(maxsize=COMPILED_CACHE)(self._compile_uncached)

    @staticmethod
    def for_tokenizer(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> Grammars:
        """Over a Hugging Face tokenizer; ids past the tokenizer (a padded head) are never
        allowed, nor are special tokens (their text, like ``<|im_start|>``, is not output text)."""
        xgr = _xgrammar()
        stops = list(stop_token_ids) or None  # (None: xgrammar looks for them)
        detected = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops
        )
        vocab = [""] * vocab_size
        for text, token_id in tokenizer.get_vocab().items():
            if token_id < vocab_size:
                vocab[token_id] = text
        for token_id in tokenizer.all_special_ids:
            if token_id < vocab_size and token_id not in stop_token_ids:
                vocab[token_id] = ""  # an empty entry is never allowed
        info = xgr.TokenizerInfo(
            vocab,
            detected.vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=detected.stop_token_ids,
            add_prefix_space=detected.add_prefix_space,
        )
        return Grammars(info, vocab_size)

    @staticmethod
    def for_vocab(token_texts: Sequence[str], stop_token_ids: Sequence[int] = ()) -> Grammars:
        """Over a vocabulary given as each token's text (tests' tiny vocabularies)."""
        xgr = _xgrammar()
        info = xgr.TokenizerInfo(
            list(token_texts), xgr.VocabType.RAW, stop_token_ids=list(stop_token_ids) or None
        )
        return Grammars(info, len(token_texts))

    def _compile_uncached(self, kind: str, spec: str):
        check_compiles(kind, spec)
        compiler = self._compiler
        # Compact JSON (no free whitespace between tokens): a model cannot run on in blanks
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(_ebnf_of_choice(spec))
        return compiler.compile_grammar(spec)

    def matcher(self, kind: str, spec: str) -> GrammarMatcher:
        return GrammarMatcher(_xgrammar().GrammarMatcher(self._compile(kind, spec)), self.words)


class GrammarMatcher:
    """One request's matcher, at the tokens it was last asked about."""

    def __init__(self, matcher, words: int):
        self._matcher, self.words = matcher, words
        self._tokens: list[int] = []  # followed, in order
        self._accepted = 0  # of them, the matcher holds this many (the rest follow a refusal)
        # The first row of the last masks() where the grammar allows no token at all (it
        # wants text this vocabulary cannot spell); None: every row has one
        self.dead_end: int | None = None

    @property
    def _refused(self) -> bool:
        """A token the grammar forbids was followed: later rows are never sampled from."""
        return self._accepted < len(self._tokens)

    def _follow(self, history: Sequence[int]) -> None:
        """Roll back to the common prefix with ``history``, then accept the rest of it."""
        held = self._tokens
        same = min(len(held), len(history))
        if list(history[:same]) != held[:same]:
            same = next(i for i, (a, b) in enumerate(zip(held, history)) if a != b)  # noqa: B905
        if same < self._accepted:
            self._matcher.rollback(self._accepted - same)
            self._accepted = same
        del held[same:]
        for token_id in history[len(held) :]:
            self._push(int(token_id))

    def _push(self, token_id: int) -> None:
        """Follow one more token (past a stop token or a refusal nothing is accepted)."""
        matcher = self._matcher
        if not self._refused and not matcher.is_terminated() and matcher.accept_token(token_id):
            self._accepted += 1
        self._tokens.append(token_id)

    def masks(
        self, history: Sequence[int], candidates: Sequence[int], num_rows: int
    ) -> torch.Tensor:
        """Packed allowed-token masks, int32 ``[num_rows, words]``: row j for the position
        after ``history + candidates[:j]``. The matcher stays at ``history``.

        A row where the grammar allows nothing (a dead end, :attr:`dead_end`) is left
        unmasked, so that no distribution is empty; a token drawn there is never committed
        (the target ends the request with an error: ``RequestState.commit_verified``)."""
        out = torch.zeros(num_rows, self.words, dtype=torch.int32, device="cpu")
        self.dead_end = None
        self._follow(history)
        for row in range(num_rows):
            if row:
                self._push(int(candidates[row - 1]))
            if self._refused or self._matcher.is_terminated():
                out[row] = out[row - 1] if row else -1  # unread: the position cannot occur
                continue
            self._matcher.fill_next_token_bitmask(out, row)
            if not out[row].any():
                out[row] = -1
                if self.dead_end is None:
                    self.dead_end = row
        self._follow(history)
        return out


def unpack_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[rows, words]`` -> bool ``[rows, vocab_size]``, True where a token is allowed
    (on the packed tensor's device)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=packed.device)  # [32]
    bits = (packed[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()
