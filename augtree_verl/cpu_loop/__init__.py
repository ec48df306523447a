"""What the full RL loop needs on a laptop, generated here (no download): a tiny model and a long-prompt task.

``task``: a random-weight tiny Llama-architecture model with its own word-level tokenizer, and a verl-format
parquet data set (long prompts, short answers, optionally one system prompt for all rows);
``python -m augtree_verl.cpu_loop.task --out DIR``. ``vision_task``: a tiny random Qwen2.5-VL with its image-only
processor (``vl_processor``) and an image task of drawn shapes; ``image_dataset``: verl's dataset reading images
without torchvision. ``reward``: the tasks' rule rewards (verl's built-in scores for
every other data source). ``environment``: its user replies for the branching agent loop; ``tools``: its tool
and its tokenizer's tool-call syntax (``call <word>``) for verl's agent loops. ``compare``: step times and
curves of runs side by side; ``soak``: the pieces of ``benchmarks/soak.py`` (per-process memory, warnings per
step, its checks).
"""
