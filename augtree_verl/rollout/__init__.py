"""Rollout for the full RL loop: ``hf``, a CPU rollout backend for verl (Hugging Face generation in a Ray actor).

``hf`` (registered by ``augtree_verl.integration``, selected with ``actor_rollout_ref.rollout.name=hf``) exists
so the loop runs without a GPU; vLLM stays the rollout on GPUs. ``sampling``: the seeded decoder;
``hf_server``: the server actor; ``hf``: the replica (driver side) and the weight-sync adapter (worker side).
"""
