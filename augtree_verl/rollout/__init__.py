"""Rollout-side parts: verl agent-loop workers and rollout backends."""
