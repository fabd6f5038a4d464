"""Tools a policy may call in a multi-turn rollout, and the calls read out of an assistant turn.

Owns part 1 of agentic RL (issue 34, "Tools"): the `Tool` protocol and its registry (`TOOLS`), two tools
(`Calculator`, an AST evaluator that never calls eval; `PythonTool`, a program run by `sandbox.run` with
all its confinement), the parsers of the two chat formats' calls (`parse_hermes` for Qwen3,
`parse_glm` for GLM-4.5, chosen by the checkpoint's family: `call_format`), and `run_calls`, which
answers one assistant turn's calls on a worker pool under the limits of the run's `tools` section
(`ToolConfig`). The multi-turn rollout that runs them between a row's turns is tool_rollout.py's; the
chat templates' tool turns are chat_template.py's. The design follows verl's agent loop and TRL's `tools=` (a tool's
error is text for the model, never an exception) and ToolRL (arXiv 2504.13958), which "Each Prompt
Matters" (arXiv 2512.07710) builds its tool-use RL phase on.

The formats, as the checkpoints' own chat templates render an assistant's calls:
- hermes (Qwen3, `model_type` qwen3_moe): one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  block per call, several in one turn, the arguments a JSON object.
- glm (GLM-4.5, glm4_moe): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`,
  where the template writes a string value as itself and any other value as JSON.

Notable choices:
1. Never an exception to the caller for anything the model writes or a tool does: a malformed call, an
   unknown tool, arguments the tool's schema refuses, a call over a limit, a tool that raises, returns
   something other than a `ToolResult` or overruns `call_timeout_s` each become an error text in that
   call's place and one counted failure, by reason (`CallCounts.failures`; the reasons are `FAILURES` and
   the tools' own error kinds).
2. Only the text after the turn's last `</think>` is read: a call written while thinking is not made.
3. Limits are applied before reading: of a turn's blocks the first `max_parallel_calls` (and no more than
   the row's remaining `max_calls_per_row`) are read; each later block is refused unread, so a model
   cannot buy work by writing more calls. Every block, well formed or not, counts as a call.
4. A GLM value is JSON where it parses as JSON, else the string itself; a parameter that the tool's schema
   types as a string keeps the string as written (the template wrote it unquoted: `12` stays "12").
5. Arguments are checked against the tool's schema before it runs: required names present, no names
   the schema does not declare, JSON types (string, integer, number, boolean, object, array) matched.
6. A call's time counts from its submission to the pool (with `call_workers` >= `max_parallel_calls` a
   turn's calls start together, so it is each call's own). The pool stops waiting at the limit but cannot
   stop a thread: a tool must end on its own within a bounded time (the python tool's sandbox kills its
   program at the same limit; the calculator's work is bounded by its operand and result bounds).
7. A response longer than `max_response_tokens` is cut in the middle (head and tail kept, a marker with
   the count between), as verl and slime truncate tool output; text longer than
   PRECUT_CHARS_PER_TOKEN characters a token is first cut in the middle by characters, so a tool that
   prints 10 MB costs no tokenizer pass over all of it.
8. Every parse here runs in time linear in the turn's length (one pass of str.find per tag), as reward.py's
   parses do.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import time
from collections import Counter
from concurrent.futures import Executor, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import sandbox
from rules import POSITIVE, Rule, check_fields, integer, number

THINK_CLOSE = "</think>"  # calls before it are thoughts, not calls (choice 2)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # both formats' call block
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"  # GLM's
FAILURES = ("malformed", "unknown_tool", "bad_args", "over_row_limit", "over_parallel_limit", "timeout", "tool_error")
"""run_calls' own failure reasons; a tool's result with ok=False adds its own error kind (the calculator's
'bad_expression', 'out_of_bounds', 'math_error'; the python tool's 'program_error' and 'timeout')."""

MAX_EXPRESSION_CHARS = 1000  # a calculator expression is a line of arithmetic, not a program
MAX_OPERAND = 10**15  # largest |literal| the calculator reads: 15 digits, every int up to it exact as a float
MAX_RESULT = 10**18  # largest |value| of any subexpression, so no product the calculator forms passes 10**36
FLOAT_DIGITS = 15  # a float result's significant digits: 0.1 + 0.2 reads 0.3, as a calculator shows it
PRECUT_CHARS_PER_TOKEN = 16  # characters kept per allowed token before tokenizing a long response (choice 7)
PYTHON_OUTPUT_NOTE = "(no output)"  # what a program that printed nothing returns, so the model sees it ran


# ----------------------------------------------------------------------------- the protocol and two tools

@dataclass(frozen=True)
class ToolResult:
    """One call's answer: `text` for the model (an error's words when not ok) and, when not ok, the
    failure's kind (a FAILURES reason or the tool's own)."""
    text: str
    ok: bool = True
    error: str = ""


@runtime_checkable
class Tool(Protocol):
    """What a tool provides: its `name` (the one the model calls), its `schema` in OpenAI's function format
    ({"type": "function", "function": {"name", "description", "parameters": a JSON schema object}}), which the
    chat template shows the model, and `call`, which must return a ToolResult within a bounded time
    (choice 6); run_calls turns whatever else it does into a counted failure."""
    name: str
    schema: dict

    def call(self, args: dict) -> ToolResult: ...


def function_schema(name: str, description: str, properties: dict, required: Sequence[str]) -> dict:
    """A tool's schema in OpenAI's function format, every parameter in `properties` a JSON schema."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


def _error(kind: str, text: str) -> ToolResult:
    return ToolResult(f"error: {text}", ok=False, error=kind)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOLS = {ast.Pow: "**", ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>",
            ast.MatMult: "@"}


class _Refused(Exception):
    """Why an expression has no value here: the error kind and its words (caught inside Calculator.call)."""
    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


class Calculator:
    """Arithmetic on int and float literals: + - * / // % (Python's meanings), unary minus and plus, and
    parentheses. Evaluated over the AST node by node, never by eval: anything else (`**`, names, calls,
    attributes, comparisons, strings) is an error text, as is a literal beyond MAX_OPERAND, a subexpression
    beyond MAX_RESULT, a division by zero or a result that is not finite."""

    name = "calculator"
    schema = function_schema(
        "calculator", "Evaluate an arithmetic expression of numbers with + - * / // % and parentheses.",
        {"expression": {"type": "string", "description": "the expression, e.g. (123 + 456) * 7"}}, ["expression"])

    def call(self, args: dict) -> ToolResult:
        expression = args["expression"]
        if len(expression) > MAX_EXPRESSION_CHARS:
            return _error("bad_expression", f"an expression of at most {MAX_EXPRESSION_CHARS} characters, "
                                            f"got {len(expression)}")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # ValueError: a null byte, 5000 digits
            return _error("bad_expression", f"not an arithmetic expression ({type(e).__name__}: {e})")
        try:
            value = self._value(tree.body)
        except _Refused as e:
            return _error(e.kind, str(e))
        return ToolResult(str(value) if isinstance(value, int) else format(value, f".{FLOAT_DIGITS}g"))

    def _value(self, node: ast.expr) -> int | float:
        if isinstance(node, ast.Constant):
            v = node.value
            if type(v) not in (int, float):  # bool is an int subclass: True + 1 is no arithmetic here
                raise _Refused("bad_expression", f"only int and float numbers, got {v!r}")
            return self._bounded(v, MAX_OPERAND, "a number")
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._bounded(_UNARY[type(node.op)](self._value(node.operand)), MAX_RESULT, "a result")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
                raise _Refused("math_error", "division by zero")
            return self._bounded(_BINARY[type(node.op)](left, right), MAX_RESULT, "a result")
        if isinstance(node, ast.BinOp):
            symbol = _SYMBOLS.get(type(node.op), type(node.op).__name__)
            raise _Refused("bad_expression", f"the operator {symbol} is not supported (use + - * / // %)")
        raise _Refused("bad_expression", f"{type(node).__name__} is not supported: only numbers, + - * / // % "
                                         "and parentheses")

    @staticmethod
    def _bounded(v: int | float, bound: int, what: str) -> int | float:
        if isinstance(v, float) and not math.isfinite(v) or abs(v) > bound:
            # a 1000-digit int has no float to format: its digits are counted instead
            shown = f"{v:.3g}" if isinstance(v, float) or abs(v) < 10**300 else f"an int of {len(str(abs(v)))} digits"
            raise _Refused("out_of_bounds", f"{what} of magnitude at most {bound:.0e}, got {shown}")
        return v


class PythonTool:
    """Runs the model's Python program in the project's sandbox (sandbox.run: namespaces, a root of its own,
    rlimits, an unprivileged uid, Landlock, as the host allows) under `limits`, and answers its output:
    stdout and stderr together, their last few kB (sandbox.SandboxResult.output). A program that raises
    answers its traceback, an error of kind 'program_error'; one stopped by the wall-clock or CPU limit is a
    'timeout'."""

    name = "python"
    schema = function_schema(
        "python", "Run a Python program in a sandbox (no network, no files outside its own folder) and return "
                  "what it prints.", {"code": {"type": "string", "description": "the program's source"}}, ["code"])

    def __init__(self, limits: sandbox.SandboxLimits):
        self.limits = limits

    def call(self, args: dict) -> ToolResult:
        result = sandbox.run(args["code"], self.limits)
        output = result.output.strip("\n")
        # "exited early": the program called sys.exit(0); for a tool that is an ordinary end
        if result.passed or result.reason == "exited early":
            return ToolResult(output or PYTHON_OUTPUT_NOTE)
        if result.reason in ("timeout", "signal: SIGXCPU"):
            return _error("timeout", f"the program ran past its limit of {self.limits.wall_s:g} s wall clock or "
                                     f"{self.limits.cpu_s} s CPU\n{output}".rstrip("\n"))
        # "failed: <line>": the traceback's last line, already the output's; a signal (memory, files) is not
        said = result.reason.startswith("failed: ") and output
        return ToolResult(output if said else f"{output}\nerror: {result.reason}".lstrip("\n"), ok=False,
                          error="program_error")


def python_limits(cfg: ToolConfig) -> sandbox.SandboxLimits:
    """The python tool's sandbox limits: its wall clock and CPU time at the call's limit (so the sandbox ends
    the program when run_calls stops waiting for it), the rest the sandbox's defaults."""
    return sandbox.SandboxLimits(wall_s=cfg.call_timeout_s, cpu_s=max(1, math.ceil(cfg.call_timeout_s)))


TOOLS: dict[str, Callable[[ToolConfig], Tool]] = {
    "calculator": lambda cfg: Calculator(),
    "python": lambda cfg: PythonTool(python_limits(cfg)),
}
"""The tools a run may enable, by name: each builds its tool from the run's `tools` section. Adding a tool is
a class with `name`, `schema` and `call`, and a line here."""


# ----------------------------------------------------------------------------- the config section

@dataclass
class ToolConfig:
    """Which tools a rollout may call and the limits on its calls: the run's `tools` section. Raises
    ValueError on a field its rule refuses (`RULES`). Read by the multi-turn rollout (tool_rollout.ToolEngine)
    and, for the schemas a prompt shows, by data.py (`tool_schemas`)."""
    enabled: tuple[str, ...] = ()
    """Names of the tools (TOOLS) the policy may call; empty (the default): none, a rollout is one completion.
    On the command line a comma-separated list: `tools.enabled=calculator,python`."""
    max_turns: int = 4
    """Assistant turns per row, its first included: after the last one the row ends whatever it calls."""
    max_calls_per_row: int = 8
    """Calls a row may make over all its turns; later calls are refused with an error text (counted)."""
    max_parallel_calls: int = 4
    """Calls read from one assistant turn; later ones are refused with an error text (counted)."""
    max_response_tokens: int = 512
    """A tool response's tokens at most: a longer one is cut in the middle (head and tail kept, counted)."""
    call_timeout_s: float = 10.0
    """Wall-clock limit of one call, from its submission to the pool: a call still running is an error text
    (counted). The python tool's sandbox limits its wall clock and CPU time to this too."""
    call_workers: int = 4
    """Threads that run calls at once (at least max_parallel_calls, or a turn's calls queue and the wait
    counts against their time limit)."""
    sft_call_share: float = 0.5
    """With the calculator enabled, the share of SFT demonstrations that call it first with the question's
    arithmetic expression and answer from its response (tool_rollout.demonstration_ids); the others answer
    directly, as does a question without an expression."""

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        "enabled": Rule((list, tuple), f"a list of tool names, each at most once, from {', '.join(map(repr, TOOLS))} "
                                       "(empty: no tools)",
                        lambda v: all(isinstance(n, str) and n in TOOLS for n in v) and len(set(v)) == len(v),
                        lambda s: tuple(n.strip() for n in s.split(",") if n.strip())),
        "max_turns": integer(1),
        "max_calls_per_row": integer(1),
        "max_parallel_calls": integer(1),
        "max_response_tokens": integer(1),
        "call_timeout_s": POSITIVE,
        "call_workers": integer(1),
        "sft_call_share": number(0, 1),
    }

    def __post_init__(self):
        check_fields(self)
        self.enabled = tuple(self.enabled)  # a config file's list, held as the default's type


