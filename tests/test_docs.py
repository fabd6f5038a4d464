"""The README and docs/ name what exists (issue 32): every repository file, project module attribute, class
member, setting and relative link they cite is there in the code; the file map puts each top-level file on
its layer in tests/test_structure.py's LAYERS; the README stays a door. All by reading text and `ast`: no
project module is imported.

What counts as a name (inline code spans, plus the paths and train.py settings of code blocks):
- a path whose first part is a repository folder or top-level file (`bench/gpu.py`, `tests/test_break_*.py`,
  `tests/test_x.py::test_y`); other paths (`out/tiny/`, `/ckpt/rm`, `$OUT/gpu.json`) are not the repo's;
- `module.name[.member]` where module is a top-level file (`rollout.NativeEngine`, `train.collect_rollouts`),
  `Class.member` where Class is a top-level project class (`NativeEngine.generate`), and `section.field`
  for the config's sections (`engine.slots`, `loss.tis_cap`); `torch.compile` or `sglang.launch_server`
  name nothing of ours and are left alone, as are file names such as `config.json` or `metrics.jsonl`;
- `key=value` settings in a `train.py` command or a span of settings alone: a TrainConfig field, a
  section's field, or an old key config.MOVED names the new home of;
- a bare identifier with an underscore or an inner capital (`eval_before_rl`, `ScorerQueue`): some
  project source file uses it as a word.
"""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PACKAGES = ("engines",)  # folders of the project's code (tests/test_structure.py's FOLDERS)
# module (a top-level file's name, or a package's "engines.batching") -> its path
PATHS = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")} | {
    f"{p}.{f[:-3]}": f"{p}/{f}" for p in PACKAGES for f in os.listdir(os.path.join(ROOT, p))
    if f.endswith(".py") and f != "__init__.py"}
MODULES = sorted(PATHS)
SHORT = {m.split(".")[-1]: m for m in MODULES if "." in m}  # `batching.ContinuousBatch` in prose: engines.batching's
FOLDERS = ("bench", "configs", "docs", "tests", "tools", *PACKAGES)  # the repository's folders a doc may cite
FILE_EXTENSIONS = {"json", "jsonl", "py", "md", "pt", "png", "safetensors", "jinja", "txt", "tmp", "lock", "parquet"}
README_MAX_LINES = 300  # the before-stop hook's bound (STYLE.md 21 aims at ~250): operator material goes to docs/


def parse(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read())


TREES = {m: parse(path) for m, path in PATHS.items()}


def defined_names(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines: functions, classes, assignments (not imports)."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.If, ast.Try)):  # a definition under `if` or `try` at module level
            names |= defined_names(node.body) | defined_names(getattr(node, "orelse", []))
    return names


CLASSES: dict[str, list[ast.ClassDef]] = {}  # a project class's name -> its definitions (module level)
for _tree in TREES.values():
    for _node in _tree.body:
        if isinstance(_node, ast.ClassDef):
            CLASSES.setdefault(_node.name, []).append(_node)


def members(cls: ast.ClassDef, seen=()) -> set[str]:
    """What a class provides: its body's names, `self.x = ...` in its methods, its project bases' members."""
    names = defined_names(cls.body)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                  and t.value.id == "self"}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in CLASSES and base.id not in seen:
            names |= set().union(*(members(b, (*seen, cls.name)) for b in CLASSES[base.id]))
    return names


def config_class(name: str) -> ast.ClassDef:
    return next(n for n in TREES["config"].body if isinstance(n, ast.ClassDef) and n.name == name)


def settings() -> tuple[set[str], dict[str, set[str]], set[str]]:
    """TrainConfig's fields; each section's fields (section name -> its class's members); config.MOVED's
    literal old keys (its other old keys are every section field's flat name)."""
    train_fields, sections = set(), {}
    for node in config_class("TrainConfig").body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            train_fields.add(node.target.id)
            factory = next((k.value for k in getattr(node.value, "keywords", []) if k.arg == "default_factory"), None)
            if isinstance(factory, ast.Name) and factory.id in CLASSES:
                sections[node.target.id] = set().union(*(members(c) for c in CLASSES[factory.id]))
    moved = next(n.value for n in TREES["config"].body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "MOVED" for t in n.targets))
    old = {k.value for k in moved.keys if isinstance(k, ast.Constant)}
    return train_fields, sections, old


