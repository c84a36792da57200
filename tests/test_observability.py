"""The metrics' exposition as Prometheus reads it: several replicas' merged into one."""

from prometheus_client.parser import text_string_to_metric_families

from observability.metrics import merge_exposition


def test_the_expositions_of_several_replicas_merge_into_one():
    def one(replica: str, v: int) -> bytes:
        return (f'# HELP pg_tokens_total Tokens.\n# TYPE pg_tokens_total counter\npg_tokens_total{{replica="{replica}"}} {v}\n'
                f'# HELP pg_up Up.\n# TYPE pg_up gauge\npg_up{{replica="{replica}"}} 1\n').encode()

    merged = merge_exposition([one("a", 3), one("b", 5)]).decode()
    assert merged.count("# TYPE pg_tokens_total") == 1 and merged.count("# HELP pg_up") == 1
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert sorted((s.labels["replica"], s.value) for s in fams["pg_tokens"].samples if s.name.endswith("_total")) == \
        [("a", 3.0), ("b", 5.0)]
    assert len(fams["pg_up"].samples) == 2
