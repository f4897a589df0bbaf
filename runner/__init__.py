"""The in-container runner: `python -m runner SPEC` sizes itself to its GPU, trains, survives OOM, exports a model.

Laid out by concept, top layer first: process/, train/, output/ and oom/, sizing/, then model/, data/ and
checkpoint/, over dist.py and internals/ (docs/development.md, "How the code is laid out"; enforced by lint-imports).
"""
