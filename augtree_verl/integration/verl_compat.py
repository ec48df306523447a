"""The one place that touches verl 0.9.1's private names (so a verl upgrade has one file to check)."""

from __future__ import annotations


def register_rollout_adapter(rollout_package_base, name: str, adapter_fqdn: str, mode: str = "async") -> None:
    """Name the trainer-side rollout class of backend ``name`` (``get_rollout_class`` reads this table).

    ``rollout_package_base``: the imported ``verl.workers.rollout.base``; ``adapter_fqdn``: "module.Class".
    verl 0.9.1 keeps the table in the private dict ``_ROLLOUT_REGISTRY`` and has no register function.
    """
    rollout_package_base._ROLLOUT_REGISTRY.setdefault((name, mode), adapter_fqdn)
