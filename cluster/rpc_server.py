"""The ggml RPC server of the peer stage, as a process of its own.

``python -m cluster.rpc_server --host H --port P`` serves the devices of this node to the
engine's llama.cpp over TCP, from the installed llama-cpp-python (no extra binary). It
blocks until killed; the stage actor runs it as a child so that a crash stays contained.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", action="append", default=[], help="device to expose (repeatable)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--cpus", default=None, help="pin the stage to these cores, e.g. 0 or 0,1 (Linux)")
    a = p.parse_args(argv)
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})

    from engine.native import ggml, init_backend, list_devices, local_device_name

    init_backend(quiet=False)
    g = ggml()
    names = a.device or [local_device_name()]
    devs = []
    for n in names:
        d = g.dev_by_name(n.encode())
        if not d:
            avail = ", ".join(x.name for x in list_devices())
            sys.exit(f"unknown device {n!r}; available: {avail}")
        devs.append(d)
    arr = (ctypes.c_void_p * len(devs))(*devs)
    threads = a.threads or (os.cpu_count() or 1)
    endpoint = f"{a.host}:{a.port}"
    cache = a.cache_dir.encode() if a.cache_dir else None
    if a.cache_dir:
        os.makedirs(a.cache_dir, exist_ok=True)
    print(f"rpc stage serving {names} on {endpoint} with {threads} threads", flush=True)
    g.rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache, threads, len(devs), arr)


if __name__ == "__main__":
    main()
