"""The references in docs/ are the code's: the configuration tables are generated from the
config models, every series the service exports is on the metrics page, and every page the
README and the docs index link to exists."""

from __future__ import annotations

import re
from pathlib import Path

from deployments import reference
from observability.ingress_metrics import IngressMetrics
from observability.metrics import EngineMetrics
from observability.resume import ResumeMetrics

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_the_configuration_page_is_the_one_the_code_generates() -> None:
    page = reference.PAGE.read_text()
    assert reference.render(page) == page, "docs/configuration.md differs: run python -m deployments.reference"


def test_every_config_key_is_in_the_generated_tables_with_its_description() -> None:
    from deployments.args import AppArgs

    page = reference.PAGE.read_text()
    for key, f in AppArgs.model_fields.items():
        assert f"| `{key}` |" in page, key
        assert f.description, f"{key} has no description: the reference would say nothing of it"


def test_a_page_without_its_markers_is_refused_not_silently_skipped() -> None:
    try:
        reference.render("# nothing here\n")
    except ValueError as e:
        assert "markers" in str(e)
    else:
        raise AssertionError("a page without markers rendered")


def exported_names() -> set[str]:
    """Every series name the service exports: the engine's registry as the exposition names
    them (a counter gets ``_total``), and the ingress's own series."""
    m = EngineMetrics("m")
    m.set_media({})  # the projector's series, exported when the model has one
    text = m.render().decode()
    names = set(re.findall(r"^# TYPE (\S+) \w+$", text, re.M))
    counters = set(re.findall(r"^# TYPE (\S+) counter$", text, re.M))
    names = {n + "_total" if n in counters and not n.endswith("_total") else n for n in names}
    own = IngressMetrics(lambda: {"f": 1}, lambda: {"400": 1}, lambda: 0).render().decode()
    resume = ResumeMetrics().render().decode()
    return names | {n + "_total" if kind == "counter" and not n.endswith("_total") else n
                    for text in (own, resume) for n, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M)}


def test_every_exported_series_is_on_the_metrics_page() -> None:
    names = exported_names()
    assert len(names) > 40  # the engine's, the groups', llama-server's names and the ingress's
    assert {"pgroups_group_slots", "llamacpp:n_decode_total", "pgroups_http_refused_total"} <= names
    page = (DOCS / "metrics.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in page)
    assert not missing, f"docs/metrics.md lacks {missing}"


def test_the_metrics_page_names_no_series_that_is_not_exported() -> None:
    names = exported_names()
    page = (DOCS / "metrics.md").read_text()
    named = set(re.findall(r"`((?:pgroups_|llamacpp:)[a-z_:]+)`", page))
    # bucket/sum/count series of a histogram are its own; a name may appear as a prefix
    stale = sorted(n for n in named if n not in names and not any(n.startswith(x) for x in names)
                   and n not in {"pgroups_memory_mib"})
    assert not stale, f"docs/metrics.md names series the service does not export: {stale}"


def test_every_link_of_the_readme_and_the_docs_reaches_a_file() -> None:
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}"


def test_the_readme_stays_a_first_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 300, len(lines)
