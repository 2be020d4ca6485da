"""No module-level mutable state carries a job's data between functions.

A job's data (its config, tracker, records, results) goes through arguments and return values, or
lives in an object its caller owns (the trainer, the rollout engine, the tracker). Read from the
source of every module of the package, so a new global fails here before it can couple two jobs
of one process (a sweep runs its jobs in one process; tests run hundreds):

- a ``global`` statement;
- a function that mutates a module-level name: stores into it (``X[k] = v``, ``X.attr = v``,
  ``del X[k]``), calls a mutating method on it (``X.append``, ``X.update``, ``X.register``...) or
  ``setattr(X, ...)``; a module's own class counts (``Cls.attr = v``), and so do ``cls.attr = v``
  and ``self.items.append(v)`` on a class-level list no instance replaces (class attributes used
  as state);
- a function that writes ``os.environ`` (an environment variable is a process-wide global);
- a function that assigns an attribute of an imported module (monkeypatching a library).

Each allowed exception is listed below with why it holds no job's data. An entry that no longer
matches anything fails too, so the lists stay what the code does. What a syntax check cannot see
stays the reviewer's: state changed through an alias (``d = CACHE; d[k] = v``) or through a
module-level object's own methods other than the container ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "musique_rl"

# Module-level names functions may mutate: plug-in registries, filled while the package imports
# (each plug-in registers itself where it is written: a subclass definition or a decorator) and
# read-only afterwards. They hold which plug-ins exist, the same for every job.
REGISTRIES = {
    "musique_rl.core.faults:FAULTS": "planted faults, registered by Fault.__init_subclass__ at import",
    "musique_rl.env.retrieval:RETRIEVERS": "retrievers, registered by Retriever.__init_subclass__ at import",
    "musique_rl.env.tasks:TASKS": "tasks, registered by Task.__init_subclass__ at import",
    "musique_rl.env.tool_formats:TOOL_FORMATS": "tool formats, registered by ToolFormat.__init_subclass__ at import",
    "musique_rl.env.answer_formats:ANSWER_FORMATS": "answer formats, registered by AnswerFormat.__init_subclass__ at import",
    "musique_rl.doctor.findings:RULES": "the doctor's rules, appended by the @rule decorator at import",
    "musique_rl.base.catalogue:_DECLARED": "the metric declarations, appended by _m() while the catalogue imports",
    "musique_rl.doctor.findings:CHECK_DECLARATIONS": "the checks the rules declare, filled by the @rule decorator at import",
}

# Functions that write os.environ: settings a library reads only from the environment, never a
# job's data passed on to our own functions.
ENV_WRITERS = {
    "musique_rl.env.retrieval:import_pyserini_searcher": "JAVA_HOME and a placeholder OPENAI_API_KEY so pyserini's "
                                                         "JVM and import start (machine set-up, the same for every job)",
    "musique_rl.tracking.store:scoped_environ": "settings libraries read only from the environment (MLflow's "
                                                "request settings, the local launcher's thread counts), set for "
                                                "a block and restored after it",
    "musique_rl.tracking.sink:_restore_fluent_uri": "puts back the $MLFLOW_TRACKING_URI that mlflow.set_tracking_uri "
                                                    "overwrote, so the next job of the process does not inherit it",
}

# Functions that assign attributes of imported library modules: process settings of a library, or
# its state put back as it was.
LIBRARY_SETTINGS = {
    "musique_rl.core.warm_start_builder:deterministic": "torch's fill_uninitialized_memory off while the warm start "
                                                "builds deterministically (a speed setting, not data)",
    "musique_rl.env.retrieval:import_pyserini_searcher": "jnius_config.add_options wrapped while pyserini starts "
                                                         "the JVM, restored in its finally",
    "musique_rl.tracking.sink:_restore_fluent_uri": "puts back MLflow's fluent tracking URI when a job's run ends (it "
                                                    "has no public unset), so the next job of the process starts clean",
}

MUTATORS = {
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add", "discard",
    "difference_update", "intersection_update", "symmetric_difference_update", "sort", "reverse", "register",
    "appendleft", "extendleft", "__setitem__", "__delitem__",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bound(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _imported(node: ast.Import | ast.ImportFrom) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for a in node.names}


def module_level_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(the names a module binds itself at module level, the names it binds by an import there)."""
    names, imported = set(), set()
    for st in _module_statements(tree.body):
        if isinstance(st, ast.Assign):
            for t in st.targets:
                names |= _bound(t)
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign, ast.For)):
            names |= _bound(st.target)
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            imported |= _imported(st)
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(st.name)
    return names, imported