TRAIN_FIELDS, SECTIONS, MOVED_KEYS = settings()
SECTION_FIELDS = set().union(*SECTIONS.values())


def source_words() -> set[str]:
    """Every identifier-like word in the project's Python files (top level, tests, bench, tools, configs)."""
    words = set()
    for path in glob.glob(os.path.join(ROOT, "*.py")) + [p for d in FOLDERS for p in
                                                          glob.glob(os.path.join(ROOT, d, "*.py"))]:
        with open(path) as f:
            words |= set(re.findall(r"[A-Za-z_]\w*", f.read()))
    return words


def doc_spans(path: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line number, text) of each inline code span, and of each line of a fenced code block."""
    prose, block_lines, fenced = [], [], False
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced:
            if block_lines and block_lines[-1][1].endswith("\\"):  # a command continued on the next line
                block_lines[-1] = (block_lines[-1][0], block_lines[-1][1][:-1] + " " + line)
            else:
                block_lines.append((i, line))
            prose.append("")
        else:
            prose.append(line)
    text = "\n".join(prose)  # a span may go on to the paragraph's next line
    spans = [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
             for m in re.finditer(r"`([^`]+)`", text) if "\n\n" not in m.group(1)]
    return spans, block_lines


def check_path(token: str) -> str | None:
    """None if a repository path exists (a glob matches; `::name` is defined in the file), else the problem."""
    path, _, test = token.partition("::")
    if not glob.glob(os.path.join(ROOT, path)):
        return "no such file"
    if test and test not in defined_names(parse(path).body):
        return f"{path} defines no {test}"
    return None


PATH_RE = re.compile(r"[\w.*-]+(/[\w.*-]*)+(::\w+)?")


def repo_paths(text: str) -> list[str]:
    tokens = [t.strip(",;:()'\"") for t in text.split()]
    return [t for t in tokens if PATH_RE.fullmatch(t) and (t.split("/")[0] in FOLDERS
                                                           or t.split("/")[0] in set(PATHS.values()))]


DOTTED_RE = re.compile(r"(?<![\w./$-])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)")


def check_dotted(first: str, rest: list[str]) -> str | None:
    """None if first.rest names something of ours that exists (or nothing of ours), else the problem."""
    if rest[-1] in FILE_EXTENSIONS:  # a file name: ours must exist, a checkpoint's or a run folder's are not ours
        name = ".".join([first, *rest])
        return None if rest[-1] != "py" or first not in PATHS or os.path.exists(os.path.join(ROOT, name)) \
            else f"no file {name}"
    if first in SECTIONS and rest[0] in SECTIONS[first] and len(rest) == 1:
        return None
    if first in PACKAGES and f"{first}.{rest[0]}" in PATHS:  # engines.batching.ContinuousBatch
        first, rest = f"{first}.{rest[0]}", rest[1:]
        if not rest:
            return None
    first = SHORT.get(first, first)
    if first in MODULES:
        scope = defined_names(TREES[first].body)
        if rest[0] not in scope:
            return f"{PATHS[first]} defines no {rest[0]}"
        classes = [n for n in TREES[first].body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
        if classes and len(rest) > 1 and rest[1] not in set().union(*map(members, classes)):
            return f"{first}.{rest[0]} has no {rest[1]}"
        return None
    if first in CLASSES and rest[0] not in set().union(*map(members, CLASSES[first])):
        return f"class {first} has no {rest[0]}"
    if first in SECTIONS:
        return f"the {first} section has no field {rest[0]}"
    return None


SETTING_RE = re.compile(r"([a-z_][a-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?=(?!=)\S*")
PLACEHOLDERS = {"key=value", "section.field=value"}  # how the command line spells a setting, in general


def check_setting(token: str) -> str | None:
    if token in PLACEHOLDERS:
        return None
    key, field = SETTING_RE.fullmatch(token).groups()
    if field is None:
        return None if key in TRAIN_FIELDS | MOVED_KEYS | SECTION_FIELDS else f"no setting {key}"
    return None if field in SECTIONS.get(key, ()) else f"no setting {key}.{field}"


def settings_in(text: str) -> list[str]:
    """The key=value tokens of a train.py command, or of a span of settings alone."""
    tokens = text.split()
    if "train.py" in tokens:
        return [t for t in tokens[tokens.index("train.py") + 1:] if SETTING_RE.fullmatch(t)]
    return tokens if tokens and all(SETTING_RE.fullmatch(t) for t in tokens) else []


def project_like(word: str) -> bool:
    """An identifier that reads as a code name: snake_case, or CamelCase with an inner capital."""
    return "_" in word.strip("_") or bool(re.search(r"[a-z][A-Z]", word))


def test_every_file_name_setting_and_link_the_docs_cite_exists():
    words = source_words()
    problems = []
    for doc in DOC_FILES:
        spans, block_lines = doc_spans(doc)
        for line, text in spans + block_lines:
            problems += [f"{doc}:{line}: `{p}`: {why}" for p in repo_paths(text) if (why := check_path(p))]
            problems += [f"{doc}:{line}: `{s}`: {why}" for s in settings_in(text) if (why := check_setting(s))]
        for line, text in spans:
            for first, rest in DOTTED_RE.findall(text):
                if why := check_dotted(first, rest.split(".")[1:]):
                    problems.append(f"{doc}:{line}: `{first}{rest}`: {why}")
            bare = text.removesuffix("()")
            if re.fullmatch(r"[A-Za-z_]\w*", bare) and project_like(bare) and bare not in words:
                problems.append(f"{doc}:{line}: `{text}`: no project source uses this name")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    seen, out = {}, set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file_and_heading_that_exist():
    problems = []
    for doc in DOC_FILES:
        with open(os.path.join(ROOT, doc)) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else \
                os.path.join(ROOT, doc)
            if not os.path.exists(full):
                problems.append(f"{doc}: ({target}): no such file")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                problems.append(f"{doc}: ({target}): {os.path.relpath(full, ROOT)} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def structure_layers() -> dict[str, int]:
    """tests/test_structure.py's LAYERS, read without importing it (it imports train)."""
    tree = parse(os.path.join("tests", "test_structure.py"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "LAYERS" for t in n.targets))
    return ast.literal_eval(node.value)


