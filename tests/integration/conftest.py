"""verl's CPU platform for every test here, selected before any test module of this folder imports verl's engines."""

from augtree_verl.testing import harness

harness.use_cpu_platform()
