"""``make serve``: start the local two-node cluster, ``serve run`` a config, stop it all after.

Runs in the foreground. Ctrl-C or SIGTERM stops it in order: the engines stop taking
requests and give those running ``--drain-s`` seconds to finish (the rest end with a 503
error, or an SSE error event then ``[DONE]``), Serve shuts down, then the Ray processes
this launcher started. With ``--address`` it serves on an existing cluster (``ray up``)
and stops only Serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cluster import local_cluster

log = logging.getLogger("cluster.serve")


def drain_and_shutdown(address: str, drain_s: float) -> None:
    """Drain every application's engine, then shut Serve down (as a Ray driver)."""
    import ray
    from ray import serve

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        try:
            apps = serve.status().applications
        except Exception as e:  # Serve is not running: nothing to drain
            log.info("no Serve instance to drain: %s", e)
            return
        from deployments.app import drain  # the application's own API for it

        pending = [(name, resp) for name in apps for resp in drain(name, drain_s)]
        for name, resp in pending:
            try:
                cut = resp.result(timeout_s=drain_s + 15)
                log.info("application %s drained (%d request(s) cut)", name, cut["cut"])
            except Exception as e:
                log.warning("draining application %s failed: %s", name, e)
        t0 = time.monotonic()
        serve.shutdown()
        log.info("Serve shut down in %.1f s", time.monotonic() - t0)
    finally:
        ray.shutdown()


def pairs_in(config: str) -> int:
    """How many pairs a config asks for: its engine deployment's replicas when its stages are
    per replica (the local cluster gets a local and a peer raylet for each)."""
    import yaml

    most = 1
    for app in yaml.safe_load(Path(config).read_text()).get("applications", []):
        args = app.get("args") or {}
        if not (args.get("rpc") or {}).get("per_replica"):
            continue
        most = max(most, int(args.get("replicas") or 1))
        for d in app.get("deployments", []):
            if d.get("name") == "engine":
                auto = d.get("autoscaling_config") or {}
                most = max(most, int(d.get("num_replicas") or auto.get("max_replicas") or 1))
    return most


def check_config(config: str) -> list[str]:
    """What is wrong with a Serve config, before any process starts: the file, Serve's own
    schema, and each application's args as ``build_app`` validates them (pydantic's message,
    which names the key). Empty: nothing found."""
    import yaml
    from pydantic import ValidationError

    try:
        cfg = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError) as e:
        return [f"{config}: {e}"]
    if not isinstance(cfg, dict):
        return [f"{config}: a Serve config is a mapping (http_options, applications, ...)"]
    problems = []
    try:
        from ray.serve.schema import ServeDeploySchema

        ServeDeploySchema.model_validate(cfg) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(cfg)
    except Exception as e:  # Serve's schema: unknown or mistyped top-level keys
        problems.append(f"{config}: {e}")
    from deployments.app import check_exposure
    from deployments.args import AppArgs

    host = str((cfg.get("http_options") or {}).get("host", "127.0.0.1"))
    for app in cfg.get("applications") or []:
        if not isinstance(app, dict) or app.get("import_path") != "deployments.app:build_app":
            continue
        name = app.get("name", "?")
        try:
            a = AppArgs.model_validate(app.get("args") or {})
            check_exposure(host, a)
        except ValidationError as e:
            for err in e.errors():
                key = ".".join(str(x) for x in err.get("loc", ()))
                problems.append(f"application {name!r}, args.{key}: {err.get('msg')}")
        except ValueError as e:
            problems.append(f"application {name!r}: {e}")
    return problems


def _default_sigint() -> None:
    # a launcher started in the background has SIGINT ignored, and a child inherits that
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="Serve config file, e.g. deployments/configs/local.yaml")
    p.add_argument("--address", default=None, help="existing Ray cluster; default: start a local one")
    p.add_argument("--drain-s", type=float, default=5.0,
                   help="on stop, seconds running requests get to finish before they are cut")
    p.add_argument("--check", action="store_true", help="only validate the config, then exit (0: valid)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    problems = check_config(a.config)
    for line in problems:
        log.error("invalid config: %s", line)
    if problems or a.check:
        return 2 if problems else 0
    started = a.address is None
    if started:
        local_cluster.stop()
        address = local_cluster.start(pairs=pairs_in(a.config))
    else:
        address = a.address
    env = local_cluster.auth_env()
    os.environ.update({k: v for k, v in env.items() if k.startswith("RAY_AUTH")})
    env["RAY_ADDRESS"] = address
    serve_bin = str(Path(sys.executable).parent / "serve")
    proc = subprocess.Popen([serve_bin, "run", a.config], env=env, preexec_fn=_default_sigint)

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rc = 0
    try:
        while not stop.is_set():
            if proc.poll() is not None:
                rc = proc.returncode
                break
            stop.wait(0.5)
    finally:
        t0 = time.monotonic()
        log.info("stopping: draining requests (%.0f s), then Serve%s", a.drain_s, ", then Ray" if started else "")
        try:
            drain_and_shutdown(address, a.drain_s)
        except Exception as e:
            log.warning("drain and Serve shutdown failed: %s", e)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if started:
            t1 = time.monotonic()
            local_cluster.stop()
            log.info("Ray stopped in %.1f s", time.monotonic() - t1)
        log.info("stopped in %.1f s", time.monotonic() - t0)
    return rc


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    sys.exit(main())
