"""Rollout-side parts: the CPU rollout backend ``hf`` and the agent loop that feeds the planner.

``hf`` (registered by ``registration``, which the ``augtree_trainer`` plugin calls; selected with
``actor_rollout_ref.rollout.name=hf``) exists so the loop runs without a GPU; vLLM stays the rollout on GPUs.
``sampling``: the seeded decoder;
``hf_server``: the server actor; ``hf``: the replica (driver side) and the weight-sync adapter (worker side).
``agent_loop``: the agent-loop manager whose workers report finished groups' lengths to the planner service.
``checkpoint_engine``: the CPU checkpoint engine ``gloo`` (trainer weights to separate_async's rollout pool;
verl imports it through ``rollout.checkpoint_engine.custom_backend_module``).
"""
