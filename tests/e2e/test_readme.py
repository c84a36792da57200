"""The README's "Talk to it" examples run as written against the test app: its Python block
and every curl command, with only the address changed (the test app listens on its own port)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import BASE
from tests.e2e.test_http_api import APP

README = Path(__file__).resolve().parents[2] / "README.md"
HOST = BASE.removeprefix("http://")


def blocks(lang: str) -> list[str]:
    """The README's fenced blocks of ``lang``, between "Talk to it" and the next section."""
    text = README.read_text()
    part = text.split("## Talk to it", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", part, re.S)


def here(text: str) -> str:
    return text.replace("http://127.0.0.1:8000", BASE).replace("localhost:8000", HOST)


@pytest.fixture(scope="module")
def base(deploy) -> str:
    return deploy(APP)


def test_the_readme_python_example_runs_and_answers(base: str) -> None:
    (code,) = blocks("python")
    r = subprocess.run([sys.executable, "-c", here(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # the first print is the collected answer and its finish reason, then the stream's text
    assert re.search(r"\b(stop|length)\b", r.stdout), r.stdout


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, trailing comments dropped."""
    joined = block.replace("\\\n", " ")
    return [re.sub(r"\s{2,}#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def test_every_readme_curl_command_runs_and_gets_a_2xx(base: str) -> None:
    (block,) = blocks("bash")
    cmds = commands(here(block))
    assert len(cmds) >= 3 and all(c.startswith("curl ") for c in cmds), cmds
    for cmd in cmds:
        r = subprocess.run([*shlex.split(cmd), "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (cmd, r.stderr)
        body, _, status = r.stdout.rpartition("\n")
        assert status.startswith("2"), (cmd, status, body[:500])
        assert body.strip(), cmd
        if "stream" in cmd:
            assert "data: [DONE]" in body, body[-500:]
