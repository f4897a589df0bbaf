"""GPU proof suite: `python -m bench.gpu` (see __main__.py); `--smoke` runs it on the CPU."""
