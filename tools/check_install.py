"""Do this project's pins agree with the pins of the wheels they install, on a Linux CUDA machine?

A CPU install cannot show it: torch's CPU build requires no triton, its CUDA build does (and an
exact NCCL). This reads each pinned wheel's own METADATA (Requires-Dist) for Linux x86_64,
CPython 3.11, and checks every install set's pins against every requirement of every pinned
wheel: a requirement on a package we pin, whose version range our pin is outside of, is a
conflict that pip would refuse (or, installed step by step, would silently move a package). What a
pinned wheel pins exactly (sglang's transformers and kernels) counts as pinned too. It then prints the
NCCL of each known SGLang release against the trainer's, which the weight broadcast needs equal.

    python tools/check_install.py            # check the install sets against tools/wheel_requires.json
    python tools/check_install.py --refresh  # re-read the wheels' METADATA from PyPI into that file

--refresh reads only each wheel's METADATA, by HTTP range requests into the zip (a wheel's
central directory, then the one member), not the whole wheel (torch's is 527 MB).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import urllib.request
import zipfile
from email.parser import Parser

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = os.path.join(ROOT, "tools", "wheel_requires.json")
# the machine the GPU installs are for: Linux x86_64, CPython 3.11 (the README's Python)
TARGET = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
          "python_version": "3.11", "python_full_version": "3.11.7", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix"}
# Each install set: the requirement files one environment installs. Every one must resolve: sglang 0.5.21 pins the
# trainer's torch (and so its NCCL), tokenizers and transformers, so trainer, servers and tests share one environment.
INSTALL_SETS = {
    "trainer (Linux, CUDA)": ["requirements.txt"],
    "tests and benches": ["requirements-dev.txt"],
    "SGLang server (its own environment)": ["requirements-sglang.txt"],
    "colocated SGLang (one environment)": ["requirements.txt", "requirements-sglang.txt"],
    "GPU tests with SGLang (one environment)": ["requirements-dev.txt", "requirements-sglang.txt"],
}
SERVER_RELEASES = ("0.5.21", "0.5.23")
"""SGLang releases whose NCCL sglang_server.SERVER_NCCL holds (tests/test_install.py ties the two): the pinned one
and the one pinned before it; --refresh reads each one's wheel, this prints each one's NCCL against the trainer's."""
READ = ("torch", "torchtitan", "sglang", "transformers", "trl", "sglang-kernel", "sgl-deep-ep")
"""The wheels whose METADATA --refresh reads, when an install set pins them or a read wheel pins them exactly: ours
that pin others, and sglang's compiled kernels, which pin torch."""


def read_pins(files: list[str], root: str = ROOT) -> dict[str, str]:
    """name -> pinned version of every `name==version` line in the requirement files (following `-r`),
    for TARGET (a line whose marker does not hold there is left out)."""
    pins = {}
    for file in files:
        with open(os.path.join(root, file)) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line.startswith("-r "):
                    pins.update(read_pins([line[3:].strip()], root))
                elif line and not line.startswith("-"):
                    req = Requirement(line)
                    if (req.marker is None or req.marker.evaluate(TARGET)) and len(req.specifier) == 1:
                        spec = next(iter(req.specifier))
                        if spec.operator == "==":
                            pins[canonical(req.name)] = spec.version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def conflicts(pins: dict[str, str], requires: dict[str, list[str]]) -> list[str]:
    """Each requirement of a pinned wheel (requires: "name==version" -> its Requires-Dist lines) on a pinned
    package, whose range the pin is outside of, in words. Pinned: ours, and what a pinned wheel pins exactly of a
    package we leave free (`with_implied`: sglang's transformers and kernels, say, whose own requirements count)."""
    pins = with_implied(pins, requires)
    out = []
    for name, version in pins.items():
        for req in _requirements(requires.get(f"{name}=={version}", [])):
            ours = pins.get(canonical(req.name))
            if ours is not None and not req.specifier.contains(ours, prereleases=True):
                out.append(f"{name}=={version} requires {req.name}{req.specifier}, and {canonical(req.name)}=={ours} "
                           f"is pinned")
    return out


def with_implied(pins: dict[str, str], requires: dict[str, list[str]]) -> dict[str, str]:
    """pins, plus every exact pin a pinned wheel in the snapshot makes of a package not yet pinned, followed through
    the wheels it brings (the first pin of a package wins; a later, different one shows as a conflict)."""
    pins, todo = dict(pins), list(pins.items())
    while todo:
        name, version = todo.pop(0)
        for pin in exact_pins(requires.get(f"{name}=={version}", [])):
            other, other_version = pin.split("==")
            if other not in pins:
                pins[other] = other_version
                todo.append((other, other_version))
    return pins


def exact_pins(lines: list[str]) -> list[str]:
    """["name==version"] of each requirement among lines (Requires-Dist) that pins one version on TARGET."""
    out = []
    for req in _requirements(lines):
        spec = next(iter(req.specifier), None) if len(req.specifier) == 1 else None
        if spec is not None and spec.operator == "==":
            out.append(f"{canonical(req.name)}=={spec.version}")
    return out


def _requirements(lines: list[str]) -> list[Requirement]:
    """The requirements among lines that hold on TARGET without extras (another platform's or an extra's are left
    out)."""
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**TARGET, "extra": ""})]


