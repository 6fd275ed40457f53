"""A repetitive agentic-style workload, built here from seeded templates (no downloaded text, not Spec-Bench).

Three kinds of request, interleaved, each the turn of an agent whose answer mostly repeats text it has seen:
- `tool_calls`: a transcript of JSON tool calls (the same few tools, changing arguments), then the request for the
  next calls in the same format;
- `code_edit`: a short Python function (seeded names and constants), then the request to return it whole with one
  identifier renamed;
- `json_records`: a JSON array of records, then the request to return it with one field changed in every record.

`workload(n, seed)` is deterministic: the same (n, seed) gives the same prompts on every machine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

TOOLS = {
    "read_file": lambda g: {"path": f"src/{g.choice(['app', 'db', 'api', 'util'])}/{g.choice(['main', 'models'])}.py"},
    "search": lambda g: {"query": g.choice(["def handler", "class Config", "TODO", "import json"]), "limit": 10},
    "edit_file": lambda g: {"path": f"src/{g.choice(['app', 'api'])}/main.py", "line": g.randrange(10, 200),
                            "replace": g.choice(["return None", "pass", "raise ValueError(msg)"])},
    "run_tests": lambda g: {"path": "tests/", "verbose": True},
}
NOUNS = ["order", "user", "invoice", "session", "item", "record", "payment", "ticket"]
VERBS = ["load", "parse", "update", "validate", "merge", "compute", "fetch", "render"]


@dataclass(frozen=True)
class Turn:
    kind: str  # tool_calls | code_edit | json_records
    prompt: str


def tool_calls(g: random.Random) -> str:
    calls = []
    for _ in range(g.randrange(3, 6)):
        name = g.choice(sorted(TOOLS))
        calls.append(json.dumps({"tool": name, "arguments": TOOLS[name](g)}))
    return ("You are a coding agent. Your tool calls so far, one JSON object a line:\n" + "\n".join(calls)
            + "\nWrite the next three tool calls in the same JSON format, one a line, and nothing else.")


def code_edit(g: random.Random) -> str:
    noun, verb = g.choice(NOUNS), g.choice(VERBS)
    fn, arg, new = f"{verb}_{noun}", f"{noun}s", f"{noun}_list"
    limit, key = g.randrange(5, 50), g.choice(["id", "name", "total", "status"])
    code = (f"def {fn}({arg}, limit={limit}):\n"
            f'    """{verb.capitalize()} each {noun} and return the result."""\n'
            f"    result = []\n"
            f"    for {noun} in {arg}[:limit]:\n"
            f"        if {noun}.get(\"{key}\") is None:\n"
            f"            continue\n"
            f"        result.append({{\"{key}\": {noun}[\"{key}\"], \"ok\": True}})\n"
            f"    return result\n")
    return (f"Here is a Python function:\n\n{code}\nRename the parameter `{arg}` to `{new}` everywhere and return "
            "the whole function, nothing else.")


def json_records(g: random.Random) -> str:
    noun = g.choice(NOUNS)
    records = [{"id": i + 1, "name": f"{noun}-{g.randrange(100, 999)}", "status": g.choice(["open", "closed"]),
                "total": g.randrange(1, 500)} for i in range(g.randrange(3, 6))]
    return (f"These are the {noun} records:\n{json.dumps(records, indent=1)}\nReturn the same JSON array with "
            "\"status\" set to \"done\" in every record, and nothing else.")


KINDS = {"tool_calls": tool_calls, "code_edit": code_edit, "json_records": json_records}


def workload(n: int, seed: int = 0) -> list[Turn]:
    """n turns, the kinds in turn (tool_calls, code_edit, json_records, tool_calls, ...)."""
    g = random.Random(seed)
    kinds = sorted(KINDS)
    return [Turn(kinds[i % len(kinds)], KINDS[kinds[i % len(kinds)]](g)) for i in range(n)]