def _module_statements(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run at module level, those under ``if`` / ``try`` / ``for`` / ``with`` included."""
    out = []
    for st in stmts:
        out.append(st)
        if isinstance(st, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            nested = st.body + getattr(st, "orelse", []) + getattr(st, "finalbody", [])
            nested += [s for h in getattr(st, "handlers", []) for s in h.body]
            out += _module_statements(nested)
    return out


def local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> tuple[set[str], set[str]]:
    """(the names a function binds itself, the names it binds by an import inside it)."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v]}
    imported: set[str] = set()
    stack = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
            continue  # its own scope
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            imported |= _imported(n)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        stack.extend(ast.iter_child_nodes(n))
    return names, imported


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _is_environ(node: ast.AST) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _is_class_of_self(node: ast.AST) -> bool:
    """``cls``, ``self.__class__`` or ``type(self)``: a class attribute stored through them is shared state."""
    if isinstance(node, ast.Name):
        return node.id == "cls"
    if isinstance(node, ast.Attribute):
        return node.attr == "__class__"
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


def _mutable(value: ast.AST | None) -> bool:
    """A list, dict or set display, or a call that makes one."""
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque"))


Finding = tuple[str, str, str, str]  # (kind, allow-list key, function, where)


def findings(path: Path, module: str | None = None) -> list[Finding]:
    """Every mutation the module docstring lists, in one module. The allow-list key is
    ``module:name`` for a module-level name, ``module:function`` (top-level function or class) for
    the others."""
    module = module or module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    own, module_imports = module_level_names(tree)
    out: list[Finding] = []

    def check_function(fn: ast.AST, qualname: str, outer_local: set[str], outer_imports: set[str],
                       shared: frozenset[str] = frozenset()) -> None:
        """``shared``: the mutable class attributes of the class ``fn`` is a method of (one object for
        every instance) that no method replaces per instance."""
        names, imports = local_names(fn)
        local = names | imports | outer_local
        imported = imports | outer_imports | (module_imports - names)
        owner = f"{module}:{qualname.split('.')[0]}"

        def add(kind: str, key: str, node: ast.AST, line: int) -> None:
            out.append((kind, key, qualname, f"{path.name}:{line} {qualname}: {ast.unparse(node)}"))

        def mutated(node: ast.AST, line: int, obj: ast.AST) -> None:
            """``node`` (a store target, or a mutating method) changes the object ``obj``."""
            root = _root(node)
            if _is_environ(node):
                add("environ", owner, node, line)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and _is_class_of_self(node.value):
                add("class state", owner, node, line)
            elif (isinstance(obj, ast.Attribute) and obj.attr in shared and isinstance(obj.value, ast.Name)
                  and obj.value.id == "self"):
                add("class state", owner, node, line)
            elif isinstance(root, ast.Name) and root.id not in local and root.id in own:
                add("module state", f"{module}:{root.id}", node, line)
            elif isinstance(root, ast.Name) and root.id in imported and root is not node:
                add("library", owner, node, line)

        stack = list(fn.body) if isinstance(fn.body, list) else [fn.body]
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                check_function(n, f"{qualname}.{getattr(n, 'name', '<lambda>')}", local, imported, shared)
                continue
            if isinstance(n, ast.ClassDef):
                check_class(n, f"{qualname}.{n.name}", local, imported)
                continue
            if isinstance(n, ast.Global):
                add("global", f"{module}:{','.join(n.names)}", n, n.lineno)
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else (
                [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, (ast.Attribute, ast.Subscript)):
                        mutated(el, n.lineno, el.value)
            if isinstance(n, ast.Call):
                if isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
                    mutated(n.func.value, n.lineno, n.func.value)
                elif isinstance(n.func, ast.Name) and n.func.id == "setattr" and n.args:
                    mutated(ast.Attribute(value=n.args[0], attr="<setattr>", ctx=ast.Store()), n.lineno, n.args[0])
            stack.extend(ast.iter_child_nodes(n))

    def check_class(cls: ast.ClassDef, qualname: str, outer_local: set[str], outer_imports: set[str]) -> None:
        per_instance = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"}
        shared = frozenset(name for st in cls.body if isinstance(st, (ast.Assign, ast.AnnAssign)) and _mutable(st.value)
                           for t in (st.targets if isinstance(st, ast.Assign) else [st.target])
                           for name in _bound(t) if name not in per_instance)
        for st in cls.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                check_function(st, f"{qualname}.{st.name}", outer_local, outer_imports, shared)
            elif isinstance(st, ast.ClassDef):
                check_class(st, f"{qualname}.{st.name}", outer_local, outer_imports)

    for st in _module_statements(tree.body):
        if isinstance(st, ast.Global):
            out.append(("global", f"{module}:{','.join(st.names)}", "<module>", f"{path.name}:{st.lineno}"))
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            check_function(st, st.name, set(), set())
        elif isinstance(st, ast.ClassDef):
            check_class(st, st.name, set(), set())
    return out


def all_findings() -> list[Finding]:
    return [f for p in sorted(PKG.rglob("*.py")) for f in findings(p)]


ALLOWED = {"module state": REGISTRIES, "environ": ENV_WRITERS, "library": LIBRARY_SETTINGS}


def test_no_global_statement_and_no_function_mutates_module_state():
    bad = [f"{kind}: {where}" for kind, key, _, where in all_findings() if key not in ALLOWED.get(kind, {})]
    assert not bad, (
        "module-level state mutated at run time (pass the data as an argument or keep it in an object the "
        "caller owns; a plug-in registry or a library setting goes into this test's lists, with why):\n  "
        + "\n  ".join(bad)
    )


def test_every_allowed_entry_is_still_used():
    used = {(kind, key) for kind, key, _, _ in all_findings()}
    stale = [f"{kind}: {key}" for kind, entries in ALLOWED.items() for key in entries if (kind, key) not in used]
    assert not stale, "allowed entries that match nothing any more (remove them): " + ", ".join(stale)


PLANTED = """
import json
import os

CACHE = {}
SEEN = []


class Holder:
    last = None
    history = []
    own = []

    def __init__(self):
        self.own = []

    def log(self, v):
        self.history.append(v)

    def log_own(self, v):
        self.own.append(v)

    @classmethod
    def keep(cls, v):
        cls.last = v

    def keep_too(self, v):
        type(self).last = v


def remember(key, value):
    CACHE[key] = value


def note(v):
    SEEN.append(v)


def bump():
    global COUNTER
    COUNTER = 1


def hold(v):
    Holder.last = v


def export(v):
    os.environ["JOB_VALUE"] = v


def patch():
    json.dumps = None


def local_only(cache=None):
    CACHE = {}
    CACHE["x"] = 1
    seen = []
    seen.append(1)
    cache = cache or {}
    cache["y"] = 2
    holder = Holder()
    holder.last = 3
    os.environ.get("HOME")
"""


def test_the_check_reports_each_kind_and_leaves_locals_alone(tmp_path):
    """Each kind of module state the check names, planted in a scratch module, is reported, in the
    function that does it; names a function binds itself are not module state."""
    path = tmp_path / "planted.py"
    path.write_text(PLANTED)
    got = {(kind, function) for kind, _, function, _ in findings(path, "planted")}
    assert got == {
        ("module state", "remember"), ("module state", "note"), ("module state", "hold"), ("global", "bump"),
        ("class state", "Holder.keep"), ("class state", "Holder.keep_too"), ("class state", "Holder.log"),
        ("environ", "export"),
        ("library", "patch"),
    }
