"""The ggml RPC server of the peer stage, as a process of its own.

``python -m deployments.stage.server --host H --port P`` serves the devices of this node to the
engine's llama.cpp over TCP, from the installed llama-cpp-python (no extra binary). It
blocks until killed; the stage actor runs it as a child so that a crash stays contained.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable


def port_listening(port: int) -> bool:
    """Whether a socket of this machine listens on ``port``, read from /proc without connecting.

    The ggml RPC server serves one client at a time; probe connections would queue behind
    the engine's and fill its accept backlog, so readiness is read from the kernel instead.
    """
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except (OSError, StopIteration):
            continue
    return False


def command(host: str, port: int, threads: int = 0, devices: list[str] | None = None,
            cache_dir: str | None = None, cpus: list[int] | None = None) -> list[str]:
    """The command line of a server process (the stage actor, the bench and the tests use it)."""
    cmd = [sys.executable, "-m", "deployments.stage.server", "--host", host, "--port", str(port)]
    if threads:
        cmd += ["--threads", str(threads)]
    for d in devices or []:
        cmd += ["--device", d]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    if cpus:
        cmd += ["--cpus", ",".join(map(str, cpus))]
    return cmd


def private_dir(path: str) -> str:
    """``path`` (``~`` expanded) made if missing, readable and writable by this user only. The
    server loads tensors from its cache by hash without checking who wrote them: a folder that
    another user can write (``/tmp/...``) lets them plant weights, so it is refused."""
    import stat

    p = os.path.abspath(os.path.expanduser(path))
    os.makedirs(p, mode=0o700, exist_ok=True)
    st = os.stat(p)
    if st.st_uid != os.getuid():
        sys.exit(f"rpc cache_dir {p} belongs to another user (uid {st.st_uid}); choose a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        sys.exit(f"rpc cache_dir {p} is writable by other users, who could plant tensors in it; "
                 f"choose a private folder (default ~/.cache/pipeline-groups/rpc) or chmod 700 it")
    return p


def die_with_parent() -> None:
    """Linux: the server gets SIGKILL when the process (the thread) that started it ends, however
    it ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError:
        pass


def launch(host: str, port: int, threads: int = 1, timeout_s: float = 60.0,
           preexec_fn: Callable[[], None] | None = None, **kw: object) -> subprocess.Popen:
    """Start a server process and return once it listens (read from the kernel, not by connecting:
    the server serves one client at a time, and a probe would queue behind the engine). A port
    another process listens on already is refused: the new server could not bind it, and what
    listens there would be taken for it. The server dies with the process that started it."""

    if port_listening(port):
        raise RuntimeError(f"port {port} is taken: another process listens there (an RPC server left running?)")

    def before_exec() -> None:
        die_with_parent()
        if preexec_fn is not None:
            preexec_fn()

    proc = subprocess.Popen(command(host, port, threads, **kw), stdout=subprocess.DEVNULL,  # type: ignore[arg-type]
                            preexec_fn=before_exec)
    deadline = time.monotonic() + timeout_s
    while not port_listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the RPC server on {host}:{port} did not start (exit {proc.poll()})")
        time.sleep(0.1)
    return proc


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

    from engine.native.devices import list_devices, local_device_name
    from engine.native.library import ggml, init_backend

    init_backend(quiet=False)
    g = ggml()
    names = a.device or [local_device_name()]
    devs = []
    for n in names:
        d = g.dev_by_name(n.encode())
        if not d:
            avail = ", ".join(x.name for x in list_devices(memory=False))
            sys.exit(f"unknown device {n!r}; available: {avail}")
        devs.append(d)
    arr = (ctypes.c_void_p * len(devs))(*devs)
    threads = a.threads or (os.cpu_count() or 1)
    endpoint = f"{a.host}:{a.port}"
    cache_dir = private_dir(a.cache_dir) if a.cache_dir else None
    cache = cache_dir.encode() if cache_dir else None
    print(f"rpc stage serving {names} on {endpoint} with {threads} threads", flush=True)
    g.rpc.ggml_backend_rpc_start_server(endpoint.encode(), cache, threads, len(devs), arr)


if __name__ == "__main__":
    main()
