"""The model families against llama-server, on the same tiny GGUF and the same split (``make
families``): for each architecture of ``tests/models/families``, this service (two pipeline
groups, its RPC stage) and llama-server ``--jinja`` with rpc-server, the same layers on the peer.

- **greedy**: the same prompts, one at a time, ``temperature 0``: the tokens of each, compared;
  where they part, the two tokens are judged by llama.cpp's own logits there (one sequence,
  unsplit): both within ``NEAR_TIE`` of its best is a near tie, counted apart, not a difference
  (batch shapes round differently: gpt-oss's sliding-window cells and experts);
- **answers**: for each family a fixture set (plain, thinking, one call, parallel calls,
  arguments with quotes, newlines and unicode, a call cut by ``max_tokens``) forced as the
  model's text by a GBNF grammar that admits that text alone, so both servers generate the same
  answer, and the parsed message (``content``, ``reasoning_content``, each tool call's name and
  arguments as JSON, ``finish_reason``) compared field by field.
- **read with tools**: each fixture but the cut one, read by both servers with the tools
  offered: this service forces the text with the grammar beside the tools; llama-server, which
  takes no grammar beside tools, gets the text as a prefilled assistant message (its parser reads
  the prefill with what it generates) and generates one token, forced to be the end by
  ``logit_bias``: the parsed messages (content and reasoning less their outer space, each call's
  name and arguments as JSON) compared. Not for gpt-oss: llama-server continues a prefilled
  harmony answer as the final channel's text, its markup read as content.
- **forced calls**: ``tool_choice`` ``required`` (one call) and a named function, with tools
  whose every value is an enum, greedy: each server forces the call with its own grammar of the
  family's syntax, and the parsed messages (the calls' names and arguments as JSON) are
  compared; the table counts the answers that are calls on each side (this service's must all
  be; the vendored llama-server's grammar is lazy, so a model that opens no call writes text).
- **streamed calls**: this service alone (llama-server takes no grammar beside tools) reads each
  call fixture forced with the tools offered: it must be calls, and streamed, put together as
  OpenAI's clients put deltas together, the same message; and both servers stream the forced
  calls, each read against its own whole answer, with how many pieces a call's arguments came
  in (1: the call whole at its end).

For the Qwen-VL pairs (``tests/models/qwen_vl``: ``qwen2vl``, ``qwen3vl`` and their M-RoPE
projectors, both servers given the ``--mmproj``):

- **images**: images of several shapes (their rows and positions differ) through the chat API,
  one at a time, greedy, one image and two in one prompt, compared as text;
- **next turn**: a conversation's second turn about the same image with prompt caching on (this
  service reuses the first turn's KV, image and all), compared as text.

For ``qwen35-mtp`` and ``glm4moe-mtp`` (the tiny ``qwen35`` and ``glm4moe`` with their MTP
block, a bigram head right part of the time: ``tests/test_speculative_hybrid.py``,
``tests/test_mtp.py``), both servers draft with the model's MTP layers
(this service ``speculative: {type: mtp}``, llama-server ``--spec-type draft-mtp``), 4 tokens
at most:

- **greedy with MTP**: the greedy prompts, compared as tokens, and each side's drafted and
  accepted tokens (its metrics; llama-server's ``timings``), which must be equal: every row
  drafts at every step on both sides (``backoff: false``), and no prompt is reused, so the
  drafts are the same.

Prints one JSON line a family and a table; exits 1 where any cell differs.

    LLAMA_SERVER_BIN=... python -m bench.families [--archs gpt-oss,qwen3moe,qwen2vl]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from tests.images import png
from tests.models.families import FAMILIES, FamilyShape, write_family
from tests.models.qwen_vl import SHAPES as VL_SHAPES
from tests.models.qwen_vl import write_qwen_vl
from tests.rounding import NEAR_TIE, cpu_llama, logit_gap

LS_PORT, LS_RPC, RPC_PORT = 8791, 50191, 50192
N_PEER = 2
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "search the web", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
]
ASK = [{"role": "user", "content": "what is the weather in Paris and Zürich?"}]
GREEDY_PROMPTS = [f"the {w} of the pipeline node number {i} said" for i, w in enumerate(["king", "queen", "dog", "cat"])]
QUOTED = 'He said "hi"\nthen: \\o/ ünï — 東京'
IMAGES = [png(56, 56, 1), png(112, 56, 2), png(56, 112, 3), png(300, 200, 4)]


def _harmony(analysis: str | None, tail: str) -> str:
    head = f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant" if analysis else ""
    return head + tail


def _h_call(name: str, args: dict) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(args, ensure_ascii=False)}"


def _xml_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm_call(name: str, args: dict) -> str:
    kv = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{kv}</tool_call>"


def fixtures(arch: str) -> list[tuple[str, str, int]]:
    """Each family's answers as it writes them after its generation prompt, with the
    ``max_tokens`` each gets: room for the whole answer (the synthetic vocabulary spells most
    of it a character a token), a sixth of its length for the one cut short."""
    return [(name, text, len(text) // 6 if cut else 2 * len(text) + 16)
            for name, text, cut in _answers(arch)]


def _answers(arch: str) -> list[tuple[str, str, bool]]:
    paris, zurich, quoted = {"city": "Paris"}, {"city": "Zürich", "days": 3}, {"q": QUOTED}
    if arch == "gpt-oss":
        return [
            ("plain", _harmony(None, "<|channel|>final<|message|>It is sunny."), False),
            ("thinking", _harmony("The user asks.", "<|channel|>final<|message|>It is sunny."), False),
            ("one call", _harmony("Need weather.", _h_call("get_weather", paris)), False),
            ("quotes, newlines, unicode", _harmony("Search.", _h_call("search", quoted)), False),
            ("cut by max_tokens", _harmony("Need weather.", _h_call("get_weather", zurich)), True),
        ]
    if arch == "glm4moe":
        return [
            ("plain", "\n<think></think>\nIt is sunny.", False),
            ("thinking", "\n<think>The user asks.</think>\nIt is sunny.", False),
            ("one call", "\n<think>Need weather.</think>\n" + _glm_call("get_weather", paris), False),
            ("parallel calls", "\n<think></think>\n" + _glm_call("get_weather", paris) + _glm_call("get_weather", zurich), False),
            ("quotes, newlines, unicode", "\n<think></think>\n" + _glm_call("search", quoted), False),
            ("cut by max_tokens", "\n<think></think>\n" + _glm_call("get_weather", zurich), True),
        ]
    # the Qwen3-Coder template (qwen3moe) opens no thinking; Qwen3.5's opens it in the prompt
    think = "" if arch == "qwen3moe" else "The user asks.\n</think>\n\n"
    return [
        ("plain", think + "It is sunny.", False),
        ("one call", think + _xml_call("get_weather", paris), False),
        ("parallel calls", think + _xml_call("get_weather", paris) + "\n" + _xml_call("get_weather", zurich), False),
        ("quotes, newlines, unicode", think + _xml_call("search", quoted), False),
        ("cut by max_tokens", think + _xml_call("get_weather", zurich), True),
    ]


def gbnf_literal(text: str) -> str:
    """A GBNF grammar whose one sentence is ``text``."""
    esc = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'root ::= "{esc}"'


def message(body: dict) -> dict:
    """What a client reads of a chat answer, normalised: absent and empty are the same."""
    ch = body["choices"][0]
    m = ch["message"]
    calls = []
    for c in m.get("tool_calls") or []:
        try:
            args: Any = json.loads(c["function"]["arguments"])
        except (json.JSONDecodeError, TypeError):
            args = c["function"]["arguments"]
        calls.append({"name": c["function"]["name"], "arguments": args})
    return {"content": m.get("content") or "", "reasoning_content": m.get("reasoning_content") or "",
            "tool_calls": calls, "finish_reason": ch["finish_reason"]}


def chat(client: httpx.Client, base: str, text: str, max_tokens: int) -> dict:
    # llama-server refuses a grammar beside tools (400: "Cannot use custom grammar constraints
    # with tools"), so the forced answers are read with no tools offered
    r = client.post(base + "/v1/chat/completions", json={
        "messages": ASK, "temperature": 0, "max_tokens": max_tokens, "grammar": gbnf_literal(text)})
    if r.status_code != 200:
        return {"error": r.status_code, "body": r.text[:300]}
    return message(r.json())


def chat_streamed(client: httpx.Client, base: str, body: dict) -> tuple[dict, int]:
    """A chat request streamed, its answer put together as OpenAI's clients put it together
    (content, reasoning and each call's name and arguments joined by its index), and how many
    pieces the calls' arguments came in."""
    content = reasoning = ""
    calls: dict[int, dict[str, str]] = {}
    pieces, finish = 0, None
    with client.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"error": r.status_code}, 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices") or []:
                d = ch.get("delta") or {}
                content += d.get("content") or ""
                reasoning += d.get("reasoning_content") or ""
                for tc in d.get("tool_calls") or []:
                    c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                    fn = tc.get("function") or {}
                    c["name"] += fn.get("name") or ""
                    c["arguments"] += fn.get("arguments") or ""
                    pieces += bool(fn.get("arguments"))
                finish = ch.get("finish_reason") or finish
    return message({"choices": [{"finish_reason": finish, "message": {
        "content": content, "reasoning_content": reasoning,
        "tool_calls": [{"function": c} for _, c in sorted(calls.items())]}}]}), pieces


