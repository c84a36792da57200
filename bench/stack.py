"""The service the HTTP benchmarks measure: the local two-node Ray cluster with Serve on a bench
port (``HttpStack``), and ``make serve``'s application arguments (``demo_args``)."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HTTP_PORT = 8766


def demo_args(rpc_port: int | None = None, **more: object) -> dict:
    """``make serve``'s application arguments (deployments/configs/local.yaml) with ``more`` over
    them, and its RPC stage on ``rpc_port`` where given."""
    import yaml

    conf = yaml.safe_load((ROOT / "deployments" / "configs" / "local.yaml").read_text())
    args = {**conf["applications"][0]["args"], **more}
    if rpc_port is not None:
        args["rpc"] = {**args["rpc"], "port": rpc_port}
    return args


class HttpStack:
    """The local two-node Ray cluster with Serve on a bench port."""

    def __init__(self, ingress: str | None = None, pairs: int = 1) -> None:
        """``ingress``: "direct" (the ingress serves HTTP itself) or "proxy" (Serve's proxy
        actor); default: ``local_cluster.ingress_mode()``. ``pairs``: raylet pairs (room for as
        many engine-and-stage pairs)."""
        from cluster import local_cluster

        self._session = local_cluster.serve_session(6392, HTTP_PORT, ingress=ingress, pairs=pairs)
        self._session.__enter__()
        self.base = f"http://127.0.0.1:{HTTP_PORT}"
        self.deployed = False

    def deploy(self, args: dict) -> None:
        import httpx
        from ray import serve

        from deployments.app import build_app

        if self.deployed:
            serve.delete("bench")  # the stage serves one engine at a time
        serve.run(build_app(args), name="bench", route_prefix="/")
        self.deployed = True
        deadline = time.monotonic() + 300
        while httpx.get(self.base + "/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("bench app not healthy")
            time.sleep(0.5)

    def scrape(self) -> dict[tuple[str, str], float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[tuple[str, str], float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.base + "/metrics", timeout=30).text):
            for s in fam.samples:
                key = (s.name, s.labels.get("stage") or s.labels.get("group") or s.labels.get("phase") or "")
                out[key] = out.get(key, 0.0) + s.value
        return out

    def close(self) -> None:
        self._session.__exit__(None, None, None)
