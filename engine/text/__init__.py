"""The text layer: what turns messages into tokens and tokens back into an answer.

Chat templates (``chat``), the tokenizer and prompt limits (``tokenizer``), fill-in-the-middle
prompts (``infill``), grammars and JSON schemas (``grammar``), tools into the prompt (``tools``), tool calls
(``tool_calls``) and reasoning (``reasoning``) parsed from an answer, incremental detokenisation with stop strings
(``stream``). The ingress imports it to make prompts and shape answers; the engine imports it
for its tokenizer, grammars and streams.

It imports ``engine.errors`` and the native layer (``engine.native``: a vocabulary, llama.cpp's
template engine) and nothing else of the engine.
"""
