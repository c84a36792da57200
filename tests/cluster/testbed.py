"""Two hosts on one machine, for the real `ray up` path of ``cluster/two-sparks.yaml``.

``make test-cluster`` (as root, Linux) builds them and runs ``tests/cluster`` against them:

- two network namespaces, ``head`` 10.77.0.1 and ``peer`` 10.77.0.2 (/24), joined by a veth
  pair and nothing else;
- in each, ``sshd`` as the first process of its own PID and mount namespaces (a light
  container): its own ``/tmp``, its own home (bound over the user's, with the Python the
  project's venv was made from and the shared wheel cache bound in, read only), so the two
  nodes' ``ray stop``, ``~/pipeline-groups``, ``~/.ray`` and ``/tmp/ray`` are their own;
- an ed25519 key made here; the user's ``authorized_keys`` on both nodes hold it;
- a wheelhouse of the venv's packages beside the wheel cache, because the nodes reach no
  index: each node's ``~/.bashrc`` (which Ray's ssh commands source) sets ``PIP_NO_INDEX``,
  ``PIP_FIND_LINKS`` and ``WHEEL_CACHE``, so ``make install`` runs offline and reuses the
  cached llama-cpp-python wheel.

The cluster config is made from ``cluster/two-sparks.yaml`` by substitution (addresses, user,
key, ``GGML_CUDA=off``); ``ray up`` runs inside the head container, from this checkout, as on
a real head. ``python -m tests.cluster.testbed down`` removes everything (idempotent; ``up`` runs it
first to clear a crashed run's leftovers).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger("tests.cluster.testbed")

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".cache" / "testbed"
TEMPLATE = ROOT / "cluster" / "two-sparks.yaml"
SERVE_TEMPLATE = ROOT / "deployments" / "configs" / "two-sparks.yaml"
TOKEN = ROOT / "cluster" / ".auth_token"
MODEL = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
CLUSTER_NAME = "two-sparks"
SUBNET = "10.77.0"
HTTP_PORT = 8000
RPC_PORT = 50052


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    ip: str
    veth: str

    @property
    def dir(self) -> Path:
        return STATE / self.name

    @property
    def home(self) -> Path:
        """The node's home as this (root) namespace sees it."""
        return self.dir / "home"

    @property
    def tmp(self) -> Path:
        return self.dir / "tmp"


HEAD = Node("head", "pgtb-head", f"{SUBNET}.1", "pgtb-h")
PEER = Node("peer", "pgtb-peer", f"{SUBNET}.2", "pgtb-p")
NODES = (HEAD, PEER)


