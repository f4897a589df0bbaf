"""Benchmarks that print figures (not timed tests). `bench/gpu/` is the one-command GPU proof suite."""
