"""Run a callback right after a module finishes importing (or now, if it already has).

Why: ``import verl`` loads our ``verl.plugins`` entry point, but registering an engine needs
``verl.workers.engine``, whose import takes seconds and resolves verl's platform at module level. Doing that
inside ``import verl`` would make every verl process slower and would fix the platform before later plugins
(or the user) could register theirs. Instead the registration runs when verl itself imports its engines.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable

_callbacks: dict[str, list[Callable]] = {}


def after_import(module_name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once ``module_name`` is fully imported; at once if it already is."""
    module = sys.modules.get(module_name)
    if module is not None and not _is_initializing(module):
        callback(module)
        return
    _callbacks.setdefault(module_name, []).append(callback)
    if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _is_initializing(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds watched modules with the ordinary path finder and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PostImportLoader(spec.loader, fullname)
        return spec


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader, fullname: str):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in _callbacks.pop(self._fullname, []):
            callback(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
