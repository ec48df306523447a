"""``augtree bench``: the update-stage benchmark on real workload shapes (workloads, methods, runner, report)."""
