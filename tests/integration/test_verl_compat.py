"""verl's internals live in ``integration/verl_compat.py`` only, that module checks verl's version, the verl
internals it names still exist in the installed verl, and it lists every public verl name the other modules
use (``VERL_NAMES``), each of which exists in the installed verl.

The scan reads every module of ``augtree_verl`` (but ``verl_compat.py`` and ``testing/``) and reports:
- any attribute starting with ``_`` of a name imported from verl (``EngineConfig.__post_init__``, ``verl._x``),
  and any private name imported from verl;
- ``x._name`` for a private name verl defines and our package does not (``registry._engines``,
  ``worker_group._dispatch_info``), except ``super()._name`` inside an override listed in
  ``verl_compat.PRIVATE_OVERRIDES``;
- a method of a verl subclass that overrides a verl private name not listed in ``PRIVATE_OVERRIDES``;
- ``object.__setattr__`` (a detour around verl's frozen config fields) in a module that imports verl;
- a monkeypatch: ``x.name = ...`` or ``setattr(x, "name", ...)`` (x not ``self``/``cls``) where ``name`` is a
  module-level name of verl's, and verl's own dunder keys (``"__rollout_n__"``) as string literals;
- and, over every module but ``verl_compat.py`` (``testing/`` included), every verl name it imports or reads
  from a verl module, against ``verl_compat.VERL_NAMES`` (nothing unlisted, nothing stale).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import augtree_verl
from augtree_verl.integration import verl_compat

PACKAGE = Path(augtree_verl.__file__).parent
EXEMPT = (PACKAGE / "integration" / "verl_compat.py", PACKAGE / "testing")
# Dunders of any object that say nothing about verl's internals.
METADATA_DUNDERS = {"__name__", "__qualname__", "__module__", "__doc__", "__version__", "__file__", "__class__"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(tree: ast.AST, skip: set[int] = frozenset()) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes, parameters."""
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _is_private(n)}


def _verl_bound_names(tree: ast.AST) -> set[str]:
    """Local names a module binds to verl modules or objects."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "verl":
                    bound.add(alias.asname or "verl")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "verl":
            bound.update(alias.asname or alias.name for alias in node.names)
    return bound


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _base_root(base: ast.AST) -> str | None:
    """The name a base class comes from; for ``verl_compat.ray_actor_class(X)`` (a Ray actor's Python class), X's."""
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr == "ray_actor_class":
        return _root_name(base.args[0]) if base.args else None
    return _root_name(base)


def _verl_subclasses(tree: ast.AST, verl_names: set[str]) -> list[ast.ClassDef]:
    """verl subclasses, and our mixins that some class of the package combines with a verl class."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (node.name in _verl_mixins() or any(_base_root(base) in verl_names for base in node.bases))
    ]


@functools.cache
def _verl_mixins() -> frozenset[str]:
    """Names of the package's classes that stand beside a verl class in some class's bases."""
    mixins = set()
    for tree in _package_modules().values():
        verl_names = _verl_bound_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_base_root(b) in verl_names for b in node.bases):
                mixins |= {_base_root(b) for b in node.bases if _base_root(b) not in verl_names} - {None}
    return frozenset(mixins)


def _overrides(tree: ast.AST, verl_private: set[str]) -> list[ast.FunctionDef]:
    """Methods of verl subclasses named like a verl private name."""
    verl_names = _verl_bound_names(tree)
    return [
        item
        for cls in _verl_subclasses(tree, verl_names)
        for item in cls.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in verl_private
    ]


# Roots whose attributes are never verl's, whatever verl names privately too (torch.ops.aten._flash_attention_*).
NOT_VERL = {"torch"}


