"""Helpers that build verl engines, configs and batches for tests, benchmarks and GPU checks.

``harness``: verl's real engines on CPU (our CPU platform, gloo, a tiny Qwen2) and GRPO batches of random
groups; ``verl_batch``: verl's V1 batch from plain rows and the response part of an engine's outputs.
Importing them has no side effects: ``harness.use_cpu_platform()`` selects the CPU platform explicitly.
"""