def _sh(cmd: str | list[str], check: bool = True, capture: bool = True, timeout: float | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    args = cmd if isinstance(cmd, list) else ["bash", "-c", cmd]
    log.debug("$ %s", cmd)
    r = subprocess.run(args, check=False, text=True, capture_output=capture, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {cmd}\n{r.stdout or ''}{r.stderr or ''}")
    return r


def home() -> Path:
    return Path(os.path.expanduser("~"))


def wheel_cache() -> Path:
    """The wheel cache the Makefile uses (``WHEEL_CACHE``, else ``.cache/wheels``)."""
    p = Path(os.environ.get("WHEEL_CACHE") or ".cache/wheels")
    return p if p.is_absolute() else (ROOT / p)


def venv_python() -> Path:
    return ROOT / ".venv" / "bin" / "python"


@functools.lru_cache(maxsize=1)
def base_prefix() -> Path:
    """The installation the project's venv was made from (``make install`` on a node makes
    its venv with it too)."""
    out = _sh([str(venv_python()), "-c", "import sys; print(sys.base_prefix)"]).stdout.strip()
    return Path(out).resolve()


# ---------------------------------------------------------------- preparation (needs the index)


def ensure_packages() -> None:
    """sshd and rsync (Ray's file mounts), from apt when missing; sshd must not start in this
    namespace (a policy-rc.d forbids it during the install)."""
    missing = [pkg for pkg, exe in (("openssh-server", "/usr/sbin/sshd"), ("rsync", "rsync"))
               if not shutil.which(exe)]
    if not missing:
        return
    log.warning("installing %s with apt-get", " ".join(missing))
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        _sh("apt-get update -qq", timeout=600)
        _sh("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
            + " ".join(missing), timeout=900)
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)


def wheelhouse() -> Path:
    """Wheels of everything the project's venv holds (but the project, the cached
    llama-cpp-python and the model packages), plus pip, setuptools and wheel: what ``make
    install`` needs on a node that reaches no index. Kept beside the wheel cache, keyed by the
    requirement list, so later runs download nothing."""
    freeze = _sh([str(venv_python()), "-m", "pip", "freeze", "--exclude-editable"]).stdout.splitlines()
    reqs = sorted(
        line for line in freeze
        if line and not line.startswith("#") and " @ " not in line
        and not line.lower().startswith(("gemma3-", "llama-cpp-python", "llama_cpp_python", "pip==",
                                         "setuptools==", "wheel=="))
    )
    key = hashlib.md5("\n".join(reqs).encode()).hexdigest()[:8]
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    house = wheel_cache() / f"wheelhouse-{py}-{key}"
    if (house / ".complete").exists():
        return house
    house.mkdir(parents=True, exist_ok=True)
    req_file = house / "requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    log.warning("filling the wheelhouse %s (%d packages)", house.name, len(reqs))
    pip = [str(venv_python()), "-m", "pip"]
    _sh([*pip, "download", "-q", "--only-binary", ":all:", "--no-deps", "-d", str(house),
         "pip", "wheel", "setuptools>=68"], timeout=900)
    _sh([*pip, "wheel", "-q", "--no-deps", "-w", str(house), "-r", str(req_file)], timeout=1800)
    (house / ".complete").touch()
    return house


# ---------------------------------------------------------------- the two hosts


def _ns_exists(netns: str) -> bool:
    return Path("/run/netns", netns).exists()


def _ns_pids(netns: str) -> list[int]:
    if not _ns_exists(netns):
        return []
    r = _sh(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in r.stdout.split()]


def init_pid(node: Node) -> int:
    """The host PID of the node's first process (its sshd)."""
    pid = int((node.dir / "init.pid").read_text())
    os.kill(pid, 0)
    return pid


def _kill_netns_processes(netns: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _ns_pids(netns)
        if not pids:
            return
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + (5 if sig == signal.SIGTERM else 10)
        while _ns_pids(netns) and time.monotonic() < deadline:
            time.sleep(0.2)


def _node_script(node: Node, pybase: Path, wheels: Path) -> str:
    """Run inside ``ip netns exec`` + ``unshare -m -p -f --mount-proc``: the node's mounts,
    then ``exec sshd`` as the namespace's first process."""
    h = home()
    binds: list[tuple[Path, Path, bool]] = [(wheels, node.home / ".cache" / "pipeline-groups" / "wheels", True)]
    if pybase == h or h in pybase.parents:
        binds.append((pybase, node.home / pybase.relative_to(h), True))
    lines = ["set -e", "mount --make-rprivate /"]
    tmp = Path("/tmp")
    if tmp in ROOT.parents:
        # a checkout under /tmp: the node's own /tmp would hide it (and the node's directories in
        # it), so the checkout is bound at its own path inside the node's /tmp first
        inner = node.tmp / ROOT.relative_to(tmp)
        inner.mkdir(parents=True, exist_ok=True)
        lines.append(f"mount --bind {shlex.quote(str(ROOT))} {shlex.quote(str(inner))}")
    lines += [f"mount --rbind {shlex.quote(str(node.tmp))} /tmp",
             # sshd's privilege separation directory, without touching the host's /run
             "mount -t tmpfs -o mode=755 tmpfs /run", "mkdir -p /run/sshd"]
    for src, dst, ro in binds:
        dst.mkdir(parents=True, exist_ok=True)
        lines.append(f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}")
        if ro:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(str(dst))}")
    lines.append(f"mount --rbind {shlex.quote(str(node.home))} {shlex.quote(str(h))}")
    lines.append(f"exec /usr/sbin/sshd -D -e -f {shlex.quote(str(node.dir / 'sshd_config'))}")
    return "\n".join(lines)


def _write_node(node: Node, pybase: Path, house: Path, pub: str) -> None:
    node.tmp.mkdir(parents=True, exist_ok=True)
    node.tmp.chmod(0o1777)
    ssh = node.home / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    ssh.chmod(0o700)
    (ssh / "authorized_keys").write_text(pub)
    (ssh / "authorized_keys").chmod(0o600)
    _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(node.dir / "ssh_host_ed25519_key")])
    (node.dir / "sshd_config").write_text(
        f"ListenAddress {node.ip}\nPort 22\nHostKey {node.dir / 'ssh_host_ed25519_key'}\n"
        "PidFile none\nUsePAM no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nAuthorizedKeysFile .ssh/authorized_keys\n"
        "StrictModes no\nPrintMotd no\nMaxSessions 64\nMaxStartups 64\nLogLevel ERROR\n"
        "Subsystem sftp internal-sftp\n"
    )
    cache = "$HOME/.cache/pipeline-groups/wheels"
    env = (
        "# written by tests/cluster/testbed.py: this node reaches no package index\n"
        f"export PATH={pybase / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
        f"export WHEEL_CACHE={cache}\n"
        f"export PIP_NO_INDEX=1 PIP_FIND_LINKS={cache}/{house.name} PIP_DISABLE_PIP_VERSION_CHECK=1\n"
    )
    (node.home / ".bashrc").write_text(env)
    (node.home / ".profile").write_text('[ -n "$BASH" ] && [ -f ~/.bashrc ] && . ~/.bashrc\n')


