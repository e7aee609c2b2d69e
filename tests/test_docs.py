"""The docs name only things that exist.

- docs/configuration.md lists every `Settings` field as its `AGENT_RFT_*` variable, and names no
  `AGENT_RFT_*` variable that neither `Settings` nor the code reads.
- README.md, docs/*.md and benchmarks/*/README.md name only repository paths that exist (relative
  links resolved from the doc's folder, bare paths such as `workers/methods/reinforcement/update.py` from the
  repository root) and only Python symbols that exist: `path.py::name` (or `path.py::Class.name`),
  a dotted `workers.methods.reinforcement.update.token_logprobs`, and a short `update.token_logprobs` where `update` is
  the name of a module file. Symbols are read with `ast`; nothing is imported.
"""

import ast
import functools
import re
import subprocess
from pathlib import Path

import pytest

from app.core.config import Settings

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*/README.md")])

# Top-level folders whose paths the docs name in plain text.
TOP_DIRS = ("app", "workers", "examples", "benchmarks", "tests", "docs", "scripts", "migrations", "docker")
# Packages whose dotted module paths the docs name.
PACKAGES = ("app", "workers", "examples", "benchmarks")
# Words that are module file names but in the docs mostly name a variable (`client.webhooks`).
SHORT_FORM_SKIP = {"client", "server", "settings", "config", "job", "models", "schemas", "service", "router", "cli",
                   "summary", "data", "metrics", "diagnostics", "state"}

ENV_VAR = re.compile(r"AGENT_RFT_[A-Z0-9_]*[A-Z0-9]")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
BARE_PATH = re.compile(rf"(?<![\w./\-<>])((?:{'|'.join(TOP_DIRS)})/[\w./\-]*)")
PATH_SYMBOL = re.compile(r"(?<![\w./\-])([\w./\-]+\.py)::([A-Za-z_][\w.]*)")
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+$")
SHORT = re.compile(r"^([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)$")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "csv", "txt", "sh", "yml", "yaml", "toml", "cpp", "h", "html", "js",
                 "tar", "gz", "cfg", "ini", "log", "sqlite3", "safetensors", "gguf", "pt", "env"}
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)


# ---- configuration.md and Settings ----

def variables_the_code_reads() -> set[str]:
    names = {f"AGENT_RFT_{name.upper()}" for name in Settings.model_fields}
    for folder in ("app", "workers", "examples", "scripts", "docker", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".sh", ".yml", ".yaml", ""} and "__pycache__" not in path.parts:
                names.update(ENV_VAR.findall(path.read_text(errors="replace")))
    for extra in ("Makefile", "pyproject.toml"):
        if (ROOT / extra).exists():
            names.update(ENV_VAR.findall((ROOT / extra).read_text()))
    return names


