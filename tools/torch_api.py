"""Does torch 2.11, the lent GPU machine's, have every private or FSDP2 name this project's code uses?

The project is developed on a newer torch, whose FSDP2 has more (2.13's FSDPModule.reset_iter_state, which
2.11's lacks, once ended every rollout phase), and whose private modules may differ. This lists, read from torch
2.11's wheel sources (ast, no import), FSDP2's API and the top-level names of every private torch module the
project imports, and checks the project's .py files (ast) against them:
1. every name imported from a torch.distributed.fsdp module or a private torch module (a path part starting with
   "_") exists in that module of 2.11, and every such module imported exists;
2. every attribute the code reads or calls whose name is a member (method, field, property, enum member) of one
   of FSDP2's classes below, in the installed torch or in 2.11, is a member of one of them in 2.11 (so a method
   or private field only a newer torch has is found, whatever object it is reached through);
3. every keyword passed to an FSDPModule method, fully_shard or a policy is one of its parameters in 2.11.
Not checked: torch's compiled ops (torch._grouped_mm, torch._scaled_mm: no Python source to read).

    python tools/torch_api.py            # check the project against tools/torch_api.json
    python tools/torch_api.py --refresh  # re-read those modules from torch 2.11's wheel on PyPI into that file

--refresh reads only those source files, by HTTP range requests into the wheel (check_install's remote_wheel),
not the whole 530 MB wheel. PyPI's torch 2.11.0 wheel is the CUDA 13.0 build the machine has.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = os.path.join(ROOT, "tools", "torch_api.json")
TORCH = "2.11.0"  # the lent GPU machine's torch (its Python: 3.12)
PYTHON = "cp312"
FSDP = "torch.distributed.fsdp"
# FSDP2's modules: where its public API and the state the project touches (distributed.end_phase) are defined
FSDP_MODULES = [FSDP, *(f"{FSDP}._fully_shard{m}" for m in ("", "._fully_shard", "._fsdp_api", "._fsdp_common",
                                                              "._fsdp_state", "._fsdp_param_group",
                                                              "._fsdp_collectives"))]
CLASSES = ["FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "TrainingState", "FSDPState",
           "FSDPStateContext", "FSDPParamGroup", "FSDPCommContext", "AllGatherState", "AllGatherResult"]
FUNCTIONS = ["fully_shard"]
POLICIES = ["MixedPrecisionPolicy", "OffloadPolicy"]  # dataclasses whose fields are fully_shard's options
# members of FSDP2's classes too common to say an FSDP2 object is reached (a Popen's wait, a tensor's device):
# checked like the others, left out of --uses
GENERIC = {"device", "init", "wait", "event", "lazy_init", "modules"}
SKIP_DIRS = {"__pycache__", "out", "node_modules"}  # and every hidden folder (.venv, .git)
STAR = "*"  # a module's names include everything a star import brings: its names are not checked


def tracked_module(name: str) -> bool:
    """A torch module whose names the check reads: FSDP2's, or a private one (a part starting with '_')."""
    parts = name.split(".")
    return parts[0] == "torch" and (name.startswith(FSDP) or any(p.startswith("_") for p in parts[1:]))


def module_files(name: str) -> list[str]:
    """Where module `name` may live in a torch install: 'torch/a/b.py' or 'torch/a/b/__init__.py'."""
    path = name.replace(".", "/")
    return [f"{path}.py", f"{path}/__init__.py"]


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if x.arg not in ("self", "cls")]


def _top_level(body: list[ast.stmt]):
    """A module's top-level statements, those under if / try / with included (a name defined in either branch)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                yield from _top_level(block)


def read_api(sources: dict[str, str]) -> dict:
    """The API in torch sources {module name: text}: each module's top-level names (STAR where it star-imports),
    each class of CLASSES's methods (name -> parameters, an overload's merged) and other members (class-level
    fields, enum members, and every `self.x` a method assigns), and each function of FUNCTIONS's parameters."""
    modules, classes, functions = {}, {}, {}
    for module, text in sorted(sources.items()):
        tree = ast.parse(text)
        names = set()
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in FUNCTIONS \
                    and module.startswith(FSDP):
                functions[node.name] = sorted(set(functions.get(node.name, [])) | set(_params(node)))
        modules[module] = sorted(names)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in CLASSES
                    and module.startswith(FSDP)):
            methods, members = {}, set()
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    methods[node.name] = sorted(set(methods.get(node.name, [])) | set(_params(node)))
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    members.update(t.id for t in targets if isinstance(t, ast.Name))
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                members.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                               and isinstance(t.value, ast.Name) and t.value.id == "self")
            classes[cls.name] = {"methods": dict(sorted(methods.items())), "members": sorted(members - set(methods))}
    return {"modules": modules, "classes": classes, "functions": functions}


def imported_modules(files: list[str]) -> set[str]:
    """The tracked torch modules the files import (tracked_module)."""
    out = set()
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and tracked_module(node.module):
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if tracked_module(a.name))
    return out


