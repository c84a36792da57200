"""The benchmark's outputs: ``latest.json``, a markdown table with the target ratios, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

KEYS = ("order", "groups", "sampling_pool", "backend_sampling", "slots", "clients", "path", "tok_s",
        "tpot_ms", "ttft_median_s", "busy_local", "busy_peer", "errors", "rss_engine_mb", "rss_peer_mb")


def _find(results: list[dict], **kw: object) -> dict | None:
    for r in results:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def ratios(results: list[dict], clients: int) -> list[tuple[str, str, str]]:
    """(what, measured, target) for the targets the issue sets."""
    out = []
    base = {"order": "rpc-first", "sampling_pool": True, "slots": clients}
    base["backend_sampling"] = False
    h1, h2 = _find(results, path="http", groups=1, **base), _find(results, path="http", groups=2, **base)
    e2 = _find(results, path="engine", groups=2, **base)
    if h1 and h2:
        out.append(("groups 2 / groups 1, RPC first, HTTP", f"{h2['tok_s'] / h1['tok_s']:.2f}x", ">= 1.6x"))
        out.append(("peer stage busy, groups 2, HTTP", f"{h2['busy_peer']:.2f}", ">= 0.85"))
    if h2 and e2:
        out.append(("HTTP / engine path, groups 2", f"{h2['tok_s'] / e2['tok_s']:.2f}x", ">= 0.9x"))
    if e2 and e2.get("host_frac") is not None:
        out.append(("host path share of a step, groups 2, engine", f"{100 * e2['host_frac']:.1f} %", "< 10 %"))
    big = [r for r in results if r.get("slots") == 256]
    if big:
        out.append(("256 slots: requests in error", ", ".join(f"g{r['groups']}: {r['errors']}" for r in big), "0"))
    return out


def markdown(results: list[dict], meta: dict) -> str:
    cols = ["path", "order", "groups", "sampling_pool", "backend_sampling", "slots", "tok_s", "tpot_ms", "ttft_median_s",
            "busy_local", "busy_peer", "errors", "rss_engine_mb", "rss_peer_mb", "rows_per_step", "host_frac"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    lines = lines[:2] + sorted(lines[2:], key=lambda x: x.split("|")[1])  # engine cells first
    lines += ["", "| target | measured | wanted |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in ratios(results, meta.get("clients", 32))]
    for key, title in (("balance", "Balance helper"), ("graph_reuse", "Graph reuse off (the RPC mitigation) vs on, one group")):
        if meta.get(key):
            lines += ["", f"{title}: {json.dumps(meta[key])}"]
    lines += ["", f"Machine: {meta['machine']}; model {meta['model']}; prompt {meta['n_prompt']} / "
              f"generate {meta['n_gen']} tokens; `{meta['command']}` took {meta['wall_s']} s."]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    cells = [r for r in results if r["slots"] == r["clients"] and r.get("clients") == min(x["clients"] for x in results)]
    def mode(r: dict) -> str:
        return "backend" if r.get("backend_sampling") else ("pool" if r["sampling_pool"] else "serial")

    labels = [f"{r['path']} {r['order']} g{r['groups']} {mode(r)}" for r in cells]
    ax1.bar(range(len(cells)), [r["tok_s"] for r in cells],
            color=["tab:blue" if r["groups"] == 1 else "tab:orange" for r in cells])
    ax1.set_xticks(range(len(cells)), labels, fontsize=7, rotation=70, ha="right")
    ax1.set_ylabel("generated tokens/s")
    ax1.set_title("groups 1 (blue) vs 2 (orange)")
    for g, color in ((1, "tab:blue"), (2, "tab:orange")):
        pts = sorted((r["slots"], r["tok_s"]) for r in results
                     if r["path"] == "http" and r["groups"] == g and r["order"] == "rpc-first" and r["sampling_pool"]
                     and not r.get("backend_sampling"))
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"groups {g}")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("slots (= concurrent clients)")
    ax2.set_ylabel("generated tokens/s")
    ax2.set_title("slot sweep, RPC first, HTTP")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: list[dict], meta: dict, out: Path, stem: str = "sweep") -> str:
    """The full sweep's reports: ``<stem>.json``, ``<stem>-meta.json``, ``<stem>.md``, ``<stem>.png``."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "clients": min((r["clients"] for r in results), default=32)}
    cells = [{k: r.get(k) for k in KEYS} | {k: v for k, v in r.items() if k not in KEYS} for r in results]
    (out / f"{stem}.json").write_text(json.dumps(cells, indent=1))
    (out / f"{stem}-meta.json").write_text(json.dumps(meta, indent=1))
    table = markdown(results, meta)
    (out / f"{stem}.md").write_text(table + "\n")
    plot(results, out / f"{stem}.png")
    return table


