"""Do this project's pins agree with the pins of the wheels they install, on a Linux CUDA machine?

A CPU install cannot show it: torch's CPU build requires no triton, its CUDA build does (and an
exact NCCL). This reads each pinned wheel's own METADATA (Requires-Dist) for Linux x86_64,
CPython 3.11, and checks every install set's pins against every requirement of every pinned
wheel: a requirement on a package we pin, whose version range our pin is outside of, is a
conflict that pip would refuse (or, installed step by step, would silently move a package).

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
# Each install set: the requirement files one environment installs. The trainer and an SGLang server
# are separate environments; "colocated" is both in one, which the pins below show cannot resolve today.
INSTALL_SETS = {
    "trainer (Linux, CUDA)": ["requirements.txt"],
    "tests and benches": ["requirements-dev.txt"],
    "SGLang server (its own environment)": ["requirements-sglang.txt"],
    "colocated SGLang (one environment)": ["requirements.txt", "requirements-sglang.txt"],
}
EXPECTED_TO_CONFLICT = {"colocated SGLang (one environment)"}  # README: SGLang runs in its own environment


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
    """Each requirement of a pinned wheel (requires: "name==version" -> its Requires-Dist lines) on a package
    we pin, whose range our pin is outside of, in words."""
    out = []
    for name, version in pins.items():
        for line in requires.get(f"{name}=={version}", []):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**TARGET, "extra": ""}):
                continue  # another platform's, or an extra's
            ours = pins.get(canonical(req.name))
            if ours is not None and not req.specifier.contains(ours, prereleases=True):
                out.append(f"{name}=={version} requires {req.name}{req.specifier}, and {canonical(req.name)}=={ours} "
                           f"is pinned")
    return out


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


def wheel_requires(name: str, version: str) -> list[str]:
    """The Requires-Dist lines of the TARGET wheel of name==version on PyPI."""
    index = f"https://pypi.org/simple/{canonical(name)}/"
    req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    prefix = f"{canonical(name).replace('-', '_')}-{version}-"
    # a wheel for TARGET: a pure-Python one, or its own build
    wheels = [f for f in files if f["filename"].lower().startswith(prefix) and f["filename"].endswith(".whl")
              and ("-py3-none-any" in f["filename"] or "cp311-cp311-manylinux" in f["filename"]
                   and f["filename"].endswith("x86_64.whl"))]
    if not wheels:
        raise ValueError(f"no Linux x86_64 cp311 wheel of {name}=={version} on PyPI")
    with zipfile.ZipFile(io.BufferedReader(_RangeFile(wheels[0]["url"]), buffer_size=1 << 16)) as z:
        member = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(member).decode())
    return metadata.get_all("Requires-Dist") or []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refresh", action="store_true", help="re-read the pinned wheels' METADATA from PyPI")
    args = ap.parse_args()
    if args.refresh:
        wanted = sorted({f"{n}=={v}" for files in INSTALL_SETS.values() for n, v in read_pins(files).items()
                         if n in ("torch", "torchtitan", "sglang", "transformers", "trl")})
        requires = {}
        for pin in wanted:
            requires[pin] = wheel_requires(*pin.split("=="))
            print(f"read {pin}: {len(requires[pin])} requirements", flush=True)
        for pin in _pinned(requires, next(p for p in wanted if p.startswith("sglang==")), "torch"):  # its own torch
            requires[pin] = wheel_requires(*pin.split("=="))
            print(f"read {pin} (sglang's): {len(requires[pin])} requirements", flush=True)
        with open(SNAPSHOT, "w") as f:
            json.dump(requires, f, indent=1, sort_keys=True)
    with open(SNAPSHOT) as f:
        requires = json.load(f)
    failed = False
    for name, files in INSTALL_SETS.items():
        found = conflicts(read_pins(files), requires)
        expected = name in EXPECTED_TO_CONFLICT
        failed |= bool(found) != expected
        verdict = "resolves" if not found else ("conflicts, as expected" if expected else "CONFLICTS")
        print(f"{name}: {verdict}" + "".join(f"\n  {c}" for c in found))
    print(nccl_pairing(requires))
    sys.exit(1 if failed else 0)


def _pinned(requires: dict[str, list[str]], pin: str, name: str) -> list[str]:
    """["name==version"] for the exact pin of `name` among pin's requirements on TARGET, or []."""
    for line in requires.get(pin, []):
        req = Requirement(line)
        if canonical(req.name) == name and (req.marker is None or req.marker.evaluate({**TARGET, "extra": ""})):
            spec = next(iter(req.specifier), None)
            if spec is not None and spec.operator == "==":
                return [f"{name}=={spec.version}"]
    return []


def nccl_pairing(requires: dict[str, list[str]]) -> str:
    """The NCCL of the trainer's torch and of an SGLang server's own torch, which the weight broadcast pairs in one
    communicator (sglang_server.SERVER_NCCL holds the server's, and the engine warns at connect when they differ)."""
    trainer = f"torch=={read_pins(['requirements.txt'])['torch']}"
    server = _pinned(requires, f"sglang=={read_pins(['requirements-sglang.txt'])['sglang']}", "torch")
    ours = _pinned(requires, trainer, "nvidia-nccl-cu13")
    theirs = _pinned(requires, server[0], "nvidia-nccl-cu13") if server else []
    if not ours or not theirs:
        return "weight broadcast NCCL: not in the snapshot (run --refresh)"
    same = ours[0] == theirs[0]
    return (f"weight broadcast NCCL: trainer {ours[0]} ({trainer}), SGLang server {theirs[0]} ({server[0]}): "
            + ("the same" if same else "different versions in one communicator, untested (a warning at connect)"))


if __name__ == "__main__":
    main()
