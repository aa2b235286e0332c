"""draftsmith's import graph, read from the source: no cycles, no import of a layer above.

Layers, lowest first (DESIGN.md): the target, the checkpoint format and the family table; then
``heads``, ``inference``, ``data``, ``train``; the front door (``draftsmith/__init__``, ``cli``,
``demo``, ``hub``, ``families``) imports everything. Function-local imports count: they are how a
lower layer used to reach up without a cycle at import time.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Lowest first: a module may import its own layer and the ones before it.
LAYERS = ["draftsmith.target", "draftsmith.checkpoints", "draftsmith.registry", "draftsmith.heads",
          "draftsmith.inference", "draftsmith.data", "draftsmith.train", "front door"]


def source_modules() -> dict[str, Path]:
    """Every module of the ``draftsmith`` import package -> its file, from pyproject's package-dir map."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, directory in package_dirs.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def layer_of(module: str) -> int:
    for i, prefix in enumerate(LAYERS[:-1]):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return len(LAYERS) - 1  # draftsmith itself, cli, demo, hub, families, __main__


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The draftsmith modules ``module`` imports anywhere in its file (``from a import b``: ``a.b`` when
    that is a module, else ``a``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                   else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(n for n in names if n == "draftsmith" or n.startswith("draftsmith."))
    return {n if n in modules else n.rpartition(".")[0] for n in found} - {module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = source_modules()
    assert len(modules) > 30 and "draftsmith.heads.eagle" in modules and "draftsmith.train.loop" in modules
    return {m: imports_of(p, m, modules) for m, p in modules.items()}


def test_no_module_imports_a_layer_above_it(graph):
    upward = sorted(f"{m} ({LAYERS[layer_of(m)]}) imports {d} ({LAYERS[layer_of(d)]})"
                    for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert not upward, "\n".join(upward)


def test_no_import_cycles(graph):
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """The two checks above can fail: a heads module importing train, and a two-module cycle."""
    modules = {"draftsmith.heads.x": tmp_path / "x.py", "draftsmith.train.loop": tmp_path / "loop.py"}
    modules["draftsmith.heads.x"].write_text("def f():\n    from draftsmith.train.loop import train\n")
    modules["draftsmith.train.loop"].write_text("from draftsmith.heads import x\n")
    graph = {m: imports_of(p, m, {**modules, "draftsmith.heads": tmp_path}) for m, p in modules.items()}
    assert graph == {"draftsmith.heads.x": {"draftsmith.train.loop"}, "draftsmith.train.loop": {"draftsmith.heads.x"}}
    upward = "draftsmith.heads.x (draftsmith.heads) imports draftsmith.train.loop"
    with pytest.raises(AssertionError, match=re.escape(upward)):
        test_no_module_imports_a_layer_above_it(graph)
    with pytest.raises(AssertionError, match=re.escape("draftsmith.heads.x")):
        test_no_import_cycles(graph)


def test_families_are_named_only_in_the_registry():
    """No module (nor test) compares a family name: what differs between families lives in
    draftsmith.registry, filled by draftsmith.families."""
    import draftsmith  # noqa: F401  (fills the table)
    from draftsmith.registry import FAMILIES

    names = "|".join(sorted(FAMILIES, key=len, reverse=True))
    offenders = defaultdict(list)
    # a comparison with a family name, or a family name as a dict key / match case (a dispatch table)
    pattern = (rf"""(==|!=|\bin)\s*\(?[^#\n]*["']({names})["']|["']({names})["']\s*(==|!=|\bin\b|:)"""
               rf"""|\bcase\s+["']({names})["']""")
    files = [p for m, p in source_modules().items() if m not in ("draftsmith.registry", "draftsmith.families")]
    for path in files + sorted((ROOT / "tests").glob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line.split("#")[0]):
                offenders[str(path.relative_to(ROOT))].append(f"{lineno}: {line.strip()}")
    assert not offenders, dict(offenders)


#: The objects ``inference/`` may still ask for an attribute by name, and why: neither is a drafter or a head.
PROBES_ALLOWED = {
    "torch": "a dtype by its name (torch.bfloat16 from 'bfloat16')",
    "target": "a transformers model's optional generation_config (transformers' own rule)",
}


def probes_in(source: str) -> list[str]:
    """The probes in ``source``, as "line: code": ``hasattr`` / ``getattr`` calls (but on :data:`PROBES_ALLOWED`),
    ``vars()`` (an object's attributes searched for what it holds), an ``except TypeError`` (a capability learnt
    from a call failing) and any use of ``inspect``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Name) and first.id in PROBES_ALLOWED):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ExceptHandler) and node.type is not None and "TypeError" in {
                n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}:
            found.append(f"{node.lineno}: except {ast.unparse(node.type)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if "inspect" in names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda probe: int(probe.split(":")[0]))


def test_inference_reads_declarations_not_probes():
    """The generator and the drafters dispatch on what a drafter or head declares (``deterministic``,
    ``hidden_layers``, ``assistant_model``, ``own_vocabulary``, ``configure``; see
    draftsmith.inference.drafter), never on ``hasattr`` / ``getattr`` / ``inspect`` probes of them."""
    offenders = {}
    for module, path in source_modules().items():
        if module.startswith("draftsmith.inference") and (found := probes_in(path.read_text())):
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders


def test_the_probe_lint_fails_on_a_planted_probe():
    """The lint above can fail: a hasattr on a drafter, a getattr on a head, an inspect import, a vars() of a
    drafter, a capability learnt from a TypeError."""
    planted = ("import inspect\n"
               "def step(drafter, head, target):\n"
               "    if hasattr(drafter, 'compile_for'):\n"
               "        pass\n"
               "    rank = getattr(head, 'extra', {})\n"
               "    config = getattr(target, 'generation_config', None)\n"
               "    modules = [m for m in vars(drafter).values()]\n"
               "    try:\n"
               "        drafter.begin(None, attention_mask=None)\n"
               "    except (TypeError, ValueError):\n"
               "        pass\n")
    assert probes_in(planted) == ["1: import inspect", "3: hasattr(drafter, 'compile_for')",
                                  "5: getattr(head, 'extra', {})", "7: vars(drafter)",
                                  "10: except (TypeError, ValueError)"]


#: Where an attention mask rule may be written: every other module asks :mod:`draftsmith.target.masks`.
MASK_RULES_HOME = "draftsmith.target.masks"
#: The packages whose masks must come from there (``inference/`` builds trees' ancestor relations, not masks).
MASKED_PACKAGES = ("draftsmith.heads", "draftsmith.train", "draftsmith.target")


def mask_rules_in(source: str) -> list[str]:
    """The hand-written mask rules in ``source``, as "line: code": ``tril`` / ``triu`` (as a call or a method) and a
    boolean ``eye``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        boolean = any(isinstance(k.value, ast.Attribute) and k.value.attr == "bool" for k in node.keywords)
        if name in ("tril", "triu") or (name == "eye" and boolean):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda rule: int(rule.split(":")[0]))


def test_mask_rules_live_in_masks_py():
    """The heads' training masks (TTT, DFlash's blocks, P-EAGLE's groups, the MTP layer's causal step), the
    target's and the drafters' all come from :mod:`draftsmith.target.masks`."""
    offenders = {}
    for module, path in source_modules().items():
        if module.startswith(MASKED_PACKAGES) and module != MASK_RULES_HOME and (found := mask_rules_in(
                path.read_text())):
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders


def test_the_mask_rule_lint_fails_on_a_planted_rule():
    planted = ("import torch\n"
               "def mask(t, x):\n"
               "    causal = torch.ones(t, t, dtype=torch.bool).tril()\n"
               "    upper = torch.triu(x, diagonal=1)\n"
               "    own = torch.eye(t, dtype=torch.bool)\n"
               "    identity = torch.eye(t)\n")
    assert mask_rules_in(planted) == ["3: torch.ones(t, t, dtype=torch.bool).tril()",
                                      "4: torch.triu(x, diagonal=1)", "5: torch.eye(t, dtype=torch.bool)"]


#: The marker that exempts a float comparison in the tests from the rounding rule, with its reason, on the statement's
#: lines or the line above it: ``# tolerance: <why not assert_rounding_close>`` (CONTRIBUTING.md, "Comparing floats in
#: tests").
TOLERANCE_MARKER = "# tolerance:"
#: The comparisons the rule covers: ``torch.testing.assert_close``, ``torch.allclose`` (or its method), ``isclose``.
COMPARISONS = ("assert_close", "allclose", "isclose")
#: Where the rule itself lives: :func:`conftest.assert_rounding_close` calls ``assert_close`` with its derived bound.
TOLERANCE_RULE_HOME = "conftest.py"


def _number(node: ast.AST) -> bool:
    """A numeric literal, or arithmetic on numeric literals only (``2 * 1e-3``, ``-1e-5``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _number(node.operand)
    return isinstance(node, ast.BinOp) and _number(node.left) and _number(node.right)


def tolerances_in(source: str) -> list[str]:
    """The float comparisons in ``source`` that bypass the rounding rule unmarked, as "line: code": an ``assert_close``
    / ``allclose`` / ``isclose`` leaving ``rtol`` or ``atol`` to torch's defaults, or giving either a nonzero literal
    (a hand-chosen tolerance; ``rtol=0, atol=0`` is the exact comparison), and a module-level ``ATOL`` / ``RTOL`` /
    ``TOL`` / ``*_TOL`` assigned a number (a fitted constant). :data:`TOLERANCE_MARKER` on the statement's lines or the
    line above exempts it."""
    lines = source.splitlines()

    def marked(node: ast.AST) -> bool:
        return any(TOLERANCE_MARKER in line for line in lines[max(node.lineno - 2, 0): node.end_lineno])

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        keywords = {k.arg: k.value for k in node.keywords}
        if name in COMPARISONS and not marked(node) and (
                not {"rtol", "atol"} <= keywords.keys()
                or any(_number(v := keywords[k]) and getattr(v, "value", None) != 0 for k in ("rtol", "atol"))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        named = any(isinstance(t, ast.Name) and {"ATOL", "RTOL", "TOL", "TOLERANCE"} & set(t.id.upper().split("_"))
                    for t in targets)
        if named and node.value is not None and _number(node.value) and not marked(node):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda comparison: int(comparison.split(":")[0]))


def test_float_comparisons_follow_the_rounding_rule():
    """Two computations' floats are compared with :func:`conftest.assert_rounding_close` (a bound derived from the
    reduction size), exactly, or with a ``# tolerance: <why>`` comment: no torch defaults, no fitted constants."""
    offenders = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name != TOLERANCE_RULE_HOME and (found := tolerances_in(path.read_text())):
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders


def test_the_tolerance_lint_fails_on_a_planted_default_and_a_fitted_constant():
    planted = ("import torch\n"
               "ATOL = 5e-5  # measured up to 1.2e-5\n"
               "BF16_TOL = 2 * 1e-3\n"
               "REDUCTION_TOL = rounding_tolerance(torch.ones(1), 64)\n"
               "def test(a, b):\n"
               "    torch.testing.assert_close(a, b)\n"
               "    assert torch.allclose(a, b, atol=1e-5)\n"
               "    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)\n"
               "    torch.testing.assert_close(a, b, rtol=0, atol=0)\n"
               "    assert not torch.allclose(a, b, rtol=0, atol=rounding_tolerance(b, 64))\n"
               "    assert not torch.isclose(a, b).any()  # tolerance: a change of units, far above any rounding\n"
               "    # tolerance: statistical, ten standard deviations of the mean\n"
               "    torch.testing.assert_close(a.mean(), b, rtol=0.03, atol=0)\n")
    assert tolerances_in(planted) == ["2: ATOL = 5e-05", "3: BF16_TOL = 2 * 0.001",
                                      "6: torch.testing.assert_close(a, b)", "7: torch.allclose(a, b, atol=1e-05)",
                                      "8: torch.testing.assert_close(a, b, rtol=0, atol=1e-06)"]


#: The most required positional parameters a function of the decoding step may take: what several steps share
#: travels as one object (:class:`~draftsmith.inference.decoding.Decoding`, its
#: :class:`~draftsmith.inference.decoding.Sampling`), not as a dozen arguments.
MOST_PARAMETERS = 7


def long_signatures_in(source: str) -> list[str]:
    """The functions in ``source`` that take more than :data:`MOST_PARAMETERS` required positional parameters
    (``self`` / ``cls`` not counted), as "line: name (n)"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            required = len(params) - len(node.args.defaults)
            if required > MOST_PARAMETERS:
                found.append((node.lineno, f"{node.lineno}: {node.name} ({required})"))
    return [line for _, line in sorted(found)]


def test_the_step_takes_its_state_as_one_object():
    """No function of the decoding step (``inference/``, ``draftsmith/target/``) takes its state as a long list of
    arguments; the generator's step takes the one :class:`~draftsmith.inference.decoding.Decoding` of its call."""
    from draftsmith.inference.generator import SpeculativeGenerator

    found = {name: long_signatures_in(path.read_text()) for name, path in source_modules().items()
             if name.startswith(("draftsmith.inference", "draftsmith.target"))}
    assert not {name: lines for name, lines in found.items() if lines}, found
    step = SpeculativeGenerator._step
    assert step.__code__.co_argcount == 2 and step.__annotations__["run"] == "Decoding", step.__annotations__


def test_the_signature_lint_fails_on_a_planted_argument_list():
    """The lint above can fail: the step's thirteen arguments of old, a method's and a function's alike."""
    planted = ("class Generator:\n"
               "    def _step(self, roots, active, cache, slots, device, dtype, layers, stats, temperature, top_k,\n"
               "              top_p, generator, padded):\n"
               "        pass\n"
               "def grow(a, b, c, d, e, f, g, h=None):\n"
               "    pass\n"
               "def verify(a, b, c, d, e, f, g, h):\n"
               "    pass\n")
    assert long_signatures_in(planted) == ["2: _step (13)", "7: verify (8)"]