def test_configuration_lists_every_setting():
    text = CONFIGURATION.read_text()
    missing = [f"AGENT_RFT_{name.upper()}" for name in Settings.model_fields
               if f"`AGENT_RFT_{name.upper()}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_configuration_names_no_variable_that_is_gone():
    known = variables_the_code_reads()
    unknown = sorted(set(ENV_VAR.findall(CONFIGURATION.read_text())) - known)
    assert not unknown, f"docs/configuration.md names variables nothing reads: {unknown}"


# ---- paths and symbols in the docs ----

@functools.lru_cache(maxsize=None)
def names_in(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module ('' key) and the names each top-level class defines."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    classes: dict[str, set[str]] = {}

    def targets(node: ast.AST) -> set[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, ast.Assign):
            return {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return {node.target.id}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        return set()

    for node in tree.body:
        nodes = [node]
        if isinstance(node, (ast.If, ast.Try)):  # names bound under `if TYPE_CHECKING:` or `try:`
            nodes = list(ast.walk(node))
        for inner in nodes:
            top |= targets(inner)
        if isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for item in node.body:
                members |= targets(item)
            classes[node.name] = members
    return {"": top, **classes}


def symbol_exists(path: Path, dotted_name: str) -> bool:
    parts = dotted_name.split(".")
    names = names_in(path)
    if parts[0] not in names[""]:
        return False
    if len(parts) == 1 or parts[0] not in names:
        return True  # an attribute of a non-class (an instance, an import) is not checked further
    return parts[1] in names[parts[0]]


def module_file(parts: list[str], root: Path) -> Path | None:
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def modules_by_stem(root: Path) -> dict[str, tuple[Path, ...]]:
    found: dict[str, list[Path]] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            if "__pycache__" not in path.parts and path.stem != "__init__":
                found.setdefault(path.stem, []).append(path)
    return {stem: tuple(paths) for stem, paths in found.items()}


def ignored_by_git(path: str, root: Path) -> bool:
    """A path git ignores is something a run writes (a benchmark's results), not a file to find."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root).returncode == 0


def broken_references(text: str, doc: Path, root: Path = ROOT) -> list[str]:
    """What `text` (the content of `doc`) names that does not exist under `root`."""
    problems: list[str] = []
    prose = CODE_BLOCK.sub("", text)  # examples in code blocks are shell or Python, not references

    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on this page
        relative = target.split("#", 1)[0]
        if not (doc.parent / relative).exists():
            problems.append(f"link {target}")

    for path in BARE_PATH.findall(prose):
        path = path.rstrip("./")
        if not (root / path).exists() and not ignored_by_git(path, root):
            problems.append(f"path {path}")

    for path, name in PATH_SYMBOL.findall(prose):
        file = root / path
        if not file.is_file():
            problems.append(f"symbol {path}::{name} (no such file)")
        elif not symbol_exists(file, name):
            problems.append(f"symbol {path}::{name}")

    for span in CODE_SPAN.findall(prose):
        span = span.strip().removesuffix("()")
        if DOTTED.match(span):
            parts = span.split(".")
            for cut in range(len(parts), 0, -1):
                file = module_file(parts[:cut], root)
                if file is not None:
                    rest = ".".join(parts[cut:])
                    if rest and not symbol_exists(file, rest):
                        problems.append(f"symbol {span}")
                    break
            else:
                problems.append(f"module {span}")
            continue
        short = SHORT.match(span)
        if short and short.group(1) not in SHORT_FORM_SKIP and short.group(2) not in FILE_SUFFIXES:
            files = modules_by_stem(root).get(short.group(1))
            if files and not any(symbol_exists(f, short.group(2)) for f in files):
                problems.append(f"symbol {span}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_only_what_exists(doc):
    problems = broken_references(doc.read_text(), doc)
    assert not problems, f"{doc.relative_to(ROOT)} names what does not exist: {problems}"


def test_the_checker_finds_made_up_references():
    doc = ROOT / "docs" / "fake.md"
    fake = "\n".join([
        "See [the tool server](tool-server.md) and [nothing](no-such-page.md#x).",
        "From a benchmark: [ok](../README.md), [gone](../../docs/gone.md).",
        "The update lives in `workers/methods/reinforcement/update.py` and `workers/rl/foo.py`.",
        "`workers/training/sequences.py::token_logprobs` exists, `workers/methods/reinforcement/trainer.py::feedable_prefix` does not.",
        "`workers.methods.reinforcement.update.policy_update` exists, `workers.methods.reinforcement.update.no_such_name` does not,",
        "nor does the module `workers.rl.no_such_module`, nor `app.no_such_package.x`.",
        "`sequences.feedable_prefix` exists, `sequences.made_up` does not; `Trainer._train_step` is not a module.",
        "`workers/methods/reinforcement/trainer.py::Trainer._train_step` exists, `workers/methods/reinforcement/trainer.py::Trainer.nope` does not.",
        "```bash",
        "cat workers/rl/inside_a_code_block.py   # not checked",
        "```",
        "A URL is not a path: https://example.com/docs/x.md, [site](https://example.com/app/x).",
    ])
    assert broken_references(fake, doc) == [
        "link no-such-page.md#x",
        "link ../../docs/gone.md",
        "path workers/rl/foo.py",
        "symbol workers/methods/reinforcement/trainer.py::feedable_prefix",
        "symbol workers/methods/reinforcement/trainer.py::Trainer.nope",
        "symbol workers.methods.reinforcement.update.no_such_name",
        "symbol workers.rl.no_such_module",
        "symbol app.no_such_package.x",
        "symbol sequences.made_up",
    ]


def _listed(section: str, until: str | None = None) -> set[str]:
    text = CONFIGURATION.read_text()
    start = text.index(section)
    table = text[start:text.index(until, start) if until else None]
    return set(re.findall(r"^\| `(\w+)` \|", table, re.M))


@pytest.mark.parametrize("section,until,model", [
    ("## `x_open_model`", "## Structured outputs", "OpenModelOptions"),
    ("## Hyperparameters", "## Supervised jobs", "ReinforcementHyperparameters"),
    ("`method.supervised.hyperparameters`:", "`method.supervised.x_open_model`:", "SupervisedHyperparameters"),
    ("`method.supervised.x_open_model`:", "## DPO jobs", "SupervisedModelOptions"),
    ("`method.dpo.hyperparameters`:", None, "DpoHyperparameters"),
])
def test_configuration_lists_every_option_of_every_method(section, until, model):
    from app.jobs import schemas

    listed, fields = _listed(section, until), set(getattr(schemas, model).model_fields)
    assert listed == fields, f"missing {sorted(fields - listed)}, no longer options {sorted(listed - fields)}"


# A tracker's numbers ("issue" and a number): a reader has no tracker to open; say the point instead.
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
SOURCE_DIRS = ("app", "workers", "tests", "examples", "benchmarks", "scripts", "docs", "migrations", "docker")


def test_no_doc_or_code_cites_an_issue_number():
    # What the check refuses, put together here so that this file cites nothing itself.
    citations = [f"see {word} {number}" for word, number in (("Issue", "#42"), ("issues", "3 and 4"), ("(issue", "7)"))]
    assert all(ISSUE_NUMBER.search(text) for text in citations)
    assert not any(ISSUE_NUMBER.search(text) for text in ("an issue in 2026", "tissue 5", "issued 3 keys"))
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder in SOURCE_DIRS:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".yaml", ".toml")]
    cited = [f"{p.relative_to(ROOT)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             if ISSUE_NUMBER.search(line)]
    assert not cited, cited


def test_the_command_line_page_lists_every_command():
    import typer

    from app.cli import cli

    commands = {c.name for c in typer.main.get_command(cli).commands.values()}
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text[:text.index("## Client commands")]
    listed = {name for row in re.findall(r"^\| (`[^|]+) \|", table, re.M) for name in re.findall(r"`(\w+)`", row)}
    assert listed == commands, f"missing {sorted(commands - listed)}, not commands {sorted(listed - commands)}"



def test_operations_says_what_every_dependency_is_for():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    names = {re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0] for d in wanted if not d.startswith("agent-rft")}
    text = (ROOT / "docs" / "operations.md").read_text()
    described = {name for row in re.findall(r"^\| (.+?) \|", text, re.M) for name in re.findall(r"`([\w.-]+)", row)}
    assert names <= described, f"not described in docs/operations.md: {sorted(names - described)}"