def with_tools(client: httpx.Client, base: str, text: str, max_tokens: int) -> tuple[dict, dict, int]:
    """A fixture forced as the answer with the tools offered (this service takes a grammar
    beside tools; llama-server does not): the answer whole, streamed, and its pieces."""
    body = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": max_tokens, "grammar": gbnf_literal(text)}
    r = client.post(base + "/v1/chat/completions", json=body)
    whole = message(r.json()) if r.status_code == 200 else {"error": r.status_code}
    return (whole, *chat_streamed(client, base, body))


def prefilled(client: httpx.Client, base: str, text: str, eos: int) -> dict:
    """llama-server's own reading of ``text`` as an answer with the tools offered: the text as a
    prefilled assistant message (llama-server parses the prefill with what it generates), one
    token generated and that one the end (``logit_bias``), the parsed message. A thinking that
    the text opens or closes goes in the message's ``reasoning_content``, as llama-server
    renders a continued thinking."""
    head, sep, rest = text.partition("</think>")
    msg = {"role": "assistant", "content": rest.lstrip("\n"), "reasoning_content": head.replace("<think>", "").strip()} \
        if sep else {"role": "assistant", "content": text}
    r = client.post(base + "/v1/chat/completions", json={
        "messages": [*ASK, msg], "tools": TOOLS, "temperature": 0, "max_tokens": 1, "logit_bias": [[eos, 100]]})
    if r.status_code != 200:
        return {"error": r.status_code, "body": r.text[:300]}
    return message(r.json())


