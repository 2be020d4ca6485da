"""One mutant inside one job process: a meta-path finder that hands Python the mutated source of
exactly one module, compiled under the module's own file name.

Why an import hook (written by hand: cosmic-ray mutates files on disk, one test run at a time): no
file on disk changes, so mutant jobs run side by side in one checkout, the venv's TRL and torch
modules are mutated the same way as ours, and a crash or kill can never leave a mutated file
behind. The mutation itself is cosmic-ray's (``cosmic_ray.mutating.mutate_code``).

``install(spec)`` must run before anything imports the module; the finder refuses a module that
is already imported (it could not replace it). After the job, ``applied(spec)`` says whether the
module really was loaded from the mutated source.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "__mutant__"  # set on the mutated module: the mutant's id


class MutantError(RuntimeError):
    """A mutant that cannot be applied as drawn (the source moved, the occurrence is gone)."""


@dataclass(frozen=True)
class Site:
    """What the hook needs of a mutant: which module, which cosmic-ray operator and occurrence
    (counted over the whole file, cosmic-ray's own numbering), the line it must change, and the
    hash of the source it was drawn from."""

    id: str
    module: str
    operator: str
    occurrence: int
    line: int
    source_sha: str


def source_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _operator(name: str):
    import cosmic_ray.mutating  # noqa: F401  (parso before the plugins: cosmic-ray's provider import order)
    import cosmic_ray.plugins

    return cosmic_ray.plugins.get_operator(name)()


def mutated_source(site: Site, source: str) -> str:
    """``source`` with the one mutation of ``site``; raises ``MutantError`` when the source is not
    the one the mutant was drawn from or the mutation does not land on its line."""
    from cosmic_ray.mutating import mutate_code

    if source_sha(source) != site.source_sha:
        raise MutantError(f"{site.id}: {site.module}'s source changed since the mutant was drawn "
                          f"(sha {source_sha(source)} != {site.source_sha}); draw again")
    code = mutate_code(source, _operator(site.operator), site.occurrence)
    if code is None:
        raise MutantError(f"{site.id}: {site.operator} has no occurrence {site.occurrence} in {site.module}")
    before, after = source.splitlines(), code.splitlines()
    first = next((n for n, (a, b) in enumerate(zip(before, after, strict=False), 1) if a != b), min(len(before), len(after)) + 1)
    if first != site.line:
        raise MutantError(f"{site.id}: the mutation changes line {first} of {site.module}, not line {site.line}")
    return code


class _Loader(importlib.abc.Loader):
    def __init__(self, site: Site, origin: str):
        self.site, self.origin = site, origin

    def create_module(self, spec):  # the default module object
        return None

    def exec_module(self, module) -> None:
        source = Path(self.origin).read_text(encoding="utf-8")
        code = compile(mutated_source(self.site, source), self.origin, "exec", dont_inherit=True)
        setattr(module, MARK, self.site.id)
        exec(code, module.__dict__)  # noqa: S102  (the point: run the mutated module's code)

    def get_source(self, fullname: str) -> str:  # what tracebacks and inspect read: the file as on disk
        return Path(self.origin).read_text(encoding="utf-8")


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, site: Site):
        self.site = site

    def find_spec(self, fullname, path, target=None):
        if fullname != self.site.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise MutantError(f"{self.site.id}: no Python source for {fullname}")
        spec.loader = _Loader(self.site, spec.origin)
        spec.cached = None  # never read or write a .pyc of the mutated module
        return spec


def install(site: Site) -> None:
    """Put the finder first on ``sys.meta_path``: the next import of ``site.module`` runs the mutant."""
    if site.module in sys.modules:
        raise MutantError(f"{site.id}: {site.module} is already imported; install the hook before any import")
    sys.meta_path.insert(0, _Finder(site))


def applied(site: Site) -> bool:
    """Whether ``site.module`` was imported, and from the mutated source."""
    module = sys.modules.get(site.module)
    return module is not None and getattr(module, MARK, None) == site.id