def _start_node(node: Node, pybase: Path) -> None:
    script = _node_script(node, pybase, wheel_cache())
    out = open(node.dir / "sshd.log", "ab")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node.netns, "unshare", "-m", "-p", "-f", "--mount-proc",
         "--propagation", "private", "bash", "-c", script],
        stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        pids = kids.read_text().split() if kids.exists() else []
        listening = _sh(["ip", "netns", "exec", node.netns, "ss", "-Hltn", f"src {node.ip}:22"], check=False).stdout
        if pids and listening.strip():
            (node.dir / "init.pid").write_text(pids[0])
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"sshd of {node.name} did not start:\n{(node.dir / 'sshd.log').read_text()}")


def up() -> None:
    """The two hosts: namespaces, veth, key, and each node's sshd. Clears leftovers first."""
    if os.geteuid() != 0:
        raise PermissionError("the test bed needs root (network and mount namespaces)")
    down()
    ensure_packages()
    house = wheelhouse()
    pybase = base_prefix()
    STATE.mkdir(parents=True, exist_ok=True)
    _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pipeline-groups-testbed", "-f", str(STATE / "id_ed25519")])
    pub = (STATE / "id_ed25519.pub").read_text()
    for n in NODES:
        _sh(["ip", "netns", "add", n.netns])
        _sh(["ip", "-n", n.netns, "link", "set", "lo", "up"])
    _sh(["ip", "link", "add", HEAD.veth, "netns", HEAD.netns, "type", "veth", "peer", "name", PEER.veth,
         "netns", PEER.netns])
    for n in NODES:
        _sh(["ip", "-n", n.netns, "addr", "add", f"{n.ip}/24", "dev", n.veth])
        _sh(["ip", "-n", n.netns, "link", "set", n.veth, "up"])
        _write_node(n, pybase, house, pub)
        _start_node(n, pybase)
    if not TOKEN.exists():
        TOKEN.write_text(subprocess.check_output([sys.executable, "-c", "import secrets; print(secrets.token_hex(32))"], text=True))
        TOKEN.chmod(0o600)
        (STATE / "token.made-here").touch()


