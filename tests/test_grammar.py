"""Constrained output drafts as deep as free output, and stays exactly plain decoding's.

Greedy: with a JSON schema or an EBNF grammar (xgrammar), MTP's tokens equal plain constrained
decoding's on the trained demo pair, the output parses against its schema, and rounds keep
drafts.  Sampled: the first tokens' joint distribution under a grammar is enumerated exactly and
compared with thousands of MTP rows.  Mutations (matchers not rolled back, masks that ignore the
drafts, snapshots not restored) must break equality."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_mtp.decode import processors as row_processors
from omlx_mtp.decode.loop import QUERY_AT_BONUS, SpeculativeDecoder
from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.processors import MATCHER, OPAQUE, PURE, SNAPSHOT, RowProcessors, kind_of
from omlx_mtp.decode.sampling import SamplingParams, target_probs
from omlx_mtp.fixtures.demo import PAIR_DIR
from omlx_mtp.tools.session import Session, run_plain

from .stats import chi_square_p_value
from .test_batch_generator import MAX_TOKENS, mlx_generate, run
from .test_omlx_patch import runs_omlx
from .test_sampling_lossless import PROMPT, STEPS, VOCAB, MixtureDrafter, small  # noqa: F401

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from omlx_mtp.decode.grammar import GrammarCompiler, GrammarProcessor  # noqa: E402

EOS = 1
FILE = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
        "properties": {"name": {"type": "string", "maxLength": 16}, "count": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "kind": {"enum": ["file", "dir", "link"]}}}
LISTING = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "additionalProperties": False,
           "required": ["path", "dir"], "properties": {"path": {"type": "string", "maxLength": 24},
                                                        "dir": {"type": "boolean"}}}}
TOOL_CALL = ('root ::= "{\\"name\\": \\"" ("read_file" | "list_dir") "\\", \\"arguments\\": {\\"path\\": \\"" '
             '[a-z/._]{1,24} "\\"}}"')
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", '    config = {"name": ']


@pytest.fixture(scope="module")
def demo():
    if not (PAIR_DIR / "assistant" / "config.json").is_file():
        pytest.skip("the trained demo pair is not in this checkout")
    session = Session.load(PAIR_DIR / "target", PAIR_DIR / "assistant")
    return session, GrammarCompiler(session.tokenizer, session.target.vocab_size)


def constrained(session, prompt, make, max_tokens=120, params=None):
    """A request with a fresh grammar processor (each run follows its own output)."""
    params = dataclasses.replace(params or SamplingParams(), logits_processors=(make(),))
    return Request(session.encode(prompt), params, max_tokens=max_tokens, stop_tokens=frozenset({EOS}))


def grammars(compiler):
    return {"file": (lambda: compiler.json_schema(FILE), FILE),
            "listing": (lambda: compiler.json_schema(LISTING), LISTING),
            "tool": (lambda: compiler.ebnf(TOOL_CALL), None)}


def mtp_rows(session, requests, draft_tokens=3, mask_drafts=True):
    decoder = SpeculativeDecoder(session.target, session.drafter, draft_tokens=draft_tokens,
                                 query_offset=QUERY_AT_BONUS)
    decoder.mask_drafts = mask_drafts
    return decoder.generate(requests)


def test_processor_kinds(demo):
    from mlx_lm.sample_utils import make_logits_processors

    _, compiler = demo
    assert kind_of(make_logits_processors(repetition_penalty=1.2)[0]) == PURE
    assert kind_of(compiler.json_schema(FILE)) == MATCHER
    assert kind_of(CallBudget(3, 7)) == SNAPSHOT
    assert kind_of(lambda tokens, logits: logits) == OPAQUE  # a closure may keep anything
    assert kind_of(types.SimpleNamespace(accept_token=print)) == OPAQUE  # follows the output, can't undo


@pytest.mark.parametrize("name", ["file", "listing", "tool"])
@pytest.mark.parametrize("K", [1, 3, "auto"])
def test_constrained_greedy_equals_plain(demo, name, K):
    session, compiler = demo
    make, schema = grammars(compiler)[name]
    tokens_per_round = []
    for prompt in PROMPTS:
        plain = run_plain(session.model, constrained(session, prompt, make)).row
        (row,) = mtp_rows(session, [constrained(session, prompt, make)], draft_tokens=K)
        assert row.generated == plain.generated, (prompt, K)
        assert row.finish_reason == "stop"
        text = session.tokenizer.decode(row.generated)
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert json.loads(text)["name"] in ("read_file", "list_dir")
        tokens_per_round.append(row.stats.tokens_per_round)
    if K != "auto":  # constrained rounds keep drafts (one token per round would be 1.0)
        assert min(tokens_per_round) > 1.3, tokens_per_round


def test_unmasked_drafter_is_lossless_too(demo):
    """Drafts the grammar forbids are rejected like any other (p = 0 there)."""
    session, compiler = demo
    make, schema = grammars(compiler)["file"]
    for prompt in PROMPTS:
        plain = run_plain(session.model, constrained(session, prompt, make)).row
        (row,) = mtp_rows(session, [constrained(session, prompt, make)], mask_drafts=False)
        assert row.generated == plain.generated
        jsonschema.validate(json.loads(session.tokenizer.decode(row.generated)), schema)


def test_mixed_batch_rows_keep_their_own_grammars(demo):
    """Constrained and free rows in one batch, each equal to its own plain run."""
    session, compiler = demo
    makers = [grammars(compiler)[n][0] for n in ("file", "tool", "listing")]

    def requests():
        out = [constrained(session, PROMPTS[i], make) for i, make in enumerate(makers)]
        return out + [Request(session.encode(PROMPTS[1]), max_tokens=60, stop_tokens=frozenset({EOS}))]

    plain = [run_plain(session.model, r).row.generated for r in requests()]
    rows = mtp_rows(session, requests())
    assert [r.generated for r in rows] == plain


class _NoRollback(row_processors._Grammar):
    def rollback(self):  # mutation: the matcher keeps the drafts it took
        self.taken, self.refused, self.masks = 0, False, []


@pytest.mark.parametrize("mutation", ["no-rollback", "masks-ignore-drafts"])
def test_mutations_break_equality(demo, monkeypatch, mutation):
    session, compiler = demo
    make, _ = grammars(compiler)["file"]
    plain = [run_plain(session.model, constrained(session, p, make)).row.generated for p in PROMPTS]
    if mutation == "no-rollback":
        monkeypatch.setattr(row_processors, "_Grammar", _NoRollback)
    else:  # every position masked as the first, whatever the drafts before it
        first = row_processors._Grammar.mask
        monkeypatch.setattr(row_processors._Grammar, "mask", lambda self, i, drafts, vocab: first(self, 0, drafts, vocab))
    ours = []
    for prompt in PROMPTS:
        try:
            ours.append(mtp_rows(session, [constrained(session, prompt, make)])[0].generated)
        except Exception as exc:  # a matcher driven into an impossible state may refuse outright
            ours.append(repr(exc))
    assert ours != plain


class CallBudget:
    """A processor in the manner of oMLX's thinking budget: state in plain attributes, counted
    per call; after ``budget`` calls it forces ``token`` once, then forbids it."""

    def __init__(self, budget: int, token: int):
        self.budget, self.token, self.calls, self.forced = budget, token, 0, False

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls == self.budget:
            self.forced = True
            return mx.where(mx.arange(logits.shape[-1]) == self.token, 0.0, -mx.inf)[None].astype(logits.dtype)
        if self.forced:
            return mx.where(mx.arange(logits.shape[-1]) == self.token, -mx.inf, logits)
        return logits


@pytest.mark.parametrize("restore", [True, False])
def test_snapshot_processor_follows_drafts(demo, monkeypatch, restore):
    session, _ = demo
    token = session.encode("#")[-1]

    def request(prompt):
        return Request(session.encode(prompt), SamplingParams(logits_processors=(CallBudget(13, token),)),
                       max_tokens=40)

    plain = [run_plain(session.model, request(p)).row.generated for p in PROMPTS]
    assert all(g[12] == token for g in plain)
    if not restore:  # mutation: the budget counts the calls of rejected positions
        monkeypatch.setattr(RowProcessors, "settle", lambda self, kept: [g.rollback() for g in self._grammars.values()])
    rows = mtp_rows(session, [request(p) for p in PROMPTS])
    assert sum(r.stats.accepted for r in rows) > 0
    assert ([r.generated for r in rows] == plain) is restore


# -- sampled: the exact distribution under a grammar ------------------------------------------------
RAW_VOCAB = ["<pad>", "</s>", "<s>", "a", "b", "c", "x", "y", "z", "0", "1", "2"]  # VOCAB == 12, EOS == 1
RAW_GRAMMAR = 'root ::= [abc] [xyz01] [abc0x] [xyz2ab]'


def raw_compiled():
    info = xgr.TokenizerInfo(RAW_VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_grammar(RAW_GRAMMAR)


def exact_constrained_joint(model, params: SamplingParams, compiled) -> np.ndarray:
    """P(t0..t3) of plain constrained sampling, from every prefix the grammar allows."""
    joint = np.array(1.0)
    for step in range(STEPS):
        prefixes = list(itertools.product(range(VOCAB), repeat=step))
        logits = model(mx.array([PROMPT + list(p) for p in prefixes], dtype=mx.int32))[:, -1, :]
        rows = []
        for i, prefix in enumerate(prefixes):
            processor = GrammarProcessor(compiled, VOCAB)
            if all(processor.matcher.accept_token(t) for t in prefix):
                rows.append(processor(None, logits[i : i + 1]))
            else:  # unreachable prefix: any finite row (its weight is 0)
                rows.append(logits[i : i + 1])
        probs = np.array(target_probs(mx.concatenate(rows), params))
        joint = joint[..., None] * probs.reshape([VOCAB] * step + [VOCAB])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["assistant", "mixture"])
def test_constrained_sampling_matches_exact_distribution(small, drafter_kind):  # noqa: F811
    model, target, assistant = small
    params = SamplingParams(temperature=1.0, top_p=0.95)
    compiled = raw_compiled()
    joint = exact_constrained_joint(model, params, compiled)
    drafter = assistant if drafter_kind == "assistant" else MixtureDrafter(joint)
    decoder = SpeculativeDecoder(target, drafter, draft_tokens=2)
    rows_count = 2000
    requests = [Request(PROMPT, SamplingParams(temperature=1.0, top_p=0.95,
                                               logits_processors=(GrammarProcessor(compiled, VOCAB),)),
                        max_tokens=STEPS) for _ in range(rows_count)]
    rows = decoder.generate(requests, seed=99)
    samples = np.array([r.generated for r in rows])
    assert samples.shape == (rows_count, STEPS)
    accepted = sum(r.stats.accepted for r in rows)
    drafted = sum(r.stats.drafted for r in rows)
    assert 0 < accepted < drafted  # acceptances and rejections (forbidden drafts among them)
    for position in range(STEPS):
        marginal = joint.sum(axis=tuple(a for a in range(STEPS) if a != position))
        counts = np.bincount(samples[:, position], minlength=VOCAB)
        assert chi_square_p_value(counts, marginal) > 1e-3, (position, counts, np.round(marginal * rows_count))
    pair = joint.sum(axis=(0, 3))
    counts = np.bincount(samples[:, 1] * VOCAB + samples[:, 2], minlength=VOCAB * VOCAB)
    assert chi_square_p_value(counts, pair) > 1e-3


# -- behind the BatchGenerator API, requests joining while others run ----------------------------
def test_batch_generator_grammar_rows(demo):
    from omlx_mtp.hosts.batch_generator import MTPBatchGenerator

    session, compiler = demo
    named = grammars(compiler)
    order = ["file", "tool", "listing", "file"]

    def requests():
        out = []
        for i, name in enumerate(order):
            ids = session.encode(PROMPTS[i % len(PROMPTS)])
            out.append({"prompt": ids, "logits_processors": [named[name][0]()], "max_tokens": MAX_TOKENS * 3})
        return out

    plain = []
    for r in requests():
        request = Request(r["prompt"], SamplingParams(logits_processors=tuple(r["logits_processors"])),
                          max_tokens=r["max_tokens"], stop_tokens=frozenset({EOS}))
        plain.append(run_plain(session.model, request).row.generated)
    decoder = SpeculativeDecoder(session.target, session.drafter, draft_tokens=3, query_offset=QUERY_AT_BONUS)
    generator = MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=session.model,
                                  max_tokens=MAX_TOKENS, stop_tokens=[[EOS]])
    ours = run(generator, session.model, requests(), insert_at={1: 2, 3: 5})
    for (tokens, reason, _), reference in zip(ours, plain):
        assert reason == "stop"
        assert tokens[:-1] == reference  # the stop token closes the stream
    assert generator.totals.accepted > 0


# -- oMLX 0.3.8's own processors, imported from its tree ----------------------------------------------
SOURCE = os.environ.get("OMLX_SRC")


@pytest.fixture
def omlx_processors():
    if not SOURCE or not (Path(SOURCE) / "omlx" / "api" / "grammar.py").is_file():
        pytest.skip("OMLX_SRC does not point at an oMLX tree")
    sys.path.insert(0, SOURCE)
    try:
        from omlx.api.grammar import GrammarConstraintProcessor
        from omlx.api.thinking import ThinkingBudgetProcessor
    finally:
        sys.path.remove(SOURCE)
    return GrammarConstraintProcessor, ThinkingBudgetProcessor


@runs_omlx
def test_omlx_grammar_and_thinking_budget_draft(demo, omlx_processors):
    GrammarConstraintProcessor, ThinkingBudgetProcessor = omlx_processors
    session, compiler = demo
    compiled = compiler._compiler.compile_json_schema(json.dumps(FILE), any_whitespace=False)
    close = session.encode("#")[-1]

    def grammar_request(prompt):
        processor = GrammarConstraintProcessor(compiled, session.target.vocab_size)
        return Request(session.encode(prompt), SamplingParams(logits_processors=(processor,)), max_tokens=120,
                       stop_tokens=frozenset({EOS}))

    def budget_request(prompt):
        processor = ThinkingBudgetProcessor(think_end_token_ids=[close], budget=9)
        return Request(session.encode(prompt), SamplingParams(logits_processors=(processor,)), max_tokens=40)

    for make in (grammar_request, budget_request):
        assert kind_of(make(PROMPTS[0]).params.logits_processors[0]) in (MATCHER, SNAPSHOT)
        plain = [run_plain(session.model, make(p)).row.generated for p in PROMPTS]
        rows = mtp_rows(session, [make(p) for p in PROMPTS])
        assert [r.generated for r in rows] == plain
        assert min(r.stats.tokens_per_round for r in rows) > 1.3
    assert all(close in g for g in plain)  # the budget forced its close-think token


# -- the command line ----------------------------------------------------------------------------
def test_generate_with_a_json_schema(demo, tmp_path, capsys):
    from omlx_mtp.tools.cli import main

    from .test_cli import expect_error

    schema = tmp_path / "file.json"
    schema.write_text(json.dumps(FILE))
    common = ["generate", "--model", str(PAIR_DIR / "target"), "--prompt", PROMPTS[0], "--max-tokens", "80",
              "--json-schema", str(schema), "--json"]
    outs = []
    for extra in (["--drafter", str(PAIR_DIR / "assistant")], ["--no-mtp"]):
        assert main(common + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["text"] == outs[1]["text"]
    jsonschema.validate(json.loads(outs[0]["text"]), FILE)
    assert outs[0]["tokens_per_round"] > 1.3
    bad = tmp_path / "bad.ebnf"
    bad.write_text('root ::= "{" [')
    expect_error(capsys, common[:-3] + ["--grammar", str(bad)], "bad.ebnf", "not a usable grammar")
    expect_error(capsys, common[:-3] + ["--grammar", str(tmp_path / "none.ebnf")], "cannot read")
