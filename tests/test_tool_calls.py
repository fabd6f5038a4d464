"""Tools (issue 34, part 1): the calculator computes or refuses in words, the two chat formats' calls are read as
their templates write them, and whatever the model writes or a tool does becomes an error text and a count,
never an exception; the python tool keeps the sandbox's confinement."""

import json
import os
import time

import pytest

import tool_calls
from config import TrainConfig, load_config
from tokenizer import build_tokenizer, demo_tokenizer
from tool_calls import (CallCounts, ToolConfig, ToolResult, build_tools, call_format, parse_glm, parse_hermes,
                        run_calls, truncate_middle)

CODEC = demo_tokenizer(build_tokenizer(320))  # byte-level: one token a byte, so counts are easy to read
BOTH = ("calculator", "python")
TOOLS = build_tools(ToolConfig(enabled=BOTH, call_timeout_s=2))


def hermes(name, arguments) -> str:
    """A call as Qwen3's template writes it."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def glm(name, **arguments) -> str:
    """A call as GLM-4.5's template writes it: a string as itself, anything else as JSON."""
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in arguments.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def run(text, cfg=ToolConfig(enabled=BOTH), fmt="hermes", tools=TOOLS, **kw):
    return run_calls(text, tools, cfg, call_format=fmt, codec=CODEC, **kw)


def calc(expression: str) -> ToolResult:
    return tool_calls.Calculator().call({"expression": expression})


# ----------------------------------------------------------------------------- the calculator

@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"), ("(123 + 456) * 7", "4053"), ("7 // 2", "3"), ("-7 % 3", "2"), ("10 / 4", "2.5"),
    ("-(3 - 5)", "2"), ("6 / 3", "2"), ("0.1 + 0.2", "0.3"), ("  999 * 999 - 1 ", "998000"), ("+4", "4")])
def test_calculator_computes_arithmetic_with_pythons_operators(expression, value):
    assert calc(expression) == ToolResult(value)


@pytest.mark.parametrize("expression", [
    "2 ** 10", "x + 1", "abs(-1)", "(1).real", "__import__('os').system('true')", "'a' * 3", "1 < 2", "True + 1",
    "[1, 2]", "lambda: 1", "1 if 1 else 2", "2 ^ 3", "1 +", "", "1; 2", "3j"])
def test_calculator_refuses_powers_names_calls_and_attributes_as_error_text(expression):
    result = calc(expression)
    assert not result.ok and result.error == "bad_expression" and result.text.startswith("error: ")


@pytest.mark.parametrize("expression, kind", [
    ("1" + "0" * 16, "out_of_bounds"),  # a literal past MAX_OPERAND
    ("9" * 999, "out_of_bounds"),  # a 999-digit literal: refused by its digit count, no float made of it
    ("1e999", "out_of_bounds"),  # inf
    ("1000000000 * 1000000000 * 100", "out_of_bounds"),  # a result past MAX_RESULT, from bounded operands
    ("1 / 0", "math_error"), ("5 % (2 - 2)", "math_error"),
    ("1" * 2000, "bad_expression"),  # longer than MAX_EXPRESSION_CHARS
    ("(" * 300 + "1" + ")" * 300, "bad_expression"),  # nested past the parser's limit
])
def test_calculator_bounds_operands_and_results(expression, kind):
    result = calc(expression)
    assert not result.ok and result.error == kind, result


# ----------------------------------------------------------------------------- the two formats

def test_hermes_reads_several_calls_in_the_order_written():
    text = "I will compute.\n" + hermes("calculator", {"expression": "1+2"}) + "\n" + hermes("python", {"code": "print(1)"})
    calls = parse_hermes(text, TOOLS)
    assert [(c.name, c.args, c.problem) for c in calls] == [
        ("calculator", {"expression": "1+2"}, ""), ("python", {"code": "print(1)"}, "")]


def test_glm_reads_several_calls_with_json_values_and_schema_strings():
    text = "<think>plan</think>\n" + glm("calculator", expression="12") + "\n" + glm("search", q="cats", n=3, f={"a": [1]})
    calls = parse_glm(text, TOOLS)
    # "12" stays a string: the calculator's schema types it so; an unknown tool's values are JSON where they parse
    assert [(c.name, c.args) for c in calls] == [("calculator", {"expression": "12"}),
                                                 ("search", {"q": "cats", "n": 3, "f": {"a": [1]}})]
    compact = "<tool_call>python<arg_key>code</arg_key><arg_value>print(2)</arg_value></tool_call>"  # no newlines
    assert [(c.name, c.args) for c in parse_glm(compact, TOOLS)] == [("python", {"code": "print(2)"})]


def test_calls_written_while_thinking_are_not_made():
    text = "<think>" + hermes("calculator", {"expression": "1+1"}) + "</think>no call"
    results, counts = run(text)
    assert results == [] and counts.calls == 0