def reads_alike(ours: dict, theirs: dict) -> bool:
    """The same calls (names, arguments as JSON), content and reasoning less their outer space;
    the finish reason is not compared (llama-server's is that of its one forced token)."""
    def norm(m: dict) -> tuple:
        return (m.get("content", "").strip(), m.get("reasoning_content", "").strip(), m.get("tool_calls"))
    return "error" not in ours and "error" not in theirs and norm(ours) == norm(theirs)


ENUM_TOOLS = [  # every value an enum: a forced call is bounded, whatever the weights
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search", "description": "search the web", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["sun", "rain"]}}, "required": ["q"]}}},
]
FORCED = [("forced call", {"tool_choice": "required", "parallel_tool_calls": False}),
          ("forced by name", {"tool_choice": {"type": "function", "function": {"name": "search"}}})]


def forced(client: httpx.Client, base: str, choice: dict) -> dict:
    """A call forced by ``tool_choice``: each server's own grammar of the family's call syntax,
    greedy, the parsed message."""
    r = client.post(base + "/v1/chat/completions", json={
        "messages": ASK, "tools": ENUM_TOOLS, "temperature": 0, "max_tokens": 200, **choice})
    if r.status_code != 200:
        return {"error": r.status_code, "body": r.text[:300]}
    return message(r.json())


def _called(m: dict) -> bool:
    """A forced answer that is what ``tool_choice`` asked: calls, no text."""
    return bool(m.get("tool_calls")) and not m.get("content") and m.get("finish_reason") == "tool_calls"


def cut_alike(a: dict, b: dict) -> bool:
    """Two readings of one answer cut short: where a grammar forces text, this service takes
    fewer tokens for it than llama-server (the matcher admits the forced bytes' own
    tokenisation; llama.cpp's argmax among every token that fits), so the same ``max_tokens``
    cuts them at different places. Alike: both cut, neither a call, and each field of one a
    prefix of the other's."""
    if "error" in a or "error" in b or a["finish_reason"] != "length" or b["finish_reason"] != "length":
        return False
    if a["tool_calls"] or b["tool_calls"]:
        return False
    return all(x.startswith(y) or y.startswith(x) for x, y in
               ((a["content"], b["content"]), (a["reasoning_content"], b["reasoning_content"])))


