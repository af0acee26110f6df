"""Structured output: specs, the grammar compiler's cache and limits, matchers and bitmasks, and
grammar-constrained sampling through the batched Sampler."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.request import EngineRequest
from pdserve.engine.sequence import EngineSeq
from pdserve.sampling import Sampler
from pdserve.sampling_params import SamplingParams
from pdserve.structured.grammar import (
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    fill_bitmasks,
    unpack_bitmask,
)
from pdserve.structured.spec import MAX_SPEC_BYTES, StructuredOutputError, StructuredOutputSpec
from pdserve.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)

VOCAB = 49152
SCHEMA = json.loads((Path(__file__).parents[1] / "fixtures" / "person_schema.json").read_text())


# -- specs ----------------------------------------------------------------------------------------


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutputSpec("json_schema", "{not json", "response_format")
    assert e.value.field == "response_format" and "response_format" in str(e.value)
    with pytest.raises(StructuredOutputError):
        StructuredOutputSpec("json_schema", "[1, 2]", "guided_json")
    with pytest.raises(StructuredOutputError, match="guided_choice"):
        StructuredOutputSpec("choice", "[]", "guided_choice")
    with pytest.raises(StructuredOutputError, match="guided_choice"):
        StructuredOutputSpec("choice", '["a", 3]', "guided_choice")
    with pytest.raises(StructuredOutputError, match="unknown"):
        StructuredOutputSpec("xml", "x")
    with pytest.raises(StructuredOutputError, match=str(MAX_SPEC_BYTES)):
        StructuredOutputSpec("regex", "a" * (MAX_SPEC_BYTES + 1), "guided_regex")
    # equality (and the cache key) ignores which field the spec came from
    a = StructuredOutputSpec.json_schema({"type": "object"}, "response_format")
    b = StructuredOutputSpec.json_schema('{"type": "object"}', "guided_json")
    assert a == b and hash(a) == hash(b)


# -- compiler -------------------------------------------------------------------------------------


def test_uncompilable_specs_raise_naming_the_field(compiler: GrammarCompiler) -> None:
    bad = [
        StructuredOutputSpec("json_schema", '{"type": "foo"}', "response_format"),
        StructuredOutputSpec("regex", "[a-", "guided_regex"),
        StructuredOutputSpec("grammar", "root ::= (", "guided_grammar"),
    ]
    for spec in bad:
        with pytest.raises(StructuredOutputError) as e:
            compiler.compile(spec)
        assert e.value.field == spec.field and spec.field in str(e.value)


def test_compile_is_cached_and_bounded(compiler: GrammarCompiler) -> None:
    specs = [StructuredOutputSpec("regex", f"x{i}[0-9]+") for i in range(6)]
    before = compiler.num_compiled
    compiler.compile(specs[0])
    compiler.compile(specs[0])
    assert compiler.num_compiled == before + 1
    for s in specs:
        compiler.compile(s)
    assert compiler.cache_len == compiler.cache_size == 4  # LRU keeps the newest 4


def test_matcher_follows_tokens_from_elsewhere(
    compiler: GrammarCompiler, smol_tokenizer: Tokenizer
) -> None:
    spec = StructuredOutputSpec.json_schema(SCHEMA, "response_format")
    text = (
        '{"name":"Al","age":3,"height_m":1.5,"role":"user","tags":["x"],'
        '"address":{"city":"Oslo","zip":1}}'
    )
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    # the decode worker's view: a fresh matcher advanced over what the prefill worker sampled
    m = compiler.matcher(spec, ids[:1])
    assert m.num_tokens == 1 and not m.is_terminated
    m.advance(ids[1:])
    assert m.is_accepting
    # rebuilt at once over the whole output (re-prefill after a migration): the same state
    again = compiler.matcher(spec, ids)
    a, b = allocate_bitmask(2, VOCAB), allocate_bitmask(2, VOCAB)
    m.fill_bitmask(a, 0)
    again.fill_bitmask(b, 0)
    assert np.array_equal(a[0], b[0])
    allowed = np.nonzero(unpack_bitmask(a, VOCAB)[0])[0].tolist()
    assert allowed == list(smol_tokenizer.eos_token_ids)  # complete: only EOS may follow
    with pytest.raises(StructuredOutputError, match="response_format"):
        compiler.matcher(spec, smol_tokenizer.encode("[1]", add_special_tokens=False))


def test_parallel_fill_equals_one_by_one(
    compiler: GrammarCompiler, smol_tokenizer: Tokenizer
) -> None:
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    prefixes = ['{"name":"', '{"name":"A","age":', '{"name":"A","age":1,"height_m":2,"role":"']
    ms: list[GrammarMatcher] = [
        compiler.matcher(spec, smol_tokenizer.encode(p, add_special_tokens=False)) for p in prefixes
    ]
    par = allocate_bitmask(3, VOCAB)
    fill_bitmasks([(m, j) for j, m in enumerate(ms)], par)
    one = allocate_bitmask(3, VOCAB)
    for j, m in enumerate(ms):
        fill_bitmasks([(m, j)], one)
    assert np.array_equal(par, one)
    role = unpack_bitmask(par, VOCAB)[2]
    words = {smol_tokenizer.decode([int(t)]) for t in np.nonzero(role)[0]}
    assert words and all(any(r.startswith(w) for r in ("admin", "user", "guest")) for w in words)


# -- sampling under a grammar ----------------------------------------------------------------------


def _generate(
    compiler: GrammarCompiler,
    tok: Tokenizer,
    spec: StructuredOutputSpec,
    seeds: list[int],
    max_tokens: int = 120,
) -> list[str]:
    """Random-logit 'models' constrained by ``spec``: one batched row per seed."""
    sampler = Sampler(VOCAB, tok.eos_token_ids)
    seqs = [
        ScheduledSeq(
            f"r{s}", [0], 0, [0], True,
            SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured=spec),
            grammar=compiler.matcher(spec),
        )
        for s in seeds
    ]  # fmt: skip
    done = [False] * len(seqs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(max_tokens):
        live = [i for i in range(len(seqs)) if not done[i]]
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=gen) * 3
        for i, t in zip(live, sampler(logits, [seqs[i] for i in live]), strict=True):
            if t.token_id in tok.eos_token_ids:
                done[i] = True
            else:
                seqs[i].output_token_ids.append(t.token_id)
    assert all(done), "a constrained sequence did not finish"
    return [tok.decode(s.output_token_ids) for s in seqs]


def test_sampled_json_validates(compiler: GrammarCompiler, smol_tokenizer: Tokenizer) -> None:
    spec = StructuredOutputSpec.json_schema(SCHEMA, "response_format")
    for text in _generate(compiler, smol_tokenizer, spec, list(range(4)), max_tokens=300):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_sampled_choice_regex_and_grammar(
    compiler: GrammarCompiler, smol_tokenizer: Tokenizer
) -> None:
    choice = StructuredOutputSpec.choice(["yes", "no", "maybe so"], "guided_choice")
    assert set(_generate(compiler, smol_tokenizer, choice, [1, 2, 3, 4])) <= {
        "yes", "no", "maybe so",
    }  # fmt: skip
    date = StructuredOutputSpec("regex", r"\d{4}-\d{2}-\d{2}", "guided_regex")
    for text in _generate(compiler, smol_tokenizer, date, [5, 6]):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text)
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    g = StructuredOutputSpec("grammar", gbnf, "guided_grammar")
    for text in _generate(compiler, smol_tokenizer, g, [7, 8]):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text)
    obj = StructuredOutputSpec("json_object", "", "response_format")
    m = compiler.matcher(
        obj, smol_tokenizer.encode('{"a":[1,{"b":null}]}', add_special_tokens=False)
    )
    assert m.is_accepting
    with pytest.raises(StructuredOutputError):
        compiler.matcher(obj, smol_tokenizer.encode("[1]", add_special_tokens=False))


def test_grammar_beats_min_tokens_and_errored_state_ends(
    compiler: GrammarCompiler, smol_tokenizer: Tokenizer
) -> None:
    eos = smol_tokenizer.eos_token_ids
    spec = StructuredOutputSpec.choice(["yes"], "guided_choice")
    done = compiler.matcher(spec, smol_tokenizer.encode("yes", add_special_tokens=False))
    p = SamplingParams(temperature=0.0, min_tokens=10, max_tokens=20, structured=spec)
    s = ScheduledSeq("a", [0], 0, [0], True, p, grammar=done)
    sampler = Sampler(VOCAB, eos)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 50.0
    # min_tokens masks EOS, the grammar allows only EOS: the grammar wins
    assert sampler(logits, [s])[0].token_id in eos
    broken = compiler.matcher(spec)
    with pytest.raises(StructuredOutputError):
        broken.advance([5])
    assert broken.error
    s2 = ScheduledSeq("b", [0], 0, [0], True, SamplingParams(temperature=0.0), grammar=broken)
    assert sampler(logits, [s2])[0].token_id in eos


@pytest.mark.parametrize("extra", [{"min_tokens": 10}, {"ignore_eos": True}])
def test_grammar_end_ends_the_sequence_despite_min_tokens_and_ignore_eos(
    compiler: GrammarCompiler, smol_tokenizer: Tokenizer, extra: dict[str, object]
) -> None:
    """Once the grammar is complete only EOS may follow; that EOS ends the request with 'stop'
    instead of repeating until min_tokens (or max_tokens) and billing each repeat."""
    eos = smol_tokenizer.eos_token_ids
    spec = StructuredOutputSpec.choice(["yes"], "guided_choice")
    p = SamplingParams(temperature=0.0, max_tokens=20, structured=spec, **extra)  # type: ignore[arg-type]
    seq = EngineSeq(EngineRequest("a", (1, 2, 3), p), grammar=compiler.matcher(spec))
    sampler = Sampler(VOCAB, eos)
    reason = None
    while reason is None and len(seq.output_token_ids) < 8:
        sched = ScheduledSeq(
            "a", seq.token_ids[-1:], len(seq.token_ids) - 1, [0], True, p,
            seq.prompt_token_ids, seq.output_token_ids, seq.grammar,
        )  # fmt: skip
        tok = sampler(torch.zeros(1, VOCAB), [sched])[0]
        reason = seq.append_token(tok.token_id, eos, 64)
    assert reason == "stop"
    assert seq.output_token_ids[-1] in eos
    assert smol_tokenizer.decode(seq.output_token_ids[:-1]) == "yes"


def test_required_tool_schemas_keep_their_own_refs(
    compiler: GrammarCompiler, smol_tokenizer: Tokenizer
) -> None:
    """tool_choice "required" wraps each tool's parameters in an array-of-calls schema; a tool
    whose parameters refer into themselves ($defs, as pydantic writes nested models, or "#"
    recursion) keeps meaning its own document (fault-tester finding: "Pointer '/$defs/s' does
    not exist")."""
    from router.tool_parsers import required_schema

    nested = {"type": "object", "$defs": {"s": {"type": "string"}},
              "properties": {"c": {"$ref": "#/$defs/s"}}, "required": ["c"]}  # fmt: skip
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": nested}},
        {"type": "function", "function": {"name": "t", "parameters": tree}},
    ]
    schema = required_schema(tools)
    spec = StructuredOutputSpec.json_schema(schema, "tools")
    compiler.compile(spec)
    good = [{"name": "a", "arguments": {"c": "x"}}, {"name": "t", "arguments": {"kids": [{}]}}]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "a", "arguments": {"c": 1}}],
                [{"name": "t", "arguments": {"kids": [{"name": "t"}]}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    text = json.dumps(good, separators=(",", ":"))
    m = compiler.matcher(spec, smol_tokenizer.encode(text, add_special_tokens=False))
    assert m.is_accepting
