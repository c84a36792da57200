"""Speculative decoding: the drafters (``drafters``: n-gram prompt lookup, a draft model) and a
model's own multi-token-prediction head (``mtp``), each verified by the group's step.

It imports the values of the engine, the native layer, ``engine.cache`` and a step's plan
(``engine.planner``), never the loop that runs the step.
"""