def greedy(client: httpx.Client, base: str, prompt: str | list[int], **more: object) -> dict:
    """The greedy answer to a prompt (text or tokens), with its tokens: llama.cpp's ``/completion``
    response (llama-server's carries its ``timings``)."""
    r = client.post(base + "/completion", json={"prompt": prompt, "temperature": 0, "n_predict": 24,
                                                 "return_tokens": True, **more})
    r.raise_for_status()
    return r.json()


def compare(arch: str, ours: str, theirs: str, llm: Any, eos: int | None = None) -> dict:
    """``llm``: llama.cpp's own model (``tests/rounding.cpu_llama``), the judge of near ties."""
    out: dict = {"arch": arch, "greedy": [], "answers": [], "forced": [], "streamed": [], "with tools": []}
    with httpx.Client(timeout=120) as c:
        for p in GREEDY_PROMPTS:
            toks = llm.tokenize(p.encode(), add_bos=True, special=False)
            a, b = greedy(c, ours, toks)["tokens"], greedy(c, theirs, toks)["tokens"]
            # where they part, both tokens within a near tie of llama.cpp's own best (one
            # sequence, unsplit): batch shapes round differently (tests/test_family_models.py)
            gap = logit_gap(llm, toks, a, b)
            out["greedy"].append({"prompt": p, "equal": a == b, "near tie": 0 < gap < NEAR_TIE,
                                  **({} if a == b else {"gap": gap, "ours": a, "llama-server": b})})
        for name, text, n in fixtures(arch):
            a, b = chat(c, ours, text, n), chat(c, theirs, text, n)
            same = cut_alike(a, b) if name == "cut by max_tokens" else a == b
            out["answers"].append({"fixture": name, "equal": same, "ours": a, **({} if a == b else {"llama-server": b})})
            if name == "cut by max_tokens":
                continue
            whole, streamed, pieces = with_tools(c, ours, text, n)
            if "call" in name:  # ours: a call, its stream read as it is whole
                n_calls = len(whole.get("tool_calls") or [])
                out["streamed"].append({"fixture": name, "equal": bool(n_calls) and streamed == whole,
                                        "pieces": pieces, "calls": n_calls, "ours": whole,
                                        **({} if streamed == whole else {"ours streamed": streamed})})
            if eos is not None:  # the same text read with the tools offered, by each server
                theirs_read = prefilled(c, theirs, text, eos)
                same = reads_alike(whole, theirs_read)
                out["with tools"].append({"fixture": name, "equal": same, "calls": len(
                    theirs_read.get("tool_calls") or []), **({} if same else {
                    "ours": whole, "llama-server": theirs_read})})
        for name, choice in FORCED:
            a, b = forced(c, ours, choice), forced(c, theirs, choice)
            body = {"messages": ASK, "tools": ENUM_TOOLS, "temperature": 0, "max_tokens": 200, **choice}
            (sa, pa), (sb, pb) = chat_streamed(c, ours, body), chat_streamed(c, theirs, body)
            out["forced"].append({"fixture": name, "equal": a == b, "ours": a, **({} if a == b else {"llama-server": b}),
                                  "streamed": [sa == a, sb == b], "pieces": [pa, pb]})
    return out


MTP = {"qwen35-mtp": "qwen35", "glm4moe-mtp": "glm4moe"}  # the families' MTP blocks
MTP_TRUNK = 0.3  # as tests/test_speculative_hybrid.py's
MTP_N_MAX = 4


