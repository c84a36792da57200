"""The real architectures users split, each as a tiny GGUF of its own (``tests/models/families``):
loaded by the engine, served on the split with two pipeline groups, greedy output equal to the
unsplit model's, their real chat templates rendered with tools and read by their family's
parser, and the prompt cache correct for each one's memory (sliding windows with sinks,
recurrent state, experts)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import Engine, SamplingParams
from engine.text.harmony import is_harmony
from engine.text.tools import detect_format
from tests.conftest import engine_factory
from tests.models.families import FAMILIES, write_family
from tests.rounding import NEAR_TIE, cpu_llama, logit_gap

pytestmark = pytest.mark.gpu

ARCHS = sorted(FAMILIES)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "you answer about the pipeline"},
            {"role": "user", "content": f"tell me about the {['king', 'queen', 'dog', 'cat'][i % 4]} of node {i}"}]


@pytest.fixture(scope="module", params=ARCHS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    arch = request.param
    return arch, str(write_family(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch))


@pytest.fixture
def make(family: tuple[str, str]) -> Iterator[Callable[..., Engine]]:
    yield from engine_factory(model=family[1], n_parallel=4, n_ctx=4 * 1024, repack=False)


def prompts(e: Engine, n: int = 4) -> list[list[int]]:
    return [e.tokenizer.encode(e.tokenizer.apply_chat_template(conversation(i), tools=TOOLS), add_special=True)
            for i in range(n)]


def run(e: Engine, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    with ThreadPoolExecutor(len(ps)) as ex:
        return list(ex.map(lambda p: [t for o in e.stream(p, params) for t in o.tokens], ps))


def test_the_template_is_the_familys_and_its_markup_is_one_token_each(family, make):
    arch, _ = family
    fam = FAMILIES[arch]
    e = make(n_parallel=1, n_ctx=2048)
    src = e.tokenizer.template.source
    picked = detect_format(src, e.tokenizer.template.builtin).value
    assert is_harmony(src) == (arch == "gpt-oss")
    assert picked == fam.tool_format
    text = e.tokenizer.apply_chat_template(conversation(0), tools=TOOLS)
    assert "get_weather" in text  # the template rendered the tools
    used = [t for t in fam.control + fam.text if t in text]
    assert used, text
    for t in used:
        assert len(e.tokenizer.encode(t, add_special=False)) == 1, t
    assert e.tokenizer.is_eog(e.tokenizer.encode(fam.eos, add_special=False)[0])


@pytest.fixture(scope="module")
def oracle(family: tuple[str, str]) -> Iterator[Callable[[list[int], list[int], list[int]], float]]:
    """``gap(prompt, a, b)``: 0 where the answers are equal, else the difference of llama.cpp's
    own logits (one sequence, unsplit) between the two tokens where they part: a near tie."""
    llm = cpu_llama(family[1], n_ctx=2048, n_threads=2, flash_attn=False, logits_all=True, verbose=False)

    def gap(prompt: list[int], a: list[int], b: list[int]) -> float:
        return logit_gap(llm, prompt, a, b)

    yield gap
    llm.close()


def assert_equal_up_to_near_ties(gap, ps: list[list[int]], got: list[list[int]], want: list[list[int]]) -> None:
    """Greedy output as llama.cpp's, token for token, except where two tokens are within
    ``NEAR_TIE`` of each other (llama.cpp's own output is not invariant to the batch's shape:
    one sequence or four, a sliding window's cells), and then in at most half the answers."""
    gaps = [gap(p, g, w) for p, g, w in zip(ps, got, want, strict=True)]
    assert max(gaps) < NEAR_TIE, gaps
    assert sum(g > 0 for g in gaps) <= len(ps) // 2, gaps


def test_two_groups_on_the_split_give_the_unsplit_models_tokens(family, make, rpc_endpoint, oracle):
    plain = make()
    ps = prompts(plain)
    want = run(plain, ps)
    assert all(len(t) == GREEDY.max_tokens for t in want)
    assert len({tuple(t) for t in want}) > 1  # the prompts differ, so do the answers
    plain.close()
    one = make(pipeline_groups=1, rpc_endpoints=[rpc_endpoint], peer_layers=2)
    assert run(one, ps) == want  # the split itself changes nothing: the same shapes, the same bits
    one.close()
    split = make(pipeline_groups=2, rpc_endpoints=[rpc_endpoint], peer_layers=2)
    got = run(split, ps)
    assert_equal_up_to_near_ties(oracle, ps, got, want)
    # again, each prompt now in the groups' caches: the same up to near ties (a cached prompt is
    # computed in other batch shapes than a cold one)
    assert_equal_up_to_near_ties(oracle, ps, run(split, ps), got)


def test_a_returning_prefix_is_reused_and_answers_as_a_cold_prompt(family, make, rpc_endpoint, oracle):
    """The second turn of a conversation takes the first's cached state (KV, the sliding
    window's, or a recurrent checkpoint) and answers token for token as a cold engine."""
    arch, _ = family
    warm = make(pipeline_groups=2, rpc_endpoints=[rpc_endpoint], peer_layers=2)
    first = prompts(warm, 1)[0]
    reply = run(warm, [first])[0]
    second = first + reply + warm.tokenizer.encode("\nand the queen of node 2", add_special=False)
    outs = list(warm.stream(second, GREEDY))
    got = [t for o in outs for t in o.tokens]
    assert outs[-1].cached_tokens >= len(first) // 2, (arch, outs[-1].cached_tokens, len(first))
    warm.close()
    cold = make(pipeline_groups=2, rpc_endpoints=[rpc_endpoint], peer_layers=2, cache_prompt=False)
    want = run(cold, [second])[0]
    gap = oracle(second, got, want)
    assert gap < NEAR_TIE, (arch, gap)


def test_a_grammar_that_spells_the_familys_markup_admits_its_special_tokens(family, make):
    """As in llama.cpp's grammars, a special token stands for its text: a grammar that spells
    ``<|channel|>`` or ``<tool_call>`` is satisfied by the token the model writes it with, and
    the forced answer comes out whole (bench/families.py forces every fixture this way)."""
    from bench.families import fixtures, gbnf_literal
    from engine.text.grammar import GrammarSpec

    arch, _ = family
    e = make(n_parallel=1, n_ctx=2048)
    fam = FAMILIES[arch]
    for name, text, n in fixtures(arch):
        if name == "cut by max_tokens":
            continue
        p = SamplingParams(temperature=0, max_tokens=n, grammar=GrammarSpec("gbnf", gbnf_literal(text)))
        outs = list(e.stream("hello", p))
        got, tokens = "".join(o.text for o in outs), [t for o in outs for t in o.tokens]
        assert got == text, (name, got)
        assert outs[-1].finish_reason == "stop"
        marks = [t for t in fam.control + fam.text if t in text]
        # the markup came as the family's own tokens, not spelled out a character at a time
        ids = [i for t in marks for i in e.tokenizer.encode(t, add_special=False)]
        assert set(ids) <= set(tokens), (name, marks)


def test_a_forced_call_is_written_in_the_familys_own_syntax_with_its_tokens(family, make):
    """``tool_choice: required`` holds the model to its own family's call syntax (not Hermes'),
    written in its markup tokens, and read back as a call by the family's parser; sampled at
    temperature 1 on random weights, where only the grammar makes the answer a call (one call:
    ``parallel_tool_calls`` false)."""
    import json

    from engine.text.harmony import parse_harmony
    from engine.text.tool_calls import arg_types, parse_tool_calls
    from engine.text.tools import ToolPlan
    from tests.test_tools import SYNTAX

    arch, _ = family
    fam = FAMILIES[arch]
    e = make(n_parallel=1, n_ctx=2048)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {  # bounded values
        "type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}]
    plan = ToolPlan.make(e.tokenizer.template.source, e.tokenizer.template.builtin, tools, "required", False)
    assert plan.format.value == fam.tool_format
    prompt = prompts(e, 1)[0]
    for seed in range(3):
        outs = list(e.stream(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=300, grammar=plan.grammar())))
        text, toks = "".join(o.text for o in outs), [t for o in outs for t in o.tokens]
        assert outs[-1].finish_reason == "stop", text
        if arch == "gpt-oss":
            calls = parse_harmony(text).calls
        else:
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in parse_tool_calls(text, ["get_weather"], arg_types(tools))[1]]
        assert calls and all(n == "get_weather" and a["city"] in ("Paris", "Zürich") and isinstance(a["days"], int)
                             for n, a in calls), text
        assert text.startswith(SYNTAX[plan.format]), text  # the family's syntax, not Hermes'
        marks = [t for t in fam.control + fam.text if t in text]
        assert marks, text  # the family's markup, each as its one token
        assert {e.tokenizer.encode(t, add_special=False)[0] for t in marks} <= set(toks), (marks, text)


def test_a_forced_call_through_the_chat_api_is_a_call_even_where_the_prompt_opened_thinking(family, make):
    """The chat request's whole path (its template, its grammar, its answer's reading): a
    reasoning model whose prompt opens its thinking (Qwen3.5's ``<think>``) closes it first, so
    the call is read as a call, not as thinking; every family gives one call and no content."""
    from deployments.api.openai import ChatCompletionRequest
    from deployments.prompts import PromptMaker
    from engine.text.answer import read_answer

    arch, _ = family
    e = make(n_parallel=1, n_ctx=2048)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]
    for seed in range(2):
        req = ChatCompletionRequest.model_validate({
            "messages": conversation(seed), "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "seed": seed, "max_tokens": 200})
        prep = req.prepare(PromptMaker.of_engine(e), f"r{seed}")
        text = "".join(o.text for o in e.stream_request(e.accept(prep.request)))
        reasoning, content, calls = read_answer(prep.reasoning, prep.tools, text)
        assert [c["function"]["name"] for c in calls] == ["get_weather"], (arch, text)
        assert content == "" and reasoning.strip() == "", (arch, text)
