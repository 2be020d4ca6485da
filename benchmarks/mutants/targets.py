"""What the mutation benchmark mutates: the RL path's modules, TRL's GRPOTrainer functions our
trainer runs, and torch's Adam step, enumerated as cosmic-ray mutation sites.

A site is one occurrence of one cosmic-ray operator (``cosmic_ray.plugins``; argument-free core
operators only) in a target module, with the function it sits in (its qualified name, for the stage
map in stages.py), its line, and cosmic-ray's occurrence index over the whole file (what
``mutate_code`` takes). Three filters keep only sites that can tell the doctor something:

- the function filter: TRL's and torch's modules are mutated only inside the functions listed in
  ``TARGETS`` (TRL's ``_generate_and_score_completions`` only between the two lines that compute the
  advantages), never elsewhere in the file;
- instrument lines: a statement of an RL function that only feeds the instruments (it names one of
  ``INSTRUMENT_NAMES``, or sits under an ``if`` on one) is left out: a mutant there blinds the doctor
  instead of breaking the RL path, and the instruments are not what this benchmark mutates;
- the coverage filter (coverage.py on a clean 20-step job, ``executed_lines.json``): a site on a
  line the job never runs is trivially equivalent and would only inflate ``harmless_clean``.

A site's id (``<module>:<qualname>:<operator>:<k>``, k = the k-th site of that operator in that
function) does not change when other functions of the file change, so a draw stays put across
unrelated edits.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from mutants.hook import Site, source_sha

ROOT = Path(__file__).resolve().parents[2]

# Advantage region of TRL 1.16's _generate_and_score_completions: from the unscorable mask to the
# local slice (the lines that turn rewards into advantages; the rest is generation and logging).
TRL_ADVANTAGES = ("unscorable_mask = torch.isnan(rewards_per_func)", "advantages = advantages[process_slice]")


@dataclass(frozen=True)
class Target:
    """A module to mutate; ``functions``: only these qualified names (None: every function), each
    optionally limited to the lines from its first marker to its second (inclusive)."""

    module: str
    functions: dict[str, tuple[str, str] | None] | None = None


TARGETS: tuple[Target, ...] = (
    Target("musique_rl.env.data"),
    Target("musique_rl.env.prompts"),
    Target("musique_rl.env.tasks.musique"),  # the MuSiQue task: its prompt and records (prompts.py delegates here)
    Target("musique_rl.env.retrieval"),
    Target("musique_rl.env.tools"),
    Target("musique_rl.env.tool_formats.hermes"),
    Target("musique_rl.env.parsing"),
    Target("musique_rl.env.rewards"),
    Target("musique_rl.core.generation"),
    Target("musique_rl.core.rollout"),
    Target("musique_rl.core.trainer"),
    # the batch split over processes and micro-batches (core/trainer.py batch_layout calls it)
    Target("musique_rl.core.config", {"TrainSettings.validate": None, "_divisors": None, "nearest_batch_settings": None}),
    Target("musique_rl.core.weight_sync"),
    Target("musique_rl.core.importance"),
    Target("trl.trainer.grpo_trainer", {
        "GRPOTrainer._compute_loss": None,
        "GRPOTrainer._get_per_token_logps_and_entropies": None,
        "GRPOTrainer._generate_and_score_completions": TRL_ADVANTAGES,
    }),
    # The optimizer step: transformers builds torch.optim.AdamW with fused=True on this CPU
    # (optim=adamw_torch_fused; AdamW subclasses Adam in torch 2.13), so the step runs Adam.step ->
    # _init_group -> adam() -> _fused_adam -> the C++ kernel torch._fused_adamw_, which no Python
    # mutant reaches; _single_tensor_adam never runs (coverage). These four are the step's Python.
    Target("torch.optim.adam", {"Adam.step": None, "Adam._init_group": None, "adam": None, "_fused_adam": None}),
)

# Names that mark a statement as the instruments' (see the module docstring).
INSTRUMENT_NAMES = ("instruments", "merge_metrics", "step_clock", "_loss_probes", "probe",
                    "_parity_probe", "_scored_batch", "_rollout_reference", "_observe_importance_sampling",
                    "_read_loss_probes", "_token_sources", "token_sources", "captured_logps", "last_attention",
                    "_sampler_scorer", "observe_reference")


def module_path(module: str) -> Path:
    """The source file of ``module`` without importing it (nor its packages: TRL and torch stay
    unimported in the benchmark's process)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"{module}: package {top} not found")
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base.joinpath(*rest.split(".")).with_suffix(".py") if rest else base / "__init__.py"
    if not path.is_file():
        raise LookupError(f"{module}: no file {path}")
    return path


def short_operator(name: str) -> str:
    return name.split("/", 1)[-1]


@dataclass(frozen=True)
class Mutant:
    """One site of the population: the hook's ``Site`` plus what the tables show."""

    site: Site
    path: str  # the file, as the table names it (relative to the checkout or site-packages)
    qualname: str  # enclosing class/function path, "<module>" at module level
    column: int
    text: str = field(compare=False)  # the source line as it is
    # the body lines (first, last) of the function whose call runs the site (None at module or class
    # level): a def line runs at import, so a site there counts as executed only when the body ran
    body: tuple[int, int] | None = None

    @property
    def id(self) -> str:
        return self.site.id

    @property
    def function(self) -> str:
        return f"{self.site.module}:{self.qualname}"


def _qualname(node) -> str:
    import parso.python.tree as t

    names = []
    obj = node.parent
    while obj is not None:
        if isinstance(obj, t.Function | t.Class) and not isinstance(obj, t.Lambda):
            names.append(obj.name.value)
        obj = obj.parent
    return ".".join(reversed(names)) or "<module>"


def _statement(node):
    """The smallest statement holding ``node`` (a simple statement, or a compound one's header)."""
    obj = node
    while obj.parent is not None and obj.type not in ("simple_stmt", "funcdef", "classdef", "decorated"):
        if obj.parent.type in ("if_stmt", "while_stmt", "for_stmt", "with_stmt", "elif"):
            return obj  # a condition or iterable of a compound statement: itself
        obj = obj.parent
    return obj


def _names(node) -> set[str]:
    out = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.type == "name":
            out.add(n.value)
        stack.extend(getattr(n, "children", ()))
    return out


def _annotation(node) -> bool:
    """Whether ``node`` sits in a type annotation (a parameter's, a return's, a variable's): a
    mutant there changes no behaviour (``from __future__ import annotations``) or fails at import."""
    child, obj = node, node.parent
    while obj is not None:
        if obj.type == "tfpdef" and obj.children.index(child) == 2:  # name ':' annotation
            return True
        if obj.type == "funcdef" and child.get_previous_sibling() is not None \
                and getattr(child.get_previous_sibling(), "value", None) == "->":
            return True
        if obj.type == "annassign" and obj.children.index(child) == 1:
            return True
        if obj.type in ("suite", "file_input"):
            return False
        child, obj = obj, obj.parent
    return False


def _body(node) -> tuple[int, int] | None:
    """The body lines of the function a call of which runs ``node`` (a decorator: the function it
    decorates); None at module or class level."""
    import parso.python.tree as t

    obj = node
    while obj is not None:
        if obj.type == "decorated":
            obj = obj.children[-1]
            break
        if isinstance(obj, t.Function) and not isinstance(obj, t.Lambda):
            break
        if isinstance(obj, t.Class):
            return None
        obj = obj.parent
    if obj is None or obj.type != "funcdef":
        return None
    suite = obj.children[-1]
    first = suite.children[1] if suite.type == "suite" and len(suite.children) > 1 else suite
    return first.start_pos[0], suite.end_pos[0]


def _instrument_line(node) -> bool:
    """Whether the statement holding ``node``, or an ``if`` condition above it, names an instrument."""
    if _names(_statement(node)) & set(INSTRUMENT_NAMES):
        return True
    obj = node.parent
    while obj is not None and obj.type not in ("funcdef", "classdef"):
        if obj.type in ("if_stmt",) and obj.children and _names(obj.children[1]) & set(INSTRUMENT_NAMES):
            return True
        obj = obj.parent
    return False


def _operators() -> list[tuple[str, object]]:
    import cosmic_ray.mutating  # noqa: F401  (parso before the plugins: cosmic-ray's provider import order)
    import cosmic_ray.plugins

    out = []
    for name in cosmic_ray.plugins.operator_names():
        cls = cosmic_ray.plugins.get_operator(name)
        if not cls.arguments():  # VariableReplacer/VariableInserter need a chosen cause and effect
            out.append((name, cls()))
    return out


def _display_path(path: Path) -> str:
    for base in (ROOT, *(Path(p) for p in __import__("site").getsitepackages())):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return str(path)


def _within(target: Target, qualname: str, line: int, lines: list[str]) -> bool:
    if target.functions is None:
        return True
    for fn, region in target.functions.items():
        if qualname != fn and not qualname.startswith(fn + "."):
            continue
        return region is None or line in _region_lines(lines, fn, region)
    return False


_REGIONS: dict[tuple[int, str], range] = {}


def _region_lines(lines: list[str], fn: str, region: tuple[str, str]) -> range:
    key = (id(lines), fn)
    if key not in _REGIONS:
        start = next((n for n, s in enumerate(lines, 1) if region[0] in s), None)
        end = next((n for n, s in enumerate(lines, 1) if region[1] in s and start and n >= start), None)
        if start is None or end is None:
            raise LookupError(f"{fn}: the region markers {region} are not in its file (a TRL upgrade?)")
        _REGIONS[key] = range(start, end + 1)
    return _REGIONS[key]


def sites(targets: tuple[Target, ...] = TARGETS) -> list[Mutant]:
    """Every site of the targets (function and instrument filters applied, coverage not)."""
    from cosmic_ray.ast import ast_nodes, get_ast

    ops = _operators()
    out: list[Mutant] = []
    for target in targets:
        path = module_path(target.module)
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        sha = source_sha(source)
        tree = get_ast(source)
        nodes = list(ast_nodes(tree))
        shown = _display_path(path)
        for op_name, op in ops:
            occurrence = 0
            per_function: dict[str, int] = defaultdict(int)
            for node in nodes:
                for start, _end in op.mutation_positions(node):
                    k = occurrence
                    occurrence += 1
                    qual = _qualname(node)
                    line = start[0]
                    if not _within(target, qual, line, lines) or _annotation(node) or _instrument_line(node):
                        continue
                    n = per_function[qual]
                    per_function[qual] += 1
                    sid = f"{target.module}:{qual}:{short_operator(op_name)}:{n}"
                    out.append(Mutant(Site(sid, target.module, op_name, k, line, sha), shown, qual, start[1],
                                      lines[line - 1].strip() if line <= len(lines) else "", _body(node)))
    return out


def executed(mutant: Mutant, lines: set[int]) -> bool:
    """Whether a job whose executed lines are ``lines`` (of the mutant's file) runs the site: its
    line ran, and so did the body of the function it belongs to (module/class level: the line alone)."""
    if mutant.site.line not in lines:
        return False
    return mutant.body is None or any(n in lines for n in range(mutant.body[0], mutant.body[1] + 1))


def target_files(targets: tuple[Target, ...] = TARGETS) -> dict[str, Path]:
    return {t.module: module_path(t.module) for t in targets}


def definitions(module: str) -> set[str]:
    """Qualified names of every class and function of ``module`` (and "<module>")."""
    import parso.python.tree as t
    from cosmic_ray.ast import ast_nodes, get_ast

    out = {"<module>"}
    for node in ast_nodes(get_ast(module_path(module).read_text(encoding="utf-8"))):
        if isinstance(node, t.Function | t.Class) and not isinstance(node, t.Lambda):
            out.add(_qualname(node.name))  # the name's parents: the definition itself and its scopes
    return out
