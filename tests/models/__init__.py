"""Model files the tests and benchmarks write in seconds, for exact shapes (no weights committed).

- ``synthetic``: a llama-architecture GGUF of any shape (``write_model``), and the other
  architectures the suite needs (hybrid, MoE, MTP);
- ``projector``: an image projector (mmproj) for the synthetic model;
- ``families``: tiny GGUFs of the real architectures users split;
- ``qwen_vl``: a tiny Qwen2-VL or Qwen3-VL pair (text model and M-RoPE projector).

Not part of the product: nothing under ``engine/`` or ``deployments/`` imports this package.
``python -m tests.models`` writes the default synthetic model and its projector into ``models/``.
"""

from __future__ import annotations

from pathlib import Path

from engine.models import MODELS

SYNTHETIC_MODEL = MODELS / "synthetic.gguf"
SYNTHETIC_MMPROJ = MODELS / "synthetic-mmproj.gguf"  # its projector: images (tests/models/projector.py)


def ensure_synthetic_model(path: Path = SYNTHETIC_MODEL) -> Path:
    """The synthetic model, and beside it (for the default path) its image projector."""
    if not path.exists():
        from tests.models.synthetic import write_model

        write_model(path)
    if path == SYNTHETIC_MODEL and not SYNTHETIC_MMPROJ.exists():
        from tests.models.projector import write_projector

        write_projector(SYNTHETIC_MMPROJ)
    return path