def node_env(node: Node) -> dict[str, str]:
    """The environment of a login on the node (what its .bashrc sets, without a shell)."""
    env = {"HOME": str(home()), "USER": getpass.getuser(), "LANG": "C.UTF-8", "TERM": "dumb"}
    env["PATH"] = f"{base_prefix() / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def on(node: Node, cmd: str, check: bool = True, timeout: float | None = 120, login: bool = True,
       cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (bash) inside the node's namespaces, as a login shell of its user would."""
    inner = (f"cd {shlex.quote(cwd)} && " if cwd else "") + cmd
    args = ["nsenter", "-t", str(init_pid(node)), "-n", "-m", "-p", "--",
            "env", "-i", *[f"{k}={v}" for k, v in node_env(node).items()],
            "bash", *(["--login"] if login else []), "-c", inner]
    return _sh(args, check=check, timeout=timeout)


def popen_on(node: Node, cmd: str, logfile: Path) -> subprocess.Popen:
    out = open(logfile, "ab")
    args = ["nsenter", "-t", str(init_pid(node)), "-n", "-m", "-p", "--",
            "env", "-i", *[f"{k}={v}" for k, v in node_env(node).items()], "bash", "--login", "-c", cmd]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)


# ---------------------------------------------------------------- the real commands


def cluster_config() -> Path:
    """``cluster/two-sparks.yaml`` with this bed's addresses, user, key and a CPU build."""
    text = TEMPLATE.read_text()
    text = (text.replace("<HEAD_PRIVATE_IP>", HEAD.ip).replace("<PEER_PRIVATE_IP>", PEER.ip)
            .replace("<USER>", getpass.getuser()).replace("GGML_CUDA=on", "GGML_CUDA=off"))
    text, n = re.subn(r"^(\s*)#\s*ssh_private_key:.*$", rf"\1ssh_private_key: {STATE / 'id_ed25519'}", text,
                      count=1, flags=re.M)
    if n != 1 or "<" in yaml.safe_dump(yaml.safe_load(text)):
        raise ValueError("cluster/two-sparks.yaml is no longer substitutable: placeholders or the ssh_private_key line changed")
    path = STATE / "two-sparks.yaml"
    path.write_text(text)
    return path


RAY = "~/pipeline-groups/.venv/bin/ray"
AUTH = 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$(cat ~/.ray/auth_token)"'