def build_tools(cfg: ToolConfig) -> dict[str, Tool]:
    """The enabled tools, by name, in the order `cfg.enabled` lists them."""
    return {name: TOOLS[name](cfg) for name in cfg.enabled}


def tool_schemas(cfg: ToolConfig) -> list[dict] | None:
    """The enabled tools' schemas, which a prompt's chat template shows the model; None when none is enabled."""
    return [tool.schema for tool in build_tools(cfg).values()] or None


def tool_words(cfg: ToolConfig, model_type: str) -> str:
    """What a tool-calling run's prompts and calls add to its texts, for a demo tokenizer to learn merges from:
    the schemas as JSON and a call of the first tool in model_type's format ('' when no tool is enabled)."""
    tools = build_tools(cfg)
    if not tools:
        return ""
    first = next(iter(tools.values()))
    example = {k: "1 + 2" for k in first.schema["function"]["parameters"]["properties"]}
    schemas = [json.dumps(t.schema) for t in tools.values()]
    return "\n".join(schemas + [write_call(call_format(model_type), first.name, example)])


# ----------------------------------------------------------------------------- reading the calls of a turn

@dataclass(frozen=True)
class Call:
    """One call block of an assistant turn: the tool's name and its arguments, or why it could not be read
    (`problem`, '' when it was)."""
    name: str = ""
    args: dict = field(default_factory=dict)
    problem: str = ""