def _is_super_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _attributes(tree: ast.AST, function: str | None = None):
    """(attribute node, name of the innermost function around it) for every attribute in ``tree``."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Attribute):
            yield child, function
        inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        yield from _attributes(child, inner)


def private_verl_uses(
    tree: ast.AST, verl_private: set[str], own_private: set[str], overrides: set[str]
) -> list[tuple[int, str]]:
    """(line, what) for each use of a verl private name in one module (see the module docstring)."""
    verl_names = _verl_bound_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "verl":
            parts = node.module.split(".") + [alias.name for alias in node.names]
            found += [(node.lineno, f"imports verl private {p}") for p in parts if p.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, f"imports verl private {alias.name}")
                for alias in node.names
                if alias.name.split(".")[0] == "verl" and any(p.startswith("_") for p in alias.name.split("."))
            ]
    for method in _overrides(tree, verl_private):
        if method.name not in overrides:
            found.append((method.lineno, f"overrides verl's {method.name} (not in PRIVATE_OVERRIDES)"))
    for node, function in _attributes(tree):
        if _root_name(node.value) in verl_names and node.attr.startswith("_") and node.attr not in METADATA_DUNDERS:
            found.append((node.lineno, f"{_root_name(node.value)}....{node.attr} of a verl import"))
        elif (
            _is_private(node.attr)
            and node.attr in verl_private
            and node.attr not in own_private
            and _root_name(node.value) not in NOT_VERL
        ):
            # An override may call the method it overrides.
            if not (_is_super_call(node.value) and node.attr in overrides and function == node.attr):
                found.append((node.lineno, f".{node.attr}: a verl private name"))
    if verl_names:
        found += [
            (node.lineno, "object.__setattr__ around verl's frozen config fields")
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr == "__setattr__"
            and isinstance(node.value, ast.Name)
            and node.value.id == "object"
        ]
    return sorted(set(found))


@pytest.fixture(scope="module")
def verl_trees() -> list[ast.AST]:
    """Every module of the installed verl, parsed once for the scans below."""
    trees = []
    for path in _package_root("verl").rglob("*.py"):
        try:
            trees.append(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
    return trees


@pytest.fixture(scope="module")
def verl_private(verl_trees) -> set[str]:
    return set().union(*(_defined_private_names(tree) for tree in verl_trees))


def _package_modules() -> dict[Path, ast.AST]:
    return {
        path: ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == e or e in path.parents for e in EXEMPT)
    }


def _own_private(modules: dict[Path, ast.AST], verl_private: set[str]) -> set[str]:
    """Private names our package defines itself (overrides of verl's names are verl's)."""
    own = set()
    for tree in modules.values():
        own |= _defined_private_names(tree, skip={id(m) for m in _overrides(tree, verl_private)})
    return own


def test_no_module_but_verl_compat_touches_a_verl_private_name(verl_private):
    modules = _package_modules()
    own = _own_private(modules, verl_private)
    overrides = set(verl_compat.PRIVATE_OVERRIDES)
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path, tree in modules.items()
        for line, what in private_verl_uses(tree, verl_private, own, overrides)
    ]
    assert not found, "verl private names outside integration/verl_compat.py:\n" + "\n".join(found)
    # The list of overrides stays honest: each is overridden somewhere, and each is a verl private name.
    overridden = {m.name for tree in modules.values() for m in _overrides(tree, verl_private)}
    assert overridden == overrides


PLANTED = {
    "dunder of a verl class": "from verl.workers.config.engine import EngineConfig\n"
    "def f(self):\n    EngineConfig.__post_init__(self)\n",
    "registry dict": "def f(registry):\n    return registry._engines\n",
    "dispatch cache": "def f(wg):\n    return wg._dispatch_info['actor']\n",
    "private of a verl module": "import verl.utils.device as device\nx = device._hidden\n",
    "private import": "from verl.trainer.ppo.v1.trainer_base import _private_helper\n",
    "unlisted override": "from verl.trainer.ppo.v1 import PPOTrainerSync\n"
    "class T(PPOTrainerSync):\n"
    "    def _get_required_batch_multiple(self, dp_size):\n        return 1\n",
    "super() of a private name": "from verl.trainer.ppo.v1 import PPOTrainerSync\n"
    "class T(PPOTrainerSync):\n    def f(self):\n"
    "        return super()._get_required_batch_multiple(2)\n",
    "frozen-field detour": "from verl.workers.config import FSDPEngineConfig\n"
    "def f(c):\n    object.__setattr__(c, 'strategy', 'x')\n",
}
CLEAN = (
    "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead\n"
    "class E(FSDPEngineWithLMHead):\n"
    "    def _build_fsdp_module(self, module):\n        return super()._build_fsdp_module(module)\n"
    "    def _mine(self):\n        self._counts = 1\n        return self._counts, self.__class__.__name__\n"
)


@pytest.mark.parametrize("what", sorted(PLANTED))
def test_the_scan_catches_a_planted_violation(verl_private, what):
    tree = ast.parse(PLANTED[what])
    assert private_verl_uses(tree, verl_private, {"_mine"}, set(verl_compat.PRIVATE_OVERRIDES)), what


def test_the_scan_passes_listed_overrides_and_our_own_names(verl_private):
    tree = ast.parse(CLEAN)
    assert "_counts" in verl_private  # a name both define: ours where our module defines it
    own = _defined_private_names(tree, skip={id(m) for m in _overrides(tree, verl_private)})
    assert private_verl_uses(tree, verl_private, own, set(verl_compat.PRIVATE_OVERRIDES)) == []


def _pretend_verl(monkeypatch, version: str) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "verl" else real(name))


def test_another_verl_version_raises_naming_both(monkeypatch):
    monkeypatch.delenv(verl_compat.ALLOW_VERSION_ENV, raising=False)
    _pretend_verl(monkeypatch, "0.9.2")
    with pytest.raises(verl_compat.VerlVersionError) as err:
        verl_compat.check_verl_version()
    message = str(err.value)
    assert "verl 0.9.1" in message and "verl 0.9.2 is installed" in message
    assert f"{verl_compat.ALLOW_VERSION_ENV}=1" in message


def test_the_escape_hatch_turns_it_into_a_warning(monkeypatch):
    monkeypatch.setenv(verl_compat.ALLOW_VERSION_ENV, "1")
    _pretend_verl(monkeypatch, "0.10.0")
    with pytest.warns(RuntimeWarning, match="tested with verl 0.9.1, but verl 0.10.0"):
        verl_compat.check_verl_version()


def test_the_tested_version_passes_silently():
    assert verl_compat.TESTED_VERL == importlib.metadata.version("verl") == "0.9.1"
    verl_compat.check_verl_version()


IMPORT_WITH_OTHER_VERL = """
import importlib.metadata as m
real = m.version
m.version = lambda name: "0.9.2" if name == "verl" else real(name)
import augtree_verl.integration.verl_compat
"""


@pytest.mark.slow  # a subprocess / verl's engines
@pytest.mark.timeout(300)
def test_importing_the_module_checks_the_version():
    env = {k: v for k, v in os.environ.items() if k != verl_compat.ALLOW_VERSION_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_WITH_OTHER_VERL], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode != 0
    assert "VerlVersionError: augtree-verl is tested with verl 0.9.1, but verl 0.9.2 is installed" in done.stderr, (
        done.stderr[-3000:]
    )


# The verl internals verl_compat names exist in the installed verl (catches a changed verl even when the
# version check is waived).


@pytest.mark.slow  # a subprocess / verl's engines
def test_engine_registry_keeps_its_dict_of_devices():
    from verl.workers.engine import EngineRegistry

    assert isinstance(EngineRegistry._engines, dict)
    assert verl_compat.registered_engine_devices(EngineRegistry, "language_model", "augtree") == {"cuda", "cpu"}
    assert verl_compat.registered_engine_devices(EngineRegistry, "language_model", "no-such-backend") == set()


def test_fsdp_engine_config_post_init_only_adds_the_strategy_assertion():
    from verl.workers.config import FSDPEngineConfig

    source = inspect.getsource(FSDPEngineConfig.__post_init__)
    assert "super().__post_init__()" in source and "assert self.strategy in" in source
    with pytest.raises(AssertionError):
        FSDPEngineConfig(strategy="augtree")


def test_the_frozen_field_and_the_overridden_methods_exist():
    from verl.base_config import BaseConfig
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    config = FSDPEngineConfig()
    with pytest.raises(Exception, match="frozen"):
        config.strategy = "fsdp"
    verl_compat.set_frozen_field(config, "strategy", "fsdp")
    assert config.strategy == "fsdp" and "_mutable_fields" in vars(BaseConfig)
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils.dataset.rl_dataset import RLHFDataset

    worker = AgentLoopWorkerTQ.__ray_actor_class__
    owners = {
        "_build_fsdp_module": FSDPEngine,
        "_init_device_mesh": FSDPEngine,
        "_balance_batch": PPOTrainer,
        "_run_prompt": worker,
        "_agent_loop_postprocess": worker,
        "_handle_generating_state": ToolAgentLoop,
        "_process_multi_modal_info": RLHFDataset,
    }
    assert set(owners) == set(verl_compat.PRIVATE_OVERRIDES)
    for name, owner in owners.items():
        method = vars(owner).get(name)  # a classmethod's function is its __func__
        assert callable(getattr(method, "__func__", method)), f"verl's {owner.__name__} has no {name} any more"
    assert callable(vars(PPOTrainer).get("_get_required_batch_multiple"))
    assert 'self.trainer_mode == "sync"' in inspect.getsource(PPOTrainer)


def test_worker_groups_keep_their_dispatch_cache():
    from verl.single_controller.base.worker import Worker
    from verl.single_controller.base.worker_group import WorkerGroup

    assert "self._dispatch_info = {}" in inspect.getsource(WorkerGroup.__init__)
    assert callable(getattr(Worker, "_query_dispatch_info", None))


# ---- verl internals that are not private names: monkeypatches and verl's own dunder keys -----------------
# Dunder names of Python itself (and of the module system), which verl's source also spells as strings.
PYTHON_DUNDERS = (
    set(dir(object))
    | set(dir(type))
    | set(dir(lambda: 0))
    | set(dir(ast))
    | {
        "__main__",
        "__wrapped__",
        "__dataclass_fields__",
        "__version__",
        "__aiter__",
        "__anext__",
        "__path__",
        "__all__",
        "__file__",
    }
)


@pytest.fixture(scope="module")
def verl_module_names(verl_trees) -> set[str]:
    """Names verl's modules bind at module level (functions, classes, assignments, imports)."""
    names = set()
    for tree in verl_trees:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.fixture(scope="module")