class _RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests, seekable, for zipfile."""

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
            self.size = int(r.headers["Content-Length"])

    def seekable(self):
        return True

    def readable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        if self.pos >= self.size or not len(b):
            return 0
        end = min(self.pos + len(b), self.size) - 1
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def remote_wheel(name: str, version: str, python: str = "cp311") -> zipfile.ZipFile:
    """The Linux x86_64 wheel of name==version on PyPI (a pure-Python one, or the `python` build), open as a zip
    read by HTTP range requests: only its central directory and the members read are fetched.
    Raises ValueError when PyPI has none."""
    index = f"https://pypi.org/simple/{canonical(name)}/"
    req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    prefix = f"{canonical(name).replace('-', '_')}-{version}-"
    # a wheel for `python`: a pure-Python one, its own build, or a stable-ABI build for an older CPython (abi3)
    wheels = [f for f in files if f["filename"].lower().startswith(prefix) and f["filename"].endswith(".whl")
              and ("-py3-none-any" in f["filename"] or f["filename"].endswith("x86_64.whl")
                   and (f"-{python}-{python}-manylinux" in f["filename"]
                        or (m := re.search(r"-cp3(\d+)-abi3-manylinux", f["filename"])) and int(m[1]) <= int(python[3:])))]
    if not wheels:
        raise ValueError(f"no Linux x86_64 {python} wheel of {name}=={version} on PyPI")
    z = zipfile.ZipFile(io.BufferedReader(_RangeFile(wheels[0]["url"]), buffer_size=1 << 16))
    z.filename = wheels[0]["filename"]  # which wheel was read (a zip opened on a file object has no name)
    return z


def wheel_requires(name: str, version: str) -> list[str]:
    """The Requires-Dist lines of the TARGET wheel of name==version on PyPI."""
    with remote_wheel(name, version) as z:  # TARGET's: CPython 3.11
        member = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(member).decode())
    return metadata.get_all("Requires-Dist") or []


def refresh() -> dict[str, list[str]]:
    """Read the METADATA of every READ wheel an install set pins, of each SERVER_RELEASES sglang, and of every READ
    wheel those pin exactly, into SNAPSHOT."""
    wanted = sorted({f"{n}=={v}" for files in INSTALL_SETS.values() for n, v in read_pins(files).items() if n in READ}
                    | {f"sglang=={v}" for v in SERVER_RELEASES})
    requires = {}
    while wanted:
        pin = wanted.pop(0)
        if pin not in requires:
            requires[pin] = wheel_requires(*pin.split("=="))
            print(f"read {pin}: {len(requires[pin])} requirements", flush=True)
            wanted += [p for p in exact_pins(requires[pin]) if p.split("==")[0] in READ]
    with open(SNAPSHOT, "w") as f:
        json.dump(requires, f, indent=1, sort_keys=True)
    return requires


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refresh", action="store_true", help="re-read the pinned wheels' METADATA from PyPI")
    args = ap.parse_args()
    if args.refresh:
        refresh()
    with open(SNAPSHOT) as f:
        requires = json.load(f)
    total = 0
    for name, files in INSTALL_SETS.items():
        found = conflicts(read_pins(files), requires)
        total += len(found)
        print(f"{name}: " + ("resolves" if not found else "CONFLICTS" + "".join(f"\n  {c}" for c in found)))
    for line in nccl_pairing(requires):
        print(line)
    print(f"{total} conflicts in {len(INSTALL_SETS)} install sets, read from "
          f"{'PyPI' if args.refresh else os.path.relpath(SNAPSHOT, ROOT)} (--refresh re-reads PyPI)")
    sys.exit(1 if total else 0)


def server_nccl(requires: dict[str, list[str]], release: str) -> str | None:
    """The nvidia-nccl-cu13 version an SGLang release's environment runs (sglang -> its exact torch -> that torch's
    exact NCCL, on TARGET), or None when the snapshot does not hold the chain."""
    torch = [p for p in exact_pins(requires.get(f"sglang=={release}", [])) if p.startswith("torch==")]
    return trainer_nccl(requires, torch[0]) if torch else None


def trainer_nccl(requires: dict[str, list[str]], torch: str) -> str | None:
    """The nvidia-nccl-cu13 version torch (a "torch==version" pin) pins on TARGET, or None outside the snapshot."""
    nccl = [p for p in exact_pins(requires.get(torch, [])) if p.startswith("nvidia-nccl-cu13==")]
    return nccl[0].split("==")[1] if nccl else None


def nccl_pairing(requires: dict[str, list[str]]) -> list[str]:
    """One line per SERVER_RELEASES sglang: its NCCL against the trainer's torch's, which the weight broadcast holds
    in one communicator; NCCL refuses two versions, and so does sglang_server.nccl_pairing at connect."""
    torch = f"torch=={read_pins(['requirements.txt'])['torch']}"
    ours = trainer_nccl(requires, torch)
    lines = []
    for release in SERVER_RELEASES:
        theirs = server_nccl(requires, release)
        verdict = ("not in the snapshot (run --refresh)" if ours is None or theirs is None else
                   "the same: the weight broadcast pairs" if theirs == ours else
                   "differs: NCCL cannot pair them, refused at connect")
        lines.append(f"weight broadcast NCCL: sglang {release} {theirs}, trainer ({torch}) {ours}: {verdict}")
    return lines


if __name__ == "__main__":
    main()
