"""The native layer: one Python owner per llama.cpp handle (principle 4 of the design).

- ``library``: the one copy of ggml in the process, backend init, llama.cpp's log, native errors;
- ``devices``: local and RPC devices, resolved by name; ``model``, ``context``, ``batch``: the owners;
- ``projector``: a model's mtmd projector (images, audio); ``page_cache``: the GGUF's pages of
  offloaded layers released; ``gguf_shape``: a GGUF's header read without loading it.

It imports ``engine.errors`` and ``engine.media`` (the ids a prompt gives media) and nothing
else of the engine: the text layer and the step loop sit above it.
"""

import os

# ggml aborts the process on a lost RPC server (or any GGML_ABORT) and first has gdb print a
# backtrace of it: about 4 s, all of it added to the pause of every stream the lost replica
# resumes elsewhere. Read at the abort (and at load, for its terminate handler);
# PGROUPS_GGML_BACKTRACE=1 keeps the backtrace for a developer.
if os.environ.get("PGROUPS_GGML_BACKTRACE") != "1":
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
