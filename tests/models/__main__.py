"""``python -m tests.models``: the default synthetic model and its projector, into ``models/``."""

from tests.models import ensure_synthetic_model

print(ensure_synthetic_model())