# ---- the headline (bench/headline.py) ----------------------------------------------------------


def outside_stages(r: dict) -> float:
    """CPU milliseconds per generated token of everything but the two stages' compute and the
    load client: the path around the stages (proxy, ingress, Ray, the engine's host work)."""
    cpu = r["reps"][0]["cpu_ms_per_token"]
    total = sum(v for k, v in cpu.items() if k not in ("rpc stage", "load client", "local stage (in engine replica)"))
    return total - cpu.get("local stage (in engine replica)", 0.0)


def cores_of(meta: dict) -> int:
    """The cores the cell ran on (every process of it, the load client too)."""
    return int(meta.get("cores") or str(meta["machine"]).split()[0])


def cpu_bound(r: dict, cores: int) -> tuple[float, float]:
    """The tokens/s the cell's CPU cost per token allows on ``cores`` (all of its processes,
    the load client included: they share the cores), and the share of it the cell reached.
    One below the bound means the stages wait on each other (no overlap) or on the host path."""
    cpu = r["reps"][0]["cpu_ms_per_token"]
    total = sum(v for k, v in cpu.items() if "(in " not in k)  # a part of a process is in its total
    bound = cores * 1000.0 / total if total else 0.0
    return bound, (r["tok_s"] / bound if bound else 0.0)