def file_map() -> dict[str, list[int]]:
    """docs/files.md: each `x.py` row of a table under a "Layer N" heading -> the layers it is listed on."""
    listed, layer = {}, None
    with open(os.path.join(ROOT, "docs", "files.md")) as f:
        for line in f:
            if line.startswith("#"):
                m = re.match(r"#+ Layer (\d+)\b", line)
                layer = int(m.group(1)) if m else None
            elif layer is not None and (m := re.match(r"\| `([\w/]+)\.py` \|", line)):
                listed.setdefault(m.group(1).replace("/", "."), []).append(layer)
    return listed


def test_the_file_map_lists_each_top_level_file_once_on_its_layer_in_test_structure():
    layers = structure_layers()
    listed = file_map()
    assert set(listed) == set(layers) == set(MODULES), (set(listed) ^ set(layers), set(layers) ^ set(MODULES))
    wrong = {name: (where, layers[name]) for name, where in listed.items() if where != [layers[name]]}
    assert not wrong, f"file -> (layers docs/files.md lists it on, its layer in LAYERS): {wrong}"


def test_the_readme_is_a_door_with_the_two_set_up_commands_ci_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    assert "pip install -r requirements.txt && python train.py configs/tiny.py" in text
    assert "pip install -r requirements-dev.txt && python -m pytest -q" in text
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "pip install -q -r requirements-dev.txt" in ci and "python -m pytest -q" in ci