@pytest.mark.parametrize("fmt, text, reason", [
    ("hermes", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"\n</tool_call>', "malformed"),
    ("hermes", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}', "malformed"),  # no close
    ("hermes", '<tool_call>\n["calculator"]\n</tool_call>', "malformed"),
    ("hermes", '<tool_call>\n{"name": "calculator", "arguments": [1, 2]}\n</tool_call>', "malformed"),
    ("hermes", "<tool_call>" + "[" * 100000 + "</tool_call>", "malformed"),  # JSON nested past the recursion limit
    ("hermes", hermes("search", {"q": "x"}), "unknown_tool"),
    ("hermes", hermes("calculator", {"expression": 5}), "bad_args"),  # a number where the schema wants a string
    ("hermes", hermes("calculator", {"expr": "1"}), "bad_args"),
    ("hermes", hermes("calculator", {"expression": "1", "extra": 1}), "bad_args"),
    ("glm", "<tool_call>calculator\n<arg_key>expression</arg_key>\n</tool_call>", "malformed"),
    ("glm", "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>1+2</arg_value>", "malformed"),
    ("glm", "<tool_call>calculator\nexpression=1+2\n</tool_call>", "malformed"),
    ("glm", "<tool_call>\n<arg_key>expression</arg_key><arg_value>1</arg_value></tool_call>", "malformed"),
    ("glm", glm("calculator", expression="1", expression_again="2").replace("_again", ""), "malformed"),  # twice
    ("glm", glm("search", q="x"), "unknown_tool"),
    ("glm", glm("python", source="print(1)"), "bad_args"),
])
def test_a_bad_call_is_an_error_text_and_a_counted_failure_never_an_exception(fmt, text, reason):
    results, counts = run(text, fmt=fmt)
    assert len(results) == 1 and not results[0].ok and results[0].error == reason
    assert results[0].text.startswith("error: ") and reason in tool_calls.FAILURES
    assert counts.calls == 1 and counts.failures == {reason: 1}


def test_a_turn_of_many_unclosed_calls_is_read_block_by_block():
    # each block runs to the next <tool_call> (one pass of str.find: 50,000 of them in a 550 kB turn)
    results, counts = run("<tool_call>" * 50_000)
    assert counts.calls == 50_000 and counts.failures == {"malformed": 4, "over_parallel_limit": 4, "over_row_limit": 49_992}


def test_a_bad_call_does_not_stop_the_good_ones_beside_it():
    text = hermes("calculator", {"expression": "2*21"}) + "<tool_call>\nnot json\n</tool_call>" + \
        hermes("calculator", {"expression": "1/0"})
    results, counts = run(text)
    assert [(r.text, r.ok) for r in results][0] == ("42", True)
    assert [r.error for r in results] == ["", "malformed", "math_error"]
    assert counts.calls == 3 and counts.failures == {"malformed": 1, "math_error": 1}


def test_calls_over_the_parallel_and_row_limits_are_refused_unread():
    five = "".join(hermes("calculator", {"expression": f"{i}+1"}) for i in range(5))
    results, counts = run(five, ToolConfig(enabled=BOTH, max_parallel_calls=2))
    assert [r.text for r in results[:2]] == ["1", "2"]
    assert [r.error for r in results[2:]] == ["over_parallel_limit"] * 3 and counts.failures == {"over_parallel_limit": 3}
    results, counts = run(five, ToolConfig(enabled=BOTH, max_calls_per_row=8), calls_before=7)
    assert results[0].text == "1" and counts.failures == {"over_row_limit": 4}


# ----------------------------------------------------------------------------- time, size and misbehaving tools

class Fake:
    """A tool that does what it is told: sleep, raise, return something odd."""
    schema = tool_calls.function_schema("fake", "a test double", {}, [])

    def __init__(self, name="fake", sleep_s=0.0, returns=None, raises=None):
        self.name, self.sleep_s, self.returns, self.raises = name, sleep_s, returns, raises

    def call(self, args):
        time.sleep(self.sleep_s)
        if self.raises:
            raise self.raises
        return self.returns


def test_a_looping_python_call_is_stopped_within_its_timeout_and_counted():
    cfg = ToolConfig(enabled=BOTH, call_timeout_s=1)
    text = hermes("python", {"code": "while True:\n    pass"}) + hermes("calculator", {"expression": "6*7"})
    start = time.perf_counter()
    results, counts = run(text, cfg, tools=build_tools(cfg))
    assert time.perf_counter() - start < cfg.call_timeout_s + 2  # the limit plus the sandbox's start, not forever
    assert results[0].error == "timeout" and results[1].text == "42"
    assert counts.timeouts == 1 and counts.failures == {"timeout": 1}


def test_a_hanging_tool_is_a_timeout_and_the_turn_goes_on():
    cfg = ToolConfig(enabled=BOTH, call_timeout_s=0.2)
    results, counts = run(hermes("fake", {}), cfg, tools={"fake": Fake(sleep_s=1.0, returns=ToolResult("late"))})
    assert results[0].error == "timeout" and counts.timeouts == 1
    assert counts.seconds < 1.0  # run_calls stopped waiting at the limit, not when the tool ended


@pytest.mark.parametrize("tool, error", [
    (Fake(raises=RuntimeError("boom")), "tool_error"),
    (Fake(returns="plain text"), "tool_error"),  # not a ToolResult
    (Fake(returns=ToolResult(b"bytes")), "tool_error"),
    (Fake(returns=ToolResult("no", ok=False, error="not_found")), "not_found"),  # the tool's own kind
])
def test_a_tool_that_raises_or_answers_wrongly_is_a_counted_failure(tool, error):
    results, counts = run(hermes("fake", {}), tools={"fake": tool})
    assert not results[0].ok and results[0].error == error and counts.failures == {error: 1}


def test_a_response_that_is_no_utf8_reaches_the_model_as_text():
    results, counts = run(hermes("fake", {}), tools={"fake": Fake(returns=ToolResult("a\udcff b"))})
    assert results[0].ok and results[0].text == "a? b" and not counts.failures


def test_a_long_response_is_cut_in_the_middle_to_max_response_tokens():
    text = "HEAD" + "x" * 1000 + "TAIL"
    out, cut = truncate_middle(text, 64, CODEC)
    assert cut and len(CODEC.encode(out)) <= 64
    assert out.startswith("HEAD") and out.endswith("TAIL") and "characters cut" in out
    assert truncate_middle("short", 64, CODEC) == ("short", False)
    huge = "H" + "y" * 10_000_000 + "T"  # 10 MB: only its two ends are tokenized
    out, cut = truncate_middle(huge, 64, CODEC)
    assert cut and len(CODEC.encode(out)) <= 64 and out[0] == "H" and out[-1] == "T"
    results, counts = run(hermes("fake", {}), ToolConfig(enabled=BOTH, max_response_tokens=64),
                          tools={"fake": Fake(returns=ToolResult(huge))})
    assert results[0].ok and len(CODEC.encode(results[0].text)) <= 64 and counts.truncations == 1


# ----------------------------------------------------------------------------- the python tool's sandbox

def test_the_python_tool_answers_what_the_program_prints():
    results, _ = run(hermes("python", {"code": "print(6 * 7)"}) + hermes("python", {"code": "raise KeyError('k')"}))
    assert results[0] == ToolResult("42")
    assert not results[1].ok and results[1].error == "program_error" and "KeyError" in results[1].text


def test_the_python_tool_cannot_read_a_file_outside_its_folder(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    results, _ = run(hermes("python", {"code": f"print(open({str(secret)!r}).read())"}))
    assert not results[0].ok and "TOPSECRET" not in results[0].text
    assert os.path.exists(secret)


# ----------------------------------------------------------------------------- the section and the registry

def test_the_tools_section_is_off_by_default_and_refuses_unknown_or_repeated_tools():
    assert TrainConfig().tools == ToolConfig() and ToolConfig().enabled == ()
    assert ToolConfig(enabled=["calculator"]).enabled == ("calculator",)  # a config file's list
    assert ToolConfig.RULES["enabled"].read("tools.enabled", "calculator, python") == BOTH
    for bad in (("calc",), ("python", "python"), "calculator", (1,)):
        with pytest.raises(ValueError, match="enabled="):
            ToolConfig(enabled=bad)
    with pytest.raises(ValueError, match="call_timeout_s=0"):
        ToolConfig(call_timeout_s=0)


def test_a_run_enables_tools_and_a_family_without_a_call_format_is_refused_by_name():
    cfg = load_config(None, ["tools.enabled=calculator", "tools.max_turns=2"])
    assert cfg.tools.enabled == ("calculator",) and cfg.tools.max_turns == 2
    with pytest.raises(ValueError, match=r"model_type='llama': no tool-call format known"):
        call_format("llama")


def test_each_tool_has_an_openai_function_schema_under_its_name():
    for name, tool in build_tools(ToolConfig(enabled=BOTH)).items():
        assert isinstance(tool, tool_calls.Tool) and tool.name == name
        function = tool.schema["function"]
        assert tool.schema["type"] == "function" and function["name"] == name and function["description"]
        assert function["parameters"]["type"] == "object" and set(function["parameters"]["required"]) <= set(
            function["parameters"]["properties"])


def test_the_call_format_follows_the_checkpoint_family():
    assert call_format("qwen3_moe") == "hermes" and call_format("glm4_moe") == "glm"
    with pytest.raises(ValueError, match="model_type='llama'"):
        call_format("llama")
    with pytest.raises(ValueError, match="call_format='xml'"):
        run_calls("", TOOLS, ToolConfig(), call_format="xml", codec=CODEC)


def test_counts_of_a_turn_without_calls_are_zero():
    results, counts = run("just an answer")
    assert results == [] and counts.calls == 0 and not counts.failures and counts.truncations == 0
    assert isinstance(counts, CallCounts)
