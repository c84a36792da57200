"""The peer's stage: a ggml RPC server process (``server.py``) and the Ray actor that owns it on
the peer node (``actor.py``). The app builder, the engine deployment and the launcher use it;
it imports none of them."""