def headline_targets(results: list[dict], cores: int = 0) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    moe = [r for r in results if r.get("moe")]  # the MoE cells: their own targets, at the end
    results = [r for r in results if not r.get("moe")]

    def best_ls(pinned: bool, clients: int = 32) -> dict | None:
        ls = [r for r in results if r["system"] == "llama-server" and r["pinned"] == pinned and r["clients"] == clients]
        return max(ls, key=lambda r: r["tok_s"], default=None)

    def ours(groups: int, pinned: bool = False, clients: int = 32, topology: str = "layer_split") -> dict | None:
        return _find(results, system="pipeline-groups", groups=groups, pinned=pinned, clients=clients,
                     topology=topology, share_prefix=True, ingress="direct")

    for pinned in (False, True):
        ls, g1, g2 = best_ls(pinned), ours(1, pinned), ours(2, pinned)
        tag = "pinned" if pinned else "unpinned"
        if ls and g1:
            out.append((f"groups 1 / llama-server's best, 32 clients, {tag}", f"{g1['tok_s'] / ls['tok_s']:.2f}x", ">= 1.0x"))
        if ls and g2:
            out.append((f"groups 2 / llama-server's best, 32 clients, {tag}", f"{g2['tok_s'] / ls['tok_s']:.2f}x", ">= 1.5x"))
            out.append((f"TTFT median, groups 2 / llama-server's best, {tag}",
                        f"{g2['ttft_median_s'] / max(ls['ttft_median_s'], 1e-9):.2f}x", "<= 1.0x"))
        if g1 and g2:
            out.append((f"groups 2 / groups 1, 32 clients, {tag}", f"{g2['tok_s'] / g1['tok_s']:.2f}x", ">= 1.6x"))
        if g2:
            out.append((f"CPU ms per token outside the two stages, groups 2, {tag}", f"{outside_stages(g2):.2f}", "< 0.5"))
            if cores:
                out.append((f"groups 2: share of the tok/s its CPU cost allows on {cores} cores, {tag}",
                            f"{100 * cpu_bound(g2, cores)[1]:.0f} %", ">= 90 %"))
        px = _find(results, system="pipeline-groups", groups=2, pinned=pinned, clients=32, ingress="proxy")
        if px and ls:
            out.append((f"groups 2 behind Serve's proxy actor / llama-server's best, {tag}",
                        f"{px['tok_s'] / ls['tok_s']:.2f}x", ">= 1.5x"))
            out.append((f"CPU ms per token outside the two stages, groups 2 behind Serve's proxy actor, {tag}",
                        f"{outside_stages(px):.2f}", "< 0.5"))
        rp = ours(1, pinned, topology="replicas")
        if rp and ls:
            out.append((f"replicas (2 nodes) / llama-server's best split, {tag}", f"{rp['tok_s'] / ls['tok_s']:.2f}x",
                        "> 1x"))
        if rp and g2:
            out.append((f"replicas / layer split with 2 groups, {tag}", f"{rp['tok_s'] / g2['tok_s']:.2f}x",
                        "> 1x for a model that fits"))
        one = ours(1, pinned, topology="single")
        if rp and one:
            out.append((f"replicas (2 nodes) / one node alone, {tag}", f"{rp['tok_s'] / one['tok_s']:.2f}x", "about 2x"))
    p1, p2 = ours(1, clients=8), ours(2, clients=8)
    if p1 and p2:
        out.append(("groups 2 / groups 1, 8 clients on 32 slots, shared prefix", f"{p2['tok_s'] / p1['tok_s']:.2f}x",
                    ">= 1.3x"))
    mine = [r for r in results if r["system"] == "pipeline-groups"]
    if mine:
        worst = max(mine, key=lambda r: abs(r["tok_s_rep2"] / r["tok_s"] - 1))
        out.append(("second repetition vs first (worst cell)", f"{100 * (worst['tok_s_rep2'] / worst['tok_s'] - 1):+.1f} %",
                    "within 5 %"))
    return out + moe_targets(moe)


def moe_targets(moe: list[dict]) -> list[tuple[str, str, str]]:
    """The MoE cell's: groups 1 and 2 against llama-server on the same MoE file and split."""
    ls = max((r for r in moe if r["system"] == "llama-server"), key=lambda r: r["tok_s"], default=None)
    g1, g2 = _find(moe, system="pipeline-groups", groups=1), _find(moe, system="pipeline-groups", groups=2)
    out = []
    if ls and g1:
        out.append(("MoE: groups 1 / llama-server's best, 32 clients, unpinned", f"{g1['tok_s'] / ls['tok_s']:.2f}x", ">= 1.0x"))
    if ls and g2:
        out.append(("MoE: groups 2 / llama-server's best, 32 clients, unpinned", f"{g2['tok_s'] / ls['tok_s']:.2f}x", ">= 1.5x"))
    if g1 and g2:
        out.append(("MoE: groups 2 / groups 1, 32 clients, unpinned", f"{g2['tok_s'] / g1['tok_s']:.2f}x", ">= 1.6x"))
    return out