def verl_keys(verl_trees) -> set[str]:
    """verl's own dunder string keys (``"__rollout_n__"``): dunder literals of verl's source that are not Python's."""
    keys = set()
    for tree in verl_trees:
        keys |= {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and n.value.startswith("__")
            and n.value.endswith("__")
            and n.value[2:-2].isidentifier()
        }
    return keys - PYTHON_DUNDERS


def verl_internal_uses(tree: ast.AST, verl_module_names: set[str], verl_keys: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each monkeypatch of a verl name (``module.name = ...`` or ``setattr(module, "name", ...)``
    on anything but ``self``/``cls``, ``name`` a module-level name of verl) and each verl dunder key."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and _root_name(node.value) not in ("self", "cls")
            and node.attr in verl_module_names
        ):
            found.append((node.lineno, f"rebinds {node.attr}, a name verl's modules define (a monkeypatch)"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(node.args) >= 2
            and _root_name(node.args[0]) not in ("self", "cls")
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in verl_module_names
        ):
            found.append((node.lineno, f"{node.func.id} of {node.args[1].value}, a name verl's modules define"))
        elif isinstance(node, ast.Constant) and node.value in verl_keys:
            found.append((node.lineno, f"verl's key {node.value!r}"))
    return sorted(set(found))


def test_no_module_but_verl_compat_patches_verl_or_reads_its_keys(verl_module_names, verl_keys):
    assert "__rollout_n__" in verl_keys and "initialize_global_process_group_ray" in verl_module_names
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path, tree in _package_modules().items()
        for line, what in verl_internal_uses(tree, verl_module_names, verl_keys)
    ]
    assert not found, "verl internals outside integration/verl_compat.py:\n" + "\n".join(found)


