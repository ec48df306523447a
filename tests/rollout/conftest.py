from tests.ray_tq import ray_tq  # noqa: F401  (the fixture, for this folder's tests)
