"""A Lark grammar (llguidance dialect) for DeepSeek's DSML tool-call block.

With ``tool_choice: required`` recipe renders the prompt up to an opened
``<｜DSML｜ calls>`` block and asks for a ``tool_call_required`` constraint over the
declared tools. This grammar makes the model write one or more well-formed invocations of
declared tools, then close the block::

    <｜DSML｜ invoke name="NAME">
    <｜DSML｜ parameter name="P" string="true">text</｜DSML｜ parameter>
    <｜DSML｜ parameter name="Q" string="false">{json per the parameter's schema}</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

String-typed parameters are raw text without ``<`` (one of the ``enum`` values when the
schema lists them, at most ``maxLength`` characters when it bounds them); every other
parameter is JSON valid under its own schema (llguidance ``%json``). Required parameters come first, in schema
order, then each optional one may appear once, in schema order.
"""

from __future__ import annotations

import json
from typing import Any

_DSML = "｜DSML｜"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _string_value(schema: dict[str, Any]) -> str:
    """Raw text without ``<``; an ``enum`` of strings is a choice of literals, ``maxLength`` bounds it."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lit(v) for v in enum) + ")"
    max_len = schema.get("maxLength")
    if isinstance(max_len, int) and max_len >= 0:
        return f"/[^<]{{0,{max_len}}}/"
    return "/[^<]*/"


def _param_rule(name: str, schema: Any) -> str:
    is_string = isinstance(schema, dict) and schema.get("type") == "string"
    head = _lit(f'<{_DSML} parameter name="{name}" string="{"true" if is_string else "false"}">')
    tail = _lit(f"</{_DSML} parameter>\n")
    if is_string:
        value = _string_value(schema)
    else:
        value = "%json " + json.dumps(schema if isinstance(schema, dict) else {}, ensure_ascii=False)
    return f"{head} {value} {tail}"


def _tool_rules(index: int, tool: dict[str, Any]) -> list[str]:
    fn = tool.get("function", tool)
    name = str(fn["name"])
    params = fn.get("parameters") or {}
    props = params.get("properties") or {} if isinstance(params, dict) else {}
    required = [p for p in (params.get("required") or []) if p in props] if isinstance(params, dict) else []
    optional = [p for p in props if p not in required]
    rules = []
    body = []
    for j, pname in enumerate(required + optional):
        rule = f"t{index}_p{j}"
        rules.append(f"{rule}: {_param_rule(pname, props[pname])}")
        body.append(rule if pname in required else f"{rule}?")
    head = _lit(f'<{_DSML} invoke name="{name}">\n')
    tail = _lit(f"</{_DSML} invoke>\n")
    rules.insert(0, f"t{index}: {head} {' '.join(body)} {tail}")
    return rules


def tool_call_grammar(tools: list[dict[str, Any]], opened: bool = True, single: bool = False) -> str:
    """Lark grammar for a DSML calls block over ``tools`` (Chat Completions function tools).

    ``opened``: the prompt already ends with the block's opening line (recipe's rendering
    for a required tool choice), so the grammar starts at the first invocation.
    ``single``: exactly one invocation (``parallel_tool_calls: false``).
    """
    if not tools:
        raise ValueError("tool_call_grammar needs at least one tool")
    rules: list[str] = []
    for i, tool in enumerate(tools):
        rules.extend(_tool_rules(i, tool))
    invoke = " | ".join(f"t{i}" for i in range(len(tools)))
    opener = "" if opened else _lit(f"<{_DSML} calls>\n") + " "
    repeat = "" if single else "+"
    start = f"start: {opener}invoke{repeat} {_lit(f'</{_DSML} calls>')}\ninvoke: {invoke}\n"
    return start + "\n".join(rules) + "\n"
