"""A chat template's text: a Jinja chat template (transformers' format) rendered as transformers'
apply_chat_template renders it, and the text a tool turn appends. Text only: `tokenizer.Tokenizer` gives the
names of its tokens and tokenizes what comes out, so nothing here knows an id.

`render_chat` is apply_chat_template(..., tokenize=False). The tool-turn functions take a `Render` (a template
with its token names bound, `Tokenizer.render`): `tool_turn` finds where a tool turn starts after an
assistant turn that calls tools and the turn's text around the results, `tool_turn_text` fills in the
results. `DEMO_CHAT_TEMPLATE` is the tool-calling demo's template (`tokenizer.demo_tokenizer(enc, tools=True)`).

Notable choices:
1. Tool turns are appended to a row's token stream, never re-rendered from text (verl's "continuous
   token" delta, TRL's tool suffix): `tool_turn` renders one canonical conversation (a user turn; an
   assistant turn with reasoning and one call per result; the tool messages and a generation prompt) up
   to the assistant turn and whole, and the tool turn is the difference. Checked to be append-only (each
   render extends the one before, else ValueError naming the template). The model samples the stop token
   that ends its turn, so the turn starts right after it: after Qwen's <|im_end|> (the template's "\\n"
   after it is the tool turn's), or after GLM-4.5's <|observation|>, the stop token its template writes
   before the results (`tokenizer.Tokenizer.tool_stop_id`). The results are private-use marks in that
   render, replaced by the real text, whose render must agree; `tool_turn_text` says where each result
   lies, so the tokenizer reads a special token's string inside one as data.
2. The demo's template is Qwen3's layout without thinking, so the demo runs the code a Qwen3 checkpoint runs.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Protocol

import jinja2
import jinja2.sandbox

# ChatML with Qwen3's tool layout (hermes calls: JSON in <tool_call>; a run of tool results as one user turn
# of <tool_response> blocks) minus its thinking and its tool instructions, which would cost the tiny
# model's context more than its vocabulary can say: a system turn lists the schemas in <tools>.
DEMO_CHAT_TEMPLATE = r"""{%- if messages[0].role == 'system' or tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- endif %}
    {%- if tools %}
        {{- ('\n\n' if messages[0].role == 'system' else '') + '<tools>' }}
        {%- for tool in tools %}
            {{- '\n' + tool | tojson }}
        {%- endfor %}
        {{- '\n</tools>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function or call %}
            {{- ('\n' if message.content or not loop.first else '') + '<tool_call>\n{"name": "' + call.name }}
            {{- '", "arguments": ' + (call.arguments if call.arguments is string else call.arguments | tojson) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""
# The canonical conversation's tool name and argument (choice 7): text no template or stop token contains.
# The canonical conversation's tool name and argument (choice 1): text no template or stop token contains.
TOOL_PLACEHOLDER = "everyprompt_tool"


class Render(Protocol):
    """A chat template with its token names bound: the text of messages with tools (JSON schemas in OpenAI's
    function format; None: none) and, if add_generation_prompt, the next assistant turn's opening."""

    def __call__(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str: ...


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> jinja2.Template:
    """source compiled as transformers 5.x's apply_chat_template compiles a chat template: a sandbox
    with trim_blocks, lstrip_blocks and loop controls, raise_exception, strftime_now, and a tojson that
    is plain json.dumps (jinja's own escapes HTML characters). transformers also hardens dict/namespace
    and adds a {% generation %} tag for assistant masks: neither changes a prompt's text, and a template
    using the tag fails here to compile."""
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def render_chat(template: str, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool,
                names: dict[str, str]) -> str:
    """template's text for messages and tools, as apply_chat_template(..., tokenize=False) renders it;
    names: the token strings transformers passes (bos_token, eos_token, pad_token; those present).
    Raises jinja2's TemplateError for what the template refuses."""
    return _compiled_template(template).render(
        messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **names)


def template_label(template: str) -> str:
    """How errors name a template: its first line, cut short, and its length."""
    first = template.lstrip().splitlines()[0] if template.strip() else ""
    return f"chat template {first[:40]!r}... ({len(template)} characters)"


def tool_conversation(render: Render, contents: list[str]) -> tuple[str, str, str]:
    """The canonical conversation's renders (choice 1): the generation prompt after the user turn, the
    conversation up to the assistant turn that calls one tool per content, and all of it with the tool
    messages and the next generation prompt."""
    calls = [{"type": "function", "function": {"name": TOOL_PLACEHOLDER, "arguments": {"x": TOOL_PLACEHOLDER}}}
             for _ in contents]
    user = {"role": "user", "content": "q"}
    # with reasoning, as sampled: Qwen3 drops an empty think block from an assistant turn that is not last
    assistant = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": calls}
    tools = [{"type": "function", "function": {"name": TOOL_PLACEHOLDER, "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    return (render([user], tools, add_generation_prompt=True),
            render([user, assistant], tools, add_generation_prompt=False),
            render([user, assistant] + [{"role": "tool", "content": c} for c in contents], tools,
                   add_generation_prompt=True))


def tool_turn(render: Render, num_results: int, *, stops: tuple[str, ...], label: str) -> tuple[str, int, list[str]]:
    """The stop token (one of stops, the stop ids' strings in their order) ending an assistant turn that calls
    tools, where the tool turn starts in the whole conversation's text, and the tool turn's text around
    num_results results: num_results + 1 pieces (choice 1). Raises ValueError, naming the template by label,
    for no results, or a template that is not append-only for tool turns, renders no tool_calls, writes no
    stop token at the turn's end, or renders other than one piece per result."""
    if num_results < 1:
        raise ValueError(f"a tool turn needs at least one result, got {num_results}")
    # private-use characters: no template or tokenizer reads them as anything
    marks = [f"\ue000{i}\ue000" for i in range(num_results)]
    prompt, before, after = tool_conversation(render, marks)
    for short, long, what in ((prompt, before, "the assistant turn does not extend the generation prompt"),
                              (before, after, "the tool messages do not extend the assistant turn")):
        if not long.startswith(short):
            at = next(i for i, (a, b) in enumerate(zip(short, long + "\0")) if a != b)
            shown = [functools.reduce(lambda t, i: t.replace(marks[i], f"<result {i}>"), range(num_results), x)
                     for x in (short[at:at + 40], long[at:at + 40])]
            raise ValueError(f"{label} is not append-only for tool turns: {what} (at character {at}: "
                             f"{shown[0]!r} becomes {shown[1]!r})")
    calls_end = before.rfind(TOOL_PLACEHOLDER) + len(TOOL_PLACEHOLDER)
    if calls_end <= len(prompt):
        raise ValueError(f"{label} does not render an assistant message's tool_calls")
    # The model samples the stop token; what the template writes after it (Qwen's "\n") is the turn's.
    ends = sorted((before.find(s, calls_end), s) for s in stops if before.find(s, calls_end) >= 0)
    if ends:
        at, stop = ends[0]
    else:  # the template writes the stop token with the results (GLM-4.5's <|observation|>)
        at, stop = len(before), next((s for s in stops if after.startswith(s, len(before))), None)
        if stop is None:
            raise ValueError(f"{label} writes none of the stop tokens {sorted(stops)} after an assistant's tool "
                             f"calls or before the tool results: no sampled token can end the turn")
    start = at + len(stop)
    pieces = re.split("|".join(map(re.escape, marks)), after[start:])
    if len(pieces) != num_results + 1:
        raise ValueError(f"{label} renders {len(pieces) - 1} of {num_results} tool results in the tool turn")
    return stop, start, pieces


def tool_turn_text(render: Render, results: list[str], *, stops: tuple[str, ...],
                   label: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The text that follows an assistant turn which called len(results) tools and ended with its stop token
    (`tool_turn`'s): the results as the template renders them, then the next generation prompt; and where each
    result lies in it ((start, end) character offsets). Raises ValueError as `tool_turn` does, and for a
    template that renders a result otherwise than verbatim."""
    _, start, pieces = tool_turn(render, len(results), stops=stops, label=label)
    text, data = pieces[0], []
    for result, piece in zip(results, pieces[1:]):
        data.append((len(text), len(text) + len(result)))  # where special-token strings are data
        text += result + piece
    if tool_conversation(render, results)[2][start:] != text:
        raise ValueError(f"{label} renders a tool result otherwise than verbatim (or "
                         f"depends on its text): tool turns need the results' text as given")
    return text, tuple(data)
