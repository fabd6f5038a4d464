"""What a setting accepts, declared beside it: one Rule per field of every config dataclass.

Each config class (config.TrainConfig and its sections) lists a Rule per field in `RULES` and
calls `check_fields(self)` when built, so a value of the wrong type or out of range is refused
where the field is declared: one ValueError, `<field>=<value!r>: need <what is valid>`. A Rule
also reads the field's command-line string (`Rule.read`), so a field's type is stated once.

Notable choices:
1. A bool is no int or float here (`group_size = True` would otherwise be a group of 1).
2. A number must be finite: NaN fails every comparison and inf is no setting anywhere.
3. An int field takes an integer spelling only ("8", not "8.0" or "1e3").
4. `optional(rule)`: a field whose off value is None (`loss.tis_cap`), `none` on the command line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}  # a bool's spellings


@dataclass(frozen=True)
class Rule:
    """What one field accepts: a value of one of `types` for which `test` holds; `valid` says which,
    in words, for the error; `parse` reads the field's command-line string (None: a list, a dict or a
    section, which only a config file can spell)."""
    types: tuple
    valid: str
    test: Callable[[Any], bool] = lambda v: True
    parse: Callable[[str], Any] | None = str

    def type_ok(self, value) -> bool:
        # bool is an int subclass (choice 1)
        return isinstance(value, self.types) and (bool in self.types or not isinstance(value, bool))

    def check(self, name: str, value):
        """Raises ValueError `<name>=<value!r> (a <type>): need <valid>` for a value of another type, and
        `<name>=<value!r>: need <valid>` for one out of range."""
        if not self.type_ok(value):
            raise ValueError(f"{name}={value!r} ({kind(value)}): need {self.valid}")
        if not self.test(value):
            raise ValueError(f"{name}={value!r}: need {self.valid}")

    def read(self, name: str, text: str):
        """The value of command-line string `text` for field `name`. Raises ValueError naming both."""
        if self.parse is None:
            raise ValueError(f"{name}={text!r}: set {name} in a config file, not on the command line")
        try:
            return self.parse(text)
        except (ValueError, KeyError):  # int("8.0"), float("fast"), a bool's unknown word, a pair of three
            raise ValueError(f"{name}={text!r}: need {self.valid}") from None


def kind(value) -> str:
    """A value's type in words, for an error: 'an int', 'a function', 'a module', 'a class'."""
    name = "class" if isinstance(value, type) else type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _because(why: str) -> str:
    return f" ({why})" if why else ""


def integer(low: int | None = None, high: int | None = None, why: str = "") -> Rule:
    """An int in [low, high] (None: unbounded)."""
    span = f" in [{low}, {high}]" if high is not None else f" >= {low}" if low is not None else ""
    return Rule((int,), f"an int{span}{_because(why)}", lambda v: (low is None or v >= low) and (high is None or v <= high),
                int)


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
           why: str = "") -> Rule:
    """A finite int or float between low and high, each bound closed unless said open (None: unbounded)."""
    lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
    hi = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
    span = "" if low is None and high is None else f" in {lo}, {hi}"

    def test(v) -> bool:  # choice 2
        return (math.isfinite(v) and (low is None or (v > low if low_open else v >= low))
                and (high is None or (v < high if high_open else v <= high)))
    return Rule((int, float), f"a {'number' if span else 'finite number'}{span}{_because(why)}", test, float)


def one_of(*names: str, why: str = "") -> Rule:
    return Rule((str,), f"one of {', '.join(map(repr, names))}{_because(why)}", lambda v: v in names)


def text(valid: str = "a str", test: Callable[[str], bool] = lambda v: True) -> Rule:
    return Rule((str,), valid, test)


def optional(rule: Rule, off: str) -> Rule:
    """rule's values, or None (spelled `none` on the command line): `off` says what None means."""
    return Rule(rule.types + (type(None),), f"{rule.valid}, or None ({off})",
                lambda v: v is None or rule.test(v), lambda s: None if s.lower() == "none" else rule.parse(s))


def pair(rule: Rule, valid: str, test: Callable[[tuple], bool] = lambda v: True) -> Rule:
    """Two values of `rule`, (a, b) in a config file or `a,b` on the command line, for which test holds."""
    def ok(v) -> bool:
        return len(v) == 2 and all(rule.type_ok(x) and rule.test(x) for x in v) and test(tuple(v))

    def parse(s: str) -> tuple:
        parts = s.split(",")
        if len(parts) != 2:
            raise ValueError(s)
        return tuple(rule.parse(p.strip()) for p in parts)
    return Rule((tuple, list), valid, ok, parse)


def section(cls: type) -> Rule:
    """A field holding another config dataclass (a section of TrainConfig)."""
    return Rule((cls,), f"a {cls.__name__} (a config file sets it as a dict of its fields)", parse=None)


FLAG = Rule((bool,), "True or False", parse=lambda s: _WORDS[s.lower()])
PATH = text("a path (a str; '' = none)")
POSITIVE = number(0, low_open=True)
NON_NEGATIVE = number(0)
FRACTION = number(0, 1)


def check_fields(obj):
    """Each field of dataclass `obj` against its Rule in `type(obj).RULES` (every field has one).
    Raises ValueError `<field>=<value!r>: need <what is valid>` for the first that breaks its rule."""
    rules = type(obj).RULES
    for f in dataclasses.fields(obj):
        rules[f.name].check(f.name, getattr(obj, f.name))
