"""What a group keeps of earlier prompts: the KV prefix of its sequences (``prefix``), the prompt
cache of evicted slots' states (``prompt_cache``), and token lists compared (``tokens``).

Each is used by its group's thread only. It imports the values of the engine (``errors``,
``config``, ``media``, ``slots``) and the native layer, never the step loop.
"""