def headline_markdown(results: list[dict], meta: dict) -> str:
    cores = cores_of(meta)
    cols = ("tok/s", "tok/s rep 2", "TPOT ms", "TTFT median s", "TTFT p99 s", "stage CPU ms/token", "ubatches/step",
            "errors", "CPU bound tok/s", "share of bound")
    lines = ["| cell | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in results:
        rep = r["reps"][0]
        bound, share = cpu_bound(r, cores)
        vals = (r["tok_s"], r["tok_s_rep2"], r["tpot_ms"], r["ttft_median_s"], rep.get("ttft_p99_s", ""),
                r["stage_cpu_ms_per_token"],
                rep.get("ubatches_per_step", ""), r["errors"], f"{bound:.0f}", f"{100 * share:.0f} %")
        lines.append(f"| {r['name']} | " + " | ".join(str(v) for v in vals) + " |")
    lines += ["", "| target | measured | wanted |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in headline_targets(results, cores)]
    full = [r for r in results if r["clients"] == 32 and not r["pinned"]]
    roles = sorted({k for r in full for k in r["reps"][0]["cpu_ms_per_token"]})
    if full:
        lines += ["", "CPU milliseconds per generated token, by process (32 clients, unpinned, first repetition):", "",
                  "| process | " + " | ".join(r["name"].split(", unpinned")[0] for r in full) + " |",
                  "|---|" + "---|" * len(full)]
        for role in roles:
            lines.append(f"| {role} | " + " | ".join(str(r["reps"][0]["cpu_ms_per_token"].get(role, "")) for r in full) + " |")
    parts = [r for r in results if r["reps"][0].get("ttft_parts_s")]
    if parts:
        lines += ["", "Where the first token waits (mean seconds, first repetition): the client's TTFT, the part "
                  "before the engine (HTTP, ingress, Ray), in the engine's queue for a slot, and from the slot's "
                  "start to the first token:", "",
                  "| cell | client TTFT mean | before the engine | queue | slot to first token |", "|---|---|---|---|---|"]
        for r in parts:
            rep = r["reps"][0]
            tp = rep["ttft_parts_s"]
            before = rep["ttft_mean_s"] - tp["engine"] if rep.get("ttft_mean_s") is not None else None
            lines.append(f"| {r['name']} | {rep.get('ttft_mean_s', '')} | "
                         f"{'' if before is None else f'{before:.3f}'} | {tp['queue']} | {tp['slot_to_first_token']} |")
    lines += ["", f"CPU bound: {cores} cores x 1,000 / the cell's CPU ms per token over all its processes (the "
              "table above); the share of it a cell reaches is its overlap: below it, a stage or the host path "
              "waits.", "", f"Machine: {meta['machine']}; CPU: {meta.get('cpu', '?')}; pinned cells: {meta.get('layout', 'peer stage on core 0, local stage on 1')}; "
              f"model {meta['model']} ({meta['split']}); prompts {meta['n_prompt']} "
              f"tokens (+ the shared prefix), {meta['n_gen']} generated, {meta['slots']} slots; "
              f"`{meta['command']}` took {meta['wall_s']} s."]
    return "\n".join(lines)


def plot_headline(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.5))
    color = {1: "tab:blue", 2: "tab:orange"}

    def col(r: dict) -> str:
        if r["system"] == "llama-server":
            return "tab:gray"
        return "tab:green" if r.get("topology") == "replicas" else color[r["groups"]]

    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r["tok_s"] for r in results], 0.4, label="repetition 1",
           color=[col(r) for r in results])
    ax.bar([x + 0.2 for x in xs], [r["tok_s_rep2"] for r in results], 0.4, label="repetition 2", alpha=0.5,
           color=[col(r) for r in results])
    ax.set_xticks(list(xs), [r["name"] for r in results], fontsize=7, rotation=60, ha="right")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("llama-server (gray), pipeline groups 1 (blue) and 2 (orange), replicas (green); light: second repetition")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_headline(results: list[dict], meta: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps({"meta": meta, "cells": results}, indent=1))
    table = headline_markdown(results, meta)
    (out / "latest.md").write_text(table + "\n")
    plot_headline(results, out / "latest.png")
    return table


def main(argv: list[str] | None = None) -> int:
    """Rewrite ``latest.md`` from ``latest.json`` (the tables of the last ``make bench``)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    out = Path(a.results)
    data = json.loads((out / "latest.json").read_text())
    table = headline_markdown(data["cells"], data["meta"])
    (out / "latest.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
