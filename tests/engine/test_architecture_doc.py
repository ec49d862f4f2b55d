"""docs/architecture.md and docs/how-a-step-runs.md are true to the code: every path, dotted name
and code name they cite exists.

The page describes the code as it is (STYLE habit 21). A file or module moved, a class renamed, a
function dropped: the page must follow, and this test names what it still cites. What it checks,
from the page's backticked spans:
- a path (``overlap/fetch.py``, ``zinf_fn/io/``, ``tests/engine/test_demand.py``) exists, from the
  repository's root or from ``zinf_fn/`` (the page names the engine's files by their folder);
- a dotted name rooted at a package (``zinf_fn.planner.memory``, ``zf.Config``,
  ``checkpoints.save``) imports and resolves attribute by attribute;
- a code name (``Fetcher``, ``Store.shares_master``, ``lay_out``: an identifier with an upper-case
  letter or an underscore, or ``Name.attr``) is defined by a ``class`` or ``def`` (or assigned at a
  module's top level) somewhere in the packages.
How a step runs cites its names in its diagram too: the diagram's tokens are checked as well.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("zinf_fn", "layers", "checkpoints", "zinf_data", "zinf_cli")
FOLDERS = (*PACKAGES, "tests", "benchmarks", "examples", "docs")
PATH = re.compile(r"[\w.-]+(/[\w.-]+)*(/|\.(py|md|toml|yaml))")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
CODE_NAME = re.compile(r"[A-Za-z]\w*(\.[A-Za-z_]\w*)?")
# Python's and torch's own names the page uses (``torch.optim.AdamW``, ``nn.Module``,
# ``requires_grad``)
OUTSIDE = {"True", "False", "None", "AdamW", "nn.Module", "requires_grad"}


# the page on one step: its diagram (a fenced block) cites the code's names too
STEP_PAGE = "how-a-step-runs.md"


def _cited(page: str = "architecture.md") -> list[str]:
    """The tokens of the page's backticked spans (split at spaces, commas, brackets and colons), and
    of the step page's fenced blocks."""
    text = (ROOT / "docs" / page).read_text()
    spans = re.findall(r"`([^`\n]+)`", text)
    if page == STEP_PAGE:
        spans += re.findall(r"```\n(.*?)```", text, re.S)
    return [
        tok.strip(".") for span in spans for tok in re.split(r"[\s,()\[\]:=<>|{}\"']+", span) if tok
    ]


def _defined_names() -> set[str]:
    """Every class, function and top-level assignment in the packages, also as ``Class.member``."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names.add(path.stem)
            for node in ast.walk(tree):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                if isinstance(node, ast.arg):  # a parameter the page names (``opt_state``)
                    names.add(node.arg)
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)  # a stored field's name (``format_version``)
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        members = _member_names(item)
                        names.update(members)
                        names.update(f"{node.name}.{n}" for n in members)
            for node in tree.body:
                names.update(_member_names(node))
    return names


def _member_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] == "zf":
        parts[0] = "zinf_fn"
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_cited_path_exists():
    paths = {tok for tok in _cited() if "/" in tok and PATH.fullmatch(tok)}
    missing = sorted(
        p for p in paths if not (ROOT / p).exists() and not (ROOT / "zinf_fn" / p).exists()
    )
    assert len(paths) > 30  # the page cites the folders and files of every part
    assert not missing, f"docs/architecture.md cites paths that do not exist: {missing}"


def test_every_cited_dotted_name_resolves():
    dotted = {
        tok for tok in _cited() if DOTTED.fullmatch(tok) and tok.split(".")[0] in (*PACKAGES, "zf")
    }
    dotted = {tok for tok in dotted if not tok.endswith((".py", ".md"))}
    missing = sorted(d for d in dotted if not _resolves(d))
    assert dotted
    assert not missing, f"docs/architecture.md cites names that do not resolve: {missing}"


def test_every_cited_code_name_is_defined():
    defined = _defined_names()
    candidates = {tok for tok in _cited() if CODE_NAME.fullmatch(tok) and "/" not in tok}
    code = {
        tok
        for tok in candidates
        if tok.split(".")[0] not in (*PACKAGES, "zf", "torch", "config", "state", "self")
        and (any(c.isupper() for c in tok) or "_" in tok)
        and not tok.isupper()
    }
    missing = sorted(
        tok for tok in code - OUTSIDE if tok not in defined and tok.split(".")[-1] not in defined
    )
    assert len(code) > 20
    assert not missing, f"docs/architecture.md cites code names defined nowhere: {missing}"


def test_how_a_step_runs_cites_what_exists():
    """docs/how-a-step-runs.md: every path, dotted name and code name of its text and its diagram
    exists (the same rules as the architecture page's)."""
    cited = _cited(STEP_PAGE)
    paths = {tok for tok in cited if "/" in tok and PATH.fullmatch(tok)}
    missing = sorted(
        p for p in paths if not (ROOT / p).exists() and not (ROOT / "zinf_fn" / p).exists()
    )
    assert not missing, f"docs/{STEP_PAGE} cites paths that do not exist: {missing}"
    dotted = {
        tok for tok in cited if DOTTED.fullmatch(tok) and tok.split(".")[0] in (*PACKAGES, "zf")
    }
    unresolved = sorted(d for d in dotted if not d.endswith((".py", ".md")) and not _resolves(d))
    assert not unresolved, f"docs/{STEP_PAGE} cites names that do not resolve: {unresolved}"
    defined = _defined_names()
    code = {
        tok
        for tok in cited
        if CODE_NAME.fullmatch(tok)
        and "/" not in tok
        and tok.split(".")[0] not in (*PACKAGES, "zf", "torch", "config", "state", "self")
        and (any(c.isupper() for c in tok) or "_" in tok)
        and not tok.isupper()
    }
    undefined = sorted(
        tok for tok in code - OUTSIDE if tok not in defined and tok.split(".")[-1] not in defined
    )
    # the page follows a step through every part: the scans, the fetch, the gradients, the update
    assert len(paths) > 10 and len(code) > 40
    assert not undefined, f"docs/{STEP_PAGE} cites code names defined nowhere: {undefined}"