PLANTED_INTERNALS = {
    "a verl module's function replaced": "def patch(m):\n    m.initialize_global_process_group_ray = None\n",
    "a name verl imported rebound": "def patch(transformer_impl, cls):\n    transformer_impl.CPUOffloadPolicy = cls\n",
    "setattr on a verl module": "def patch(m, f):\n    setattr(m, 'initialize_global_process_group_ray', f)\n",
    "verl's session-count key": "def n(prompt):\n    return prompt.get('__rollout_n__', 1)\n",
}


@pytest.mark.parametrize("what", sorted(PLANTED_INTERNALS))
def test_the_internals_scan_catches_a_planted_one(verl_module_names, verl_keys, what):
    assert verl_internal_uses(ast.parse(PLANTED_INTERNALS[what]), verl_module_names, verl_keys), what


def test_the_internals_scan_passes_our_own_attributes(verl_module_names, verl_keys):
    clean = (
        "class A:\n    def f(self, x):\n        self.config = x\n        x.count = 1\n"
        "if __name__ == '__main__':\n    setattr(A, 'count', 2)\n"
    )
    assert verl_internal_uses(ast.parse(clean), verl_module_names, verl_keys) == []


# ---- every verl name outside verl_compat.py, public ones included ------------------------------------------
# verl's family: verl itself and its TransferQueue package.
VERL_ROOTS = {"verl", "transfer_queue"}