def call_blocks(text: str) -> list[tuple[str, str]]:
    """(body, problem) of each `<tool_call>` block after the text's last `</think>`, in order: a block with
    no `</tool_call>` before the next `<tool_call>` or the end has problem 'no closing </tool_call>' and
    runs to there. Linear in len(text): each tag is searched for once from where the last search ended."""
    cut = text.rfind(THINK_CLOSE)
    text = text[cut + len(THINK_CLOSE):] if cut != -1 else text
    blocks, pos, close = [], text.find(CALL_OPEN), -1
    while pos != -1:
        start = pos + len(CALL_OPEN)
        nxt = text.find(CALL_OPEN, start)
        if close < start and close != -2:  # -2: no closing tag is left anywhere after here
            close = text.find(CALL_CLOSE, start)
            close = -2 if close == -1 else close
        if close == -2 or (nxt != -1 and nxt < close):
            blocks.append((text[start:nxt if nxt != -1 else len(text)], f"no closing {CALL_CLOSE}"))
        else:
            blocks.append((text[start:close], ""))  # nxt, if any, lies past this close
        pos = nxt
    return blocks


def _json(text: str):
    """text's JSON value; ValueError (json's, or RecursionError's words for a nesting too deep) if none."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def parse_hermes(text: str, tools: Mapping[str, Tool]) -> list[Call]:
    """Qwen3's calls: each block's body a JSON object {"name": str, "arguments": object} (arguments may be
    a JSON string of an object, as the template accepts; missing: no arguments). `tools` is unread here
    (parse_glm's signature)."""
    calls = []
    for body, problem in call_blocks(text):
        if problem:
            calls.append(Call(problem=problem))
            continue
        try:
            obj = _json(body)
            if isinstance(obj, dict) and isinstance(obj.get("arguments"), str):
                obj["arguments"] = _json(obj["arguments"])
        except ValueError as e:
            calls.append(Call(problem=f"not JSON ({e})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(Call(problem='need a JSON object {"name": <tool name>, "arguments": {...}}'))
        elif not isinstance(obj.get("arguments", {}), dict):
            calls.append(Call(obj["name"], problem=f"arguments must be a JSON object, got "
                                                   f"{type(obj['arguments']).__name__}"))
        else:
            calls.append(Call(obj["name"], obj.get("arguments", {})))
    return calls


def _string_params(tool: Tool | None) -> set[str]:
    """The names of the parameters a tool's schema types as strings."""
    props = tool.schema["function"]["parameters"].get("properties", {}) if tool is not None else {}
    return {k for k, p in props.items() if isinstance(p, dict) and p.get("type") == "string"}


def parse_glm(text: str, tools: Mapping[str, Tool]) -> list[Call]:
    """GLM-4.5's calls: each block's body the tool's name (up to a newline or the first `<arg_key>`), then
    `<arg_key>K</arg_key>` `<arg_value>V</arg_value>` pairs, whitespace alone between tags. V is read as
    choice 4 says, by the schema of `tools[name]` where there is one."""
    calls = []
    for body, problem in call_blocks(text):
        if problem:
            calls.append(Call(problem=problem))
            continue
        ends = [i for i in (body.find("\n"), body.find(KEY_OPEN)) if i != -1]
        cut = min(ends) if ends else len(body)
        name, rest = body[:cut].strip(), body[cut:]
        pairs, problem = _glm_pairs(rest)
        if not name:
            calls.append(Call(problem="no tool name after <tool_call>"))
        elif problem:
            calls.append(Call(name, problem=problem))
        else:
            strings = _string_params(tools.get(name))
            args = {}
            for key, value in pairs:
                if key in args:
                    problem = f"argument {key!r} given twice"
                    break
                args[key] = value if key in strings else _glm_value(value)
            calls.append(Call(name, problem=problem) if problem else Call(name, args))
    return calls


def _glm_pairs(rest: str) -> tuple[list[tuple[str, str]], str]:
    """The (key, raw value) pairs of a GLM block after its name, or the problem that stopped the reading."""
    pairs, pos = [], 0
    while rest[pos:].strip():
        key, pos, problem = _tagged(rest, pos, KEY_OPEN, KEY_CLOSE)
        if problem:
            return pairs, problem
        value, pos, problem = _tagged(rest, pos, VALUE_OPEN, VALUE_CLOSE)
        if problem:
            return pairs, f"{problem} after <arg_key>{key}</arg_key>"
        pairs.append((key.strip(), value))
    return pairs, ""


def _tagged(text: str, pos: int, open_tag: str, close_tag: str) -> tuple[str, int, str]:
    """The text between open_tag (after whitespace from pos) and close_tag, the position after close_tag,
    and '' or the problem."""
    start = len(text) - len(text[pos:].lstrip())
    if not text.startswith(open_tag, start):
        return "", pos, f"expected {open_tag}, got {text[start:start + 20]!r}"
    end = text.find(close_tag, start + len(open_tag))
    if end == -1:
        return "", pos, f"no {close_tag}"
    return text[start + len(open_tag):end], end + len(close_tag), ""


def _glm_value(raw: str):
    try:
        return _json(raw)
    except ValueError:
        return raw


PARSERS: dict[str, Callable[[str, Mapping[str, Tool]], list[Call]]] = {"hermes": parse_hermes, "glm": parse_glm}
"""A call format's parser, by name."""


def write_call(call_format: str, name: str, args: dict) -> str:
    """One call block as the format's chat template writes it (the inverse of its parser): what an SFT
    demonstration that calls a tool imitates."""
    if call_format == "hermes":
        return f'{CALL_OPEN}\n{json.dumps({"name": name, "arguments": args}, ensure_ascii=False)}\n{CALL_CLOSE}'
    pairs = "".join(f"{KEY_OPEN}{k}{KEY_CLOSE}\n{VALUE_OPEN}{v if isinstance(v, str) else json.dumps(v)}{VALUE_CLOSE}\n"
                    for k, v in args.items())
    return f"{CALL_OPEN}{name}\n{pairs}{CALL_CLOSE}"
CALL_FORMATS = {"qwen3_moe": "hermes", "glm4_moe": "glm"}
"""The call format of a checkpoint's family (config.json's model_type; hf_config.HF_FAMILIES). The tiny demo's
model is qwen3_moe."""


def call_format(model_type: str) -> str:
    """The call format of a checkpoint family's chat template. Raises ValueError for a family without one."""
    if model_type not in CALL_FORMATS:
        raise ValueError(f"model_type={model_type!r}: no tool-call format known; valid: {sorted(CALL_FORMATS)}")
    return CALL_FORMATS[model_type]


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,)}


def args_problem(tool: Tool, args: dict) -> str:
    """Why `args` do not fit the tool's parameter schema (choice 5), or ''."""
    params = tool.schema["function"]["parameters"]
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing argument {missing[0]!r} (the parameters are {sorted(props)})"
    unknown = [k for k in args if k not in props]
    if unknown and params.get("additionalProperties") is not True:
        return f"unknown argument {unknown[0]!r} (the parameters are {sorted(props)})"
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        types = _JSON_TYPES.get(want)
        # bool is an int subclass in Python, and not a JSON integer or number
        if types and (not isinstance(v, types) or isinstance(v, bool) and want != "boolean"):
            return f"argument {k!r} must be a JSON {want}, got {type(v).__name__} {v!r:.40}"
    return ""


# ----------------------------------------------------------------------------- running them

class Codec(Protocol):
    """Text <-> token ids, as tokenizer.Tokenizer provides them: what a response's truncation counts in."""
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class CallCounts:
    """What one turn's calls (or a row's, summed by the caller) cost: `calls` read (every block, choice 3),
    `failures` by reason, responses truncated, and the seconds run_calls took."""
    calls: int = 0
    failures: Counter = field(default_factory=Counter)
    truncations: int = 0
    seconds: float = 0.0

    @property
    def timeouts(self) -> int:
        return self.failures["timeout"]


def truncate_middle(text: str, max_tokens: int, codec: Codec) -> tuple[str, bool]:
    """text cut in the middle to at most max_tokens tokens of `codec` (head and tail about equal, a marker
    naming the characters cut between them), and whether it was cut. Text longer than
    2 x PRECUT_CHARS_PER_TOKEN x max_tokens characters is tokenized only at its two ends (choice 7)."""
    reach = max_tokens * PRECUT_CHARS_PER_TOKEN
    if len(text) > 2 * reach:
        head_ids, tail_ids = codec.encode(text[:reach]), codec.encode(text[-reach:])
    else:
        head_ids = tail_ids = codec.encode(text)
        if len(head_ids) <= max_tokens:
            return text, False
    budget = max_tokens
    while budget > 0:  # merges across the joins may add a token or two: shrink until the whole fits
        n_tail = budget // 2
        head, tail = codec.decode(head_ids[:budget - n_tail]), codec.decode(tail_ids[len(tail_ids) - n_tail:])
        out = f"{head}\n[... {len(text) - len(head) - len(tail)} characters cut ...]\n{tail}"
        over = len(codec.encode(out)) - max_tokens
        if over <= 0:
            return out, True
        budget -= over
    return codec.decode(head_ids[:max_tokens]), True  # no room for the marker: the head alone


def _answer(tool: Tool, args: dict) -> ToolResult:
    """tool.call(args), with whatever else it does as a counted 'tool_error' (choice 1)."""
    try:
        result = tool.call(args)
    except Exception as e:  # a tool's own bug or refusal is the model's error text, never the run's
        return _error("tool_error", f"{tool.name} raised {type(e).__name__}: {e}")
    if not isinstance(result, ToolResult) or not isinstance(result.text, str):
        return _error("tool_error", f"{tool.name} returned {type(result).__name__}, not a ToolResult of text")
    # a lone surrogate (bytes read with errors='surrogateescape') is no UTF-8 a tokenizer can take
    return ToolResult(result.text.encode("utf-8", "replace").decode("utf-8"), result.ok, result.error)


def _refusal(call: Call, index: int, calls_before: int, tools: Mapping[str, Tool], cfg: ToolConfig) -> ToolResult | None:
    """The error of a call that must not run (choice 3's limits first, then what it says), or None."""
    if calls_before + index >= cfg.max_calls_per_row:
        return _error("over_row_limit", f"this row's limit of {cfg.max_calls_per_row} tool calls is reached")
    if index >= cfg.max_parallel_calls:
        return _error("over_parallel_limit", f"at most {cfg.max_parallel_calls} tool calls in one turn")
    if call.problem:
        return _error("malformed", f"malformed tool call: {call.problem}")
    if call.name not in tools:
        return _error("unknown_tool", f"unknown tool {call.name[:64]!r}; the tools are {', '.join(tools) or 'none'}")
    if problem := args_problem(tools[call.name], call.args):
        return _error("bad_args", f"{call.name}: {problem}")
    return None


def run_calls(text: str, tools: Mapping[str, Tool], cfg: ToolConfig, *, call_format: str, codec: Codec,
              pool: Executor | None = None, calls_before: int = 0) -> tuple[list[ToolResult], CallCounts]:
    """Answer the calls of one assistant turn.

    text: the turn as decoded (its thinking, prose and call blocks); tools: the enabled tools by name
    (build_tools); call_format: 'hermes' or 'glm' (call_format(model_type)); codec: what response tokens are
    counted in (a tokenizer.Tokenizer); pool: the executor the calls run on (None: one of cfg.call_workers
    threads for this turn); calls_before: the row's calls in its earlier turns (max_calls_per_row).

    Returns one ToolResult per call block, in the order written (an error text in place of a refused, failed
    or timed-out call), each at most cfg.max_response_tokens tokens, and the turn's CallCounts. Raises
    ValueError only for an unknown call_format (the caller's setting, not the model's text)."""
    if call_format not in PARSERS:
        raise ValueError(f"call_format={call_format!r}: need one of {sorted(PARSERS)}")
    start = time.perf_counter()
    calls = PARSERS[call_format](text, tools)
    results: list[ToolResult | None] = [_refusal(c, i, calls_before, tools, cfg) for i, c in enumerate(calls)]
    runnable = [i for i, r in enumerate(results) if r is None]
    own = pool is None and bool(runnable)
    pool = ThreadPoolExecutor(cfg.call_workers, thread_name_prefix="tool") if own else pool
    try:
        deadline = time.monotonic() + cfg.call_timeout_s  # choice 6: from submission
        futures = {i: pool.submit(_answer, tools[calls[i].name], calls[i].args) for i in runnable}
        for i, future in futures.items():
            try:
                results[i] = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                future.cancel()  # stops a call still queued; a running one ends on its own (choice 6)
                results[i] = _error("timeout", f"{calls[i].name} did not answer within {cfg.call_timeout_s:g} s")
    finally:
        if own:
            pool.shutdown(wait=False, cancel_futures=True)
    counts = CallCounts(calls=len(calls))
    for i, result in enumerate(results):
        result_text, cut = truncate_middle(result.text, cfg.max_response_tokens, codec)
        if cut:
            results[i] = ToolResult(result_text, result.ok, result.error)
            counts.truncations += 1
        if not result.ok:
            counts.failures[result.error or "tool_error"] += 1
    counts.seconds = time.perf_counter() - start
    return results, counts