def installed_api() -> dict:
    """read_api of the installed torch's FSDP2 modules (this machine's torch, whatever its version)."""
    import torch
    base = os.path.dirname(os.path.dirname(torch.__file__))
    sources = {}
    for module in FSDP_MODULES:
        for path in module_files(module):
            if os.path.exists(os.path.join(base, path)):
                with open(os.path.join(base, path)) as f:
                    sources[module] = f.read()
    return {"torch": torch.__version__, **read_api(sources)}


def wheel_api(modules: set[str], version: str = TORCH) -> dict:
    """read_api of torch==version's wheel on PyPI, reading only the modules' files from it (HTTP range requests);
    a module it does not have is left out (the check then names each import of it)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from check_install import remote_wheel
    with remote_wheel("torch", version, PYTHON) as z:
        have = set(z.namelist())
        sources = {m: z.read(path).decode() for m in sorted(modules) for path in module_files(m) if path in have}
        wheel = z.filename
    return {"torch": version, "wheel": wheel, **read_api(sources)}


def project_files(root: str = ROOT) -> list[str]:
    """The project's .py files (hidden folders, caches and run folders left out)."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x not in SKIP_DIRS)
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def _members(api: dict) -> set[str]:
    return {name for c in api["classes"].values() for name in [*c["methods"], *c["members"]]}


def _call_params(api: dict, name: str) -> list[str] | None:
    """The parameters of a call named `name` that the keyword check reads: an FSDPModule method (what the
    project calls on a sharded module), a function of FUNCTIONS, or a policy's constructor (a dataclass: its
    fields); None for any other name (a generic one, as `wait` or `init`, says nothing of what is called)."""
    if name in api["classes"]["FSDPModule"]["methods"]:
        return api["classes"]["FSDPModule"]["methods"][name]
    if name in api["functions"]:
        return api["functions"][name]
    if name in POLICIES:
        return api["classes"][name]["members"]
    return None


def check_source(text: str, where: str, target: dict, current: dict) -> tuple[list[str], list[str]]:
    """(problems, uses) of one file's FSDP2 names against target's API (torch 2.11's), current being the installed
    torch's: each a line 'where:line: ...'."""
    problems, uses = [], []
    tracked = _members(target) | _members(current)
    have = _members(target)
    for node in ast.walk(ast.parse(text)):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and tracked_module(node.module):
            for a in node.names:
                uses.append(f"{at}: from {node.module} import {a.name}")
                names = target["modules"].get(node.module)
                if names is None:
                    problems.append(f"{at}: {node.module} is not in torch {target['torch']} (or not read: --refresh)")
                elif a.name not in names and STAR not in names:
                    problems.append(f"{at}: {node.module}.{a.name} is not in torch {target['torch']}")
        elif isinstance(node, ast.Import):
            for a in (a for a in node.names if tracked_module(a.name)):
                uses.append(f"{at}: import {a.name}")
                if a.name not in target["modules"]:
                    problems.append(f"{at}: {a.name} is not in torch {target['torch']} (or not read: --refresh)")
        elif isinstance(node, ast.Attribute) and node.attr in tracked:
            if node.attr not in GENERIC and not node.attr.startswith("__"):
                uses.append(f"{at}: .{node.attr}")
            if node.attr not in have:
                problems.append(f"{at}: .{node.attr} is a member of FSDP2's classes in torch {current['torch']}, "
                                f"of none in torch {target['torch']}")
        if isinstance(node, ast.Call) and node.keywords:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            params = _call_params(target, name) if name else None
            for k in node.keywords:
                if params is not None and k.arg is not None and k.arg not in params:
                    problems.append(f"{at}: {name}(..., {k.arg}=...) has no such parameter in torch {target['torch']}")
    order = lambda line: int(line.split(":")[1])  # noqa: E731  ast.walk is breadth-first: back to line order
    return sorted(problems, key=order), sorted(uses, key=order)


def check_project(target: dict, current: dict, files: list[str] | None = None) -> tuple[list[str], list[str]]:
    """check_source over the project's files: (problems, uses)."""
    problems, uses = [], []
    for path in files or project_files():
        with open(path) as f:
            p, u = check_source(f.read(), os.path.relpath(path, ROOT), target, current)
        problems += p
        uses += u
    return problems, uses


def load_snapshot() -> dict:
    with open(SNAPSHOT) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refresh", action="store_true", help=f"re-read the modules from torch {TORCH}'s wheel")
    ap.add_argument("--uses", action="store_true", help="also list every FSDP2 name the project uses, and where")
    args = ap.parse_args()
    if args.refresh:
        api = wheel_api(set(FSDP_MODULES) | imported_modules(project_files()))
        with open(SNAPSHOT, "w") as f:
            json.dump(api, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"read {api['wheel']}: {len(api['modules'])} modules, {len(api['classes'])} classes")
    target, current = load_snapshot(), installed_api()
    problems, uses = check_project(target, current)
    if args.uses:
        print("\n".join(uses))
    print(f"{len(uses)} uses of FSDP2 names and private torch modules in the project's .py files, checked against "
          f"torch {target['torch']} "
          f"({target['wheel']}): " + ("all there" if not problems else f"{len(problems)} missing"))
    print("\n".join(problems))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