def _is_verl(dotted: str) -> bool:
    return dotted.split(".")[0] in VERL_ROOTS


@functools.cache
def _package_root(root: str) -> Path:
    return Path(importlib.util.find_spec(root).origin).parent


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module (a file or package) of verl's family, read from its files."""
    root, *rest = dotted.split(".")
    path = _package_root(root).joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def verl_names_used(tree: ast.AST) -> set[str]:
    """Every verl name a module uses: what it imports from verl (``verl.x.y.Name``), and the attributes it
    reads of a verl module it imported (``tu.get`` of ``from verl.utils import tensordict_utils as tu``)."""
    names, modules = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_verl(alias.name):
                    names.add(alias.name)
                    if alias.asname:
                        modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _is_verl(node.module):
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                names.add(dotted)
                if _is_module(dotted):
                    modules[alias.asname or alias.name] = dotted
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            names.add(f"{modules[node.value.id]}.{node.attr}")
    return names


def _verl_name_modules() -> dict[str, ast.AST]:
    """Every module of the package but verl_compat.py (testing/ included: it is shipped)."""
    return {
        path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != EXEMPT[0]
    }


def test_every_verl_name_outside_verl_compat_is_listed_there():
    used = {rel: frozenset(verl_names_used(tree)) for rel, tree in _verl_name_modules().items()}
    used = {rel: names for rel, names in used.items() if names}
    listed = {rel: frozenset(names) for rel, names in verl_compat.VERL_NAMES.items()}
    unlisted = {
        rel: sorted(used[rel] - listed.get(rel, frozenset()))
        for rel in used
        if used[rel] - listed.get(rel, frozenset())
    }
    stale = {
        rel: sorted(listed[rel] - used.get(rel, frozenset()))
        for rel in listed
        if listed[rel] - used.get(rel, frozenset())
    }
    assert not unlisted, f"verl names used but not in verl_compat.VERL_NAMES: {unlisted}"
    assert not stale, f"verl_compat.VERL_NAMES lists names no module uses any more: {stale}"


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.slow  # imports verl's engines, trainers and rollouts
@pytest.mark.timeout(300)
def test_every_listed_verl_name_exists_in_the_installed_verl():
    missing = []
    for rel, names in verl_compat.VERL_NAMES.items():
        for dotted in sorted(names):
            try:
                _resolve(dotted)
            except (ImportError, AttributeError) as err:
                missing.append(f"{rel}: {dotted} ({type(err).__name__}: {err})")
    assert not missing, "verl names the package uses that the installed verl lacks:\n" + "\n".join(missing)


def test_the_name_scan_sees_imports_and_module_attributes():
    tree = ast.parse(
        "from verl.utils import tensordict_utils as tu\nimport transfer_queue as tq\n"
        "from verl.workers.config import FSDPEngineConfig\n"
        "def f(td):\n    tq.kv_clear()\n    return tu.get(td, 'x'), FSDPEngineConfig.strategy\n"
    )
    assert verl_names_used(tree) == {
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.get",
        "transfer_queue",
        "transfer_queue.kv_clear",
        "verl.workers.config.FSDPEngineConfig",
    }


def test_freeze_vision_tower_is_read_by_no_verl_module_but_its_config():
    """verl 0.9.1 declares ``actor.freeze_vision_tower`` and reads it nowhere, so both settings train alike on either
    engine (docs/design.md §4) and the engine reads it neither. A verl that starts reading it fails here: the engine
    must then follow what verl does with it."""
    root = Path(importlib.util.find_spec("verl").origin).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "freeze_vision_tower" in p.read_text())
    assert readers == ["workers/config/actor.py"], readers