def ray_up() -> float:
    """``ray up`` from the head (this checkout, its venv); returns its wall time in seconds."""
    cfg = cluster_config()
    t0 = time.monotonic()
    r = on(HEAD, f"RAY_UP_enable_autoscaler_v2=0 {ROOT / '.venv' / 'bin' / 'ray'} up -y --no-config-cache {cfg} > {STATE / 'ray-up.log'} 2>&1",
           cwd=str(ROOT), timeout=1200, check=False)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"ray up failed ({r.returncode}); tail of its log:\n" + _tail(STATE / "ray-up.log"))
    return took


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def head_python(code: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Python of the head node's venv, with the cluster token, from its checkout."""
    return on(HEAD, f"{AUTH} && ~/pipeline-groups/.venv/bin/python -c {shlex.quote(code)}",
              cwd=str(home() / "pipeline-groups"), timeout=timeout, check=check)


MARK = "json: "


def printed_json(stdout: str) -> object | None:
    """What a head command printed as ``print(MARK + json.dumps(...))``: Ray may write its own
    lines to stdout too, before or after it. None when it printed none."""
    found = [ln[len(MARK):] for ln in stdout.splitlines() if ln.startswith(MARK)]
    return json.loads(found[-1]) if found else None


def wait_for_peer(timeout_s: float = 900) -> float:
    """Until the peer (set up by the head's autoscaler) has joined; returns the seconds waited."""
    code = ("import ray, json; ray.init(address='auto', logging_level='ERROR'); "
            f"print({MARK!r} + json.dumps([[n['NodeManagerAddress'], n['Resources']] for n in ray.nodes() if n['Alive']]))")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        r = head_python(code, check=False)
        nodes = printed_json(r.stdout) if r.returncode == 0 else None
        if nodes:
            if any(ip == PEER.ip and "stage_peer" in res for ip, res in nodes):
                return time.monotonic() - t0
        time.sleep(5)
    monitor = on(HEAD, "tail -n 80 /tmp/ray/session_latest/logs/monitor.*", check=False).stdout
    raise TimeoutError(f"the peer did not join in {timeout_s:.0f} s; the head's monitor log:\n{monitor}")


def serve_config(topology: str = "layer_split", model_name: str | None = None, **overrides: object) -> Path:
    """``deployments/configs/two-sparks.yaml`` for this bed: the default model (CPU), small
    context and slots, one thread each, HTTP on the head's private address (the ingress serves
    it itself), and llama.cpp's load log (layer placement) in the replicas' log files; in ``topology``, with
    ``overrides`` over the app's args."""
    cfg = yaml.safe_load(SERVE_TEMPLATE.read_text())
    cfg["http_options"]["host"] = HEAD.ip
    app = cfg["applications"][0]
    args = app["args"]
    args.update(model=str(home() / "pipeline-groups" / "models" / (model_name or MODEL.name)), n_ctx=4096,
                n_parallel=4, n_threads=1, chat_template="gemma", topology=topology)
    args["rpc"].pop("devices", None)  # the peer's first GPU, else CPU
    args["rpc"]["threads"] = 1
    args.update(overrides)
    # Ray's worker setup hook, by its environment variable (Serve's runtime_env takes no
    # worker_process_setup_hook field)
    app["runtime_env"] = {"env_vars": {"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "cluster.placement_log.log_llama_placement"}}
    path = HEAD.home / f"pipeline-groups-testbed-{topology}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def put_model(node: Node, name: str | None = None, source: Path = MODEL) -> Path:
    """The model file (``source``) in the node's checkout (what the ray up config's file_mounts
    do on a real pair), under ``name``: a hard link, the same pages as the source."""
    models = node.home / "pipeline-groups" / "models"
    models.mkdir(parents=True, exist_ok=True)
    dst = models / (name or source.name)
    if not dst.exists():
        try:
            os.link(source, dst)
        except OSError:
            shutil.copy2(source, dst)
    return dst


def serve_run(topology: str = "layer_split", model_name: str | None = None, log: str = "serve-run.log",
              **overrides: object) -> subprocess.Popen:
    """``serve run`` of the bed's config on the head, in the background, as the README says."""
    put_model(HEAD, model_name)
    cfg = serve_config(topology, model_name, **overrides)
    return popen_on(HEAD, f"cd ~/pipeline-groups && source .venv/bin/activate && {AUTH} && "
                          f"exec serve run ~/{cfg.name}", STATE / log)


def serve_stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to a ``serve run`` of ``serve_run``: it shuts the app down."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def serve_shutdown() -> None:
    """``serve shutdown`` on the head (what the README says before serving another config): it
    returns once the controller is gone, so that the next ``serve run`` does not reach a
    controller that is still shutting down and ignores it."""
    on(HEAD, f"cd ~/pipeline-groups && source .venv/bin/activate && {AUTH} && serve shutdown -y", timeout=180)


def wait_healthy(timeout_s: float = 300, proc: subprocess.Popen | None = None, log: str = "serve-run.log") -> float:
    t0 = time.monotonic()
    url = f"http://{HEAD.ip}:{HTTP_PORT}/health"
    while time.monotonic() - t0 < timeout_s:
        r = on(HEAD, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 {url}", check=False, login=False)
        if r.stdout.strip() == "200":
            return time.monotonic() - t0
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("serve run exited:\n" + _tail(STATE / log))
        time.sleep(2)
    raise TimeoutError(f"no healthy answer from {url} in {timeout_s:.0f} s:\n" + _tail(STATE / log))


def ray_down() -> float:
    """Ray stopped on both nodes, as the template says, then ``ray down``: ``ray exec ... ray
    stop`` for the head, ssh for the peer (``ray down`` alone runs a bare ``ray stop``, which is
    not on the nodes' PATH, and then waits on the head's autoscaler, which keeps marking the
    nodes running). Returns the seconds it took."""
    if not _ns_exists(HEAD.netns) or not (STATE / "two-sparks.yaml").exists() or (STATE / "ray-down.done").exists():
        return 0.0
    try:
        init_pid(HEAD)
    except (OSError, ValueError):
        return 0.0  # the head's sshd is gone: nothing to run the commands from
    (STATE / "ray-down.done").touch()
    t0 = time.monotonic()
    ray, cfg, out = ROOT / ".venv" / "bin" / "ray", STATE / "two-sparks.yaml", STATE / "ray-down.log"
    steps = [
        f"{ray} exec {cfg} '{RAY} stop'",
        f"ssh -i {STATE / 'id_ed25519'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
        f"-o ConnectTimeout=10 {getpass.getuser()}@{PEER.ip} '{RAY} stop'",
        f"{ray} down -y {cfg}",
    ]
    for step in steps:
        with contextlib.suppress(Exception):
            on(HEAD, f"{step} >> {out} 2>&1", cwd=str(ROOT), timeout=180, check=False)
    return time.monotonic() - t0


# ---------------------------------------------------------------- measurement helpers


def link_bytes() -> dict[str, int]:
    """Bytes through the head's veth end (the whole link: Ray's traffic too)."""
    r = _sh(["ip", "-n", HEAD.netns, "-s", "-j", "link", "show", "dev", HEAD.veth])
    s = json.loads(r.stdout)[0]["stats64"]
    return {"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])}


def rpc_socket_bytes(port: int = RPC_PORT) -> dict[str, int]:
    """Bytes of the ggml RPC connections to the peer's ``port``, from the kernel's counters on
    the peer's end (sent = peer to head)."""
    r = _sh(["ip", "netns", "exec", PEER.netns, "ss", "-Htin", "state", "established", f"( sport = :{port} )"])
    sent = sum(int(x) for x in re.findall(r"bytes_sent:(\d+)", r.stdout))
    received = sum(int(x) for x in re.findall(r"bytes_received:(\d+)", r.stdout))
    return {"sent": sent, "received": received, "connections": r.stdout.count("bytes_received")}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def netns_pids_matching(node: Node, needle: str) -> list[int]:
    out = []
    for p in _ns_pids(node.netns):
        if needle in _cmdline(p):
            out.append(p)
    return out


# ---------------------------------------------------------------- teardown


def down() -> None:
    """Everything the bed made, whatever state it is in: Ray (``ray down``, the peer's ``ray
    stop``), every process of both namespaces, the namespaces (the veth goes with them), the
    node directories, and the token when the bed made it."""
    if any(_ns_exists(n.netns) for n in NODES):
        with contextlib.suppress(Exception):
            ray_down()
    for n in NODES:
        _kill_netns_processes(n.netns)
        if _ns_exists(n.netns):
            _sh(["ip", "netns", "del", n.netns], check=False)
    if (STATE / "token.made-here").exists():
        TOKEN.unlink(missing_ok=True)
    if STATE.exists():
        # bind mounts live only in the nodes' mount namespaces, gone with their processes;
        # keep the logs of the last run
        logs = STATE.parent / "testbed-logs"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True, exist_ok=True)
        for f in STATE.glob("*.log"):
            shutil.copy2(f, logs / f.name)
        shutil.rmtree(STATE, ignore_errors=True)


_registered = False


def install_cleanup() -> None:
    """Tear down at exit and on SIGTERM/SIGHUP (Ctrl-C raises KeyboardInterrupt, which runs the
    same path)."""
    global _registered
    if _registered:
        return
    _registered = True
    atexit.register(down)

    def _on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="the two-host test bed of `ray up`")
    p.add_argument("action", choices=["up", "down", "prepare"])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.action == "down":
        down()
    elif a.action == "prepare":
        ensure_packages()
        print(wheelhouse())
    else:
        up()


if __name__ == "__main__":
    main()