def compare_mtp(arch: str, ours: str, theirs: str, scrape: Any) -> dict:
    """Greedy answers with MTP drafting on both sides, and the drafted and accepted tokens of each."""
    out: dict = {"arch": arch, "greedy": [], "answers": []}
    ls = [0, 0]
    # no prompt reuse: the first row after a reused prefix has no hidden state of the position
    # before it at hand on either side (this service pairs it with zeros, llama-server with the
    # slot's last one), so the drafts there differ by design, not by the drafting
    with httpx.Client(timeout=120) as c:
        for p in GREEDY_PROMPTS:
            mine, other = (greedy(c, base, p, cache_prompt=False) for base in (ours, theirs))
            a, b, t = mine["tokens"], other["tokens"], other.get("timings", {})
            ls = [ls[0] + t.get("draft_n", 0), ls[1] + t.get("draft_n_accepted", 0)]
            out["greedy"].append({"prompt": p, "equal": a == b, **({} if a == b else {"ours": a, "llama-server": b})})
    m = scrape()
    mine = [sum(v for (k, _), v in m.items() if k.endswith(f"spec_decode_num_{n}_tokens_total"))
            for n in ("draft", "accepted")]
    out["mtp"] = {"ours": {"drafted": mine[0], "accepted": mine[1]},
                  "llama-server": {"drafted": ls[0], "accepted": ls[1]}}
    # the same drafts, so the same tokens drafted and accepted
    out["answers"].append({"fixture": "MTP drafted and accepted", "equal": [int(x) for x in mine] == ls})
    return out


def _image(img: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(img).decode()}}


def image_chat(client: httpx.Client, base: str, messages: list[dict], cache: bool) -> str:
    r = client.post(base + "/v1/chat/completions", json={
        "messages": messages, "temperature": 0, "top_k": 1, "max_tokens": 16, "cache_prompt": cache})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def compare_images(arch: str, ours: str, theirs: str) -> dict:
    out: dict = {"arch": arch, "greedy": [], "answers": []}
    asks = [[{"role": "user", "content": [_image(i), {"type": "text", "text": "what is in the picture"}]}]
            for i in IMAGES]
    asks.append([{"role": "user", "content": [_image(IMAGES[1]), {"type": "text", "text": "and"}, _image(IMAGES[3]),
                                              {"type": "text", "text": "side by side"}]}])
    with httpx.Client(timeout=120) as c:
        for k, msgs in enumerate(asks):
            a, b = image_chat(c, ours, msgs, False), image_chat(c, theirs, msgs, False)
            out["greedy"].append({"prompt": f"image prompt {k}", "equal": a == b,
                                  **({} if a == b else {"ours": a, "llama-server": b})})
        for k, msgs in enumerate(asks[2:], 2):
            first = image_chat(c, ours, msgs, True)
            nxt = [*msgs, {"role": "assistant", "content": first}, {"role": "user", "content": "and its colour?"}]
            a, b = image_chat(c, ours, nxt, True), image_chat(c, theirs, nxt, True)
            out["answers"].append({"fixture": f"next turn {k}", "equal": a == b, "ours": a,
                                   **({} if a == b else {"llama-server": b})})
    return out


def eos_id(path: Path) -> int:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"]
    return int(field.parts[field.data[0]][0])


