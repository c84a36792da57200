"""/metrics after a known set of requests: parses, counts exactly, per-group series, no double count."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_http_api import APP


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("replica", "model"))))] = s.value
    return out


def total(m: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def test_metrics_count_exactly_what_was_served(deploy):
    base = deploy(APP)
    before = scrape(base)

    def one(i: int) -> dict:
        body = {"prompt": f"metrics request {i}", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        if i % 3 == 0:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                lines = [x for x in r.iter_lines() if x.startswith("data: {")]
            import json

            return json.loads(lines[-1][6:])["usage"]
        return httpx.post(base + "/v1/completions", json=body, timeout=60).json()["usage"]

    with ThreadPoolExecutor(8) as ex:
        usages = list(ex.map(one, range(12)))
    after = scrape(base)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(usages)
    assert delta("pgroups_generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 5 * n
    assert delta("pgroups_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("pgroups_requests_total", finished_reason="length") == n
    assert delta("pgroups_time_to_first_token_seconds_count") == n
    assert delta("pgroups_e2e_request_latency_seconds_count") == n
    assert delta("pgroups_time_per_output_token_seconds_count") == n
    # per-group series exist for every group and add up to the totals: nothing counted twice
    groups = {dict(lab).get("group") for (name, lab) in after if name == "pgroups_group_sampled_rows_total"}
    assert groups == {"0", "1"}
    assert delta("pgroups_group_sampled_rows_total") == 5 * n
    assert total(after, "pgroups_group_slots", group="0") == total(after, "pgroups_group_slots", group="1") == 2
    assert total(after, "pgroups_group_slots_busy") <= APP["n_parallel"]
    phases = {dict(lab)["phase"] for (name, lab) in after if name == "pgroups_group_phase_seconds_total"}
    assert phases >= {"batch", "decode", "sync", "sample", "detok", "stop", "send"}
    assert total(after, "pgroups_rpc_stage_up") == 1
    assert total(after, "pgroups_num_requests_running") == 0
    # the test app splits the synthetic model: the peer's layers' pages left the local node
    assert total(after, "pgroups_model_load_seconds") > 0
    assert total(after, "pgroups_model_pages_released_bytes") > 0


def test_every_series_the_dashboard_queries_is_exported(deploy):
    import json
    import re
    from pathlib import Path

    base = deploy(APP)
    httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    httpx.get(base + "/metrics", timeout=30)  # a stage's busy share is measured from one scrape to the next
    exported = {s.name for f in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text)
                for s in f.samples}
    board = json.loads((Path(__file__).resolve().parents[2] / "observability/grafana/pipeline-groups.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"\bpgroups_\w+", e)}
    assert queried and queried <= exported, sorted(queried - exported)
