"""``import zerofit.deepspeed.alias``: from this line on, ``deepspeed`` is zerofit's.

::

    import zerofit.deepspeed.alias          # the one line added at the top of a DeepSpeed script
    import deepspeed                        # zerofit.deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
    import deepspeed.comm as dist

The name says what the line does, and nothing more: it makes ``deepspeed`` an alias of the package it sits
in, ``zerofit.deepspeed``, for every later import in the process, the script's own and those of the modules
it imports (DeepSpeed-Chat's ``dschat.utils``). Importing it is the whole act (as ``import readline`` or
setuptools' ``distutils`` hack), so the line needs no call and cannot be half-done; :func:`install` and
:func:`uninstall` exist for code that wants to do it by hand. ``zerofit deepspeed train.py ...`` installs it
before running an unmodified script.

[Note: the deepspeed alias]
A finder at the front of ``sys.meta_path`` answers every import of ``deepspeed`` and ``deepspeed.<path>``
with zerofit's module for it (``zerofit.deepspeed.names.zerofit_module``), the *same module object* under
both names, so a module's state (``zero``'s engines, the accelerator) is one; or it raises
``UnsupportedModule`` naming the DeepSpeed module zerofit does not provide. It never falls through to the
real DeepSpeed, installed or not: DeepSpeed's modules import each other as ``deepspeed.*`` and would get a
mixture of the two. For the same reason the alias refuses to install once the real DeepSpeed is imported
(``sys.modules['deepspeed']`` is another module): the line goes before anything that imports DeepSpeed.

The loader hands importlib the zerofit module in ``create_module`` and restores its own ``__spec__`` in
``exec_module`` (importlib writes the alias's spec onto the module between the two); its ``__name__``,
``__file__`` and ``__path__`` stay zerofit's. ``importlib.metadata.version("deepspeed")`` still reads the
installed DeepSpeed's metadata, if any (``deepspeed.__version__`` is zerofit's, ``0.19.8+zerofit``).
Processes started with the ``spawn`` method (``multiprocessing``, a DataLoader with
``multiprocessing_context="spawn"``) start without the alias unless the script has the line; forked ones
(Linux's default) inherit it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

from zerofit.deepspeed.names import is_deepspeed_name, unsupported_module, zerofit_module

__all__ = ["install", "uninstall", "installed"]


class _DeepSpeedAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """[Note: the deepspeed alias]"""

    def find_spec(self, fullname, path=None, target=None):
        if not is_deepspeed_name(fullname):
            return None
        name = zerofit_module(fullname)
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise unsupported_module(fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=found.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(zerofit_module(spec.name))
        spec.loader_state = module.__spec__  # restored by exec_module
        return module

    def exec_module(self, module) -> None:
        alias_spec = module.__spec__
        module.__spec__ = alias_spec.loader_state


_finder = _DeepSpeedAlias()


def installed() -> bool:
    return _finder in sys.meta_path


def install() -> None:
    """Make ``deepspeed`` (and every ``deepspeed.*``) resolve to zerofit's; nothing to do when installed."""
    if installed():
        return
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not loaded.__name__.startswith("zerofit.deepspeed"):
        raise ImportError(
            f"the real DeepSpeed is imported already ({getattr(loaded, '__file__', loaded)!r}), before "
            "zerofit.deepspeed.alias: the two would be mixed. Put `import zerofit.deepspeed.alias` at the top of "
            "the script, before any import that imports deepspeed (or run it with `zerofit deepspeed script.py`)"
        )
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Remove the alias and the ``deepspeed.*`` names it put in ``sys.modules`` (zerofit's modules stay)."""
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n, m in sys.modules.items() if is_deepspeed_name(n)]:
        module = sys.modules[name]
        if module is None or getattr(module, "__name__", "").startswith("zerofit.deepspeed"):
            del sys.modules[name]


install()