def main(argv: list[str] | None = None) -> int:
    from bench.llama_server import LlamaServer
    from bench.stack import HttpStack

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join([*sorted(FAMILIES), *MTP, *VL_SHAPES]))
    a = p.parse_args(argv)
    shape = FamilyShape()
    results = []
    stack = HttpStack()
    try:
        with tempfile.TemporaryDirectory() as d:
            for arch in a.archs.split(","):
                vl = arch in VL_SHAPES
                if vl:
                    path, mmproj = write_qwen_vl(d, arch)
                    n_layer, extra, more = VL_SHAPES[arch].n_layer, ["--mmproj", str(mmproj)], {"mmproj": str(mmproj)}
                elif arch in MTP:
                    path = write_family(Path(d) / f"{arch}.gguf", MTP[arch], shape, mtp=True, trunk=MTP_TRUNK)
                    # every row drafts at every step, as llama-server's drafts
                    n_layer, more = shape.n_layer, {"speculative": {"type": "mtp", "n_max": MTP_N_MAX, "p_min": 0.0,
                                                                    "backoff": False}}
                    extra = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(MTP_N_MAX)]
                else:
                    path = write_family(Path(d) / f"{arch}.gguf", arch, shape)
                    n_layer, extra, more = shape.n_layer, [], {}
                stack.deploy({"model": str(path), "topology": "layer_split", "n_parallel": 2, "pipeline_groups": 2,
                              "n_ctx": 8192, "peer_layers": N_PEER, "n_threads": 1,
                              "rpc": {"port": RPC_PORT, "threads": 1}, **more})
                ls = LlamaServer(path, n_layer=n_layer, n_peer=N_PEER, output_local=True, slots=1, n_ctx=4096,
                                 port=LS_PORT, rpc_port=LS_RPC, flash_attn="off", extra=["--jinja", *extra])
                try:
                    # llama-server continues a prefilled harmony answer as the final channel's text
                    # (its markup read as content), so gpt-oss's answers are not read that way
                    eos = eos_id(path) if arch != "gpt-oss" else None
                    if vl:
                        r = compare_images(arch, stack.base, ls.base)
                    elif arch in MTP:
                        r = compare_mtp(arch, stack.base, ls.base, stack.scrape)
                    else:
                        llm = cpu_llama(str(path), n_ctx=2048, n_threads=1, flash_attn=False, logits_all=True,
                                        verbose=False)
                        try:
                            r = compare(arch, stack.base, ls.base, llm, eos)
                        finally:
                            llm.close()
                finally:
                    ls.close()
                print(json.dumps(r, ensure_ascii=False), flush=True)
                results.append(r)
    finally:
        stack.close()
    print("\n| family | greedy equal | answers parsed equal | read with tools, equal to llama-server's | call fixtures with tools: calls, streamed as whole "
          "(ours) | forced: a call (ours vs llama-server) | forced, streamed as whole; pieces a call "
          "(ours vs llama-server) | differing |\n|---|---|---|---|---|---|---|---|")
    bad = 0
    for r in results:
        g = sum(x["equal"] for x in r["greedy"])
        ties = sum(x.get("near tie", False) for x in r["greedy"])
        ans = sum(x["equal"] for x in r["answers"])
        fc = r.get("forced", [])
        ours_calls = sum(_called(x["ours"]) for x in fc)
        ls_calls = sum(_called(x.get("llama-server", x["ours"])) for x in fc)
        wt = r.get("with tools", [])
        n_wt = sum(x["equal"] for x in wt)
        n_wt_calls = sum(x["equal"] and x["calls"] > 0 for x in wt)
        st = r.get("streamed", [])
        st_ok = sum(x["equal"] for x in st)
        per_call = sum(x["pieces"] for x in st) / max(1, sum(x["calls"] for x in st))
        # each side's forced calls streamed: read as its whole answer, and the pieces of a call's arguments
        fs = [sum(x["streamed"][i] for x in fc) for i in (0, 1)]
        fp = [[x["pieces"][i] for x in fc if _called(x["ours"] if i == 0 else x.get("llama-server", x["ours"]))]
              for i in (0, 1)]
        fp_text = " vs ".join(f"{sum(p) / len(p):.1f}" if p else "-" for p in fp)
        diff = ", ".join(x["fixture"] for x in r["answers"] + st if not x["equal"]) or "-"
        diff_wt = ", ".join(x["fixture"] for x in r.get("with tools", []) if not x["equal"])
        diff += f" (with tools: {diff_wt})" if diff_wt else ""
        # a forced answer that is no call is this service's failure; llama-server's is reported
        bad += (len(r["answers"]) - ans) + (len(r["greedy"]) - g - ties) + (len(fc) - ours_calls) + (len(st) - st_ok) \
            + (len(fc) - fs[0]) + (len(wt) - n_wt)
        print(f"| {r['arch']} | {g}/{len(r['greedy'])}{f' (+{ties} near tie)' if ties else ''} | "
              f"{ans}/{len(r['answers'])} | "
              f"{f'{n_wt}/{len(wt)} ({n_wt_calls} with calls)' if wt else '-'} | "
              f"{f'{st_ok}/{len(st)}, {per_call:.1f} pieces a call' if st else '-'} | "
              f"{f'{ours_calls}/{len(fc)} vs {ls_calls}/{len(fc)}' if fc else '-'} | "
              f"{f'{fs[0]}/{len(fc)} vs {fs[1]}/{len(fc)}; {fp_text}' if fc else '-'} | {diff} |")
    for r in results:
        if "mtp" in r:
            o, t = r["mtp"]["ours"], r["mtp"]["llama-server"]
            print(f"\n{r['arch']}, greedy with MTP drafts (n_max {MTP_N_MAX}): accepted/drafted ours "
                  f"{o['accepted']:.0f}/{o['drafted']:.0f}, llama-server {t['accepted']:.0f}/{t['drafted']:.0f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
