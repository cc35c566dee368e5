"""docs/api.md's table of error types names every type the server's code raises, and no other: a client's
retry logic is written from it, so a type added to the code without a row (or a row left after its type
went) is a failure here. The types are read from the code, not run: each call that makes an error
(ApiError, BodyRefused, an ApiError subclass's __init__, the raw HTTP layer's refusals) with its type
written as a string, and each ArtifactError reason (answered as `artifact_<reason>` by /admin)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where a call that makes an error takes its type
TYPE_ARGUMENT = {"ApiError": 1, "BodyRefused": 1, "tmod_refusal": 1, "error_body": 0, "error_content": 2}


def called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def raised_types(folder: Path, argument: dict[str, int], subclasses: bool = False) -> set[str]:
    """The string types of the calls `argument` names, at its argument; with `subclasses`, also those an
    error class passes up, super().__init__(status, type, ...)."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            at, args = argument.get(called_name(node)), node.args
            passed_up = (called_name(node) == "__init__" and isinstance(node.func.value, ast.Call)
                         and called_name(node.func.value) == "super")
            if subclasses and passed_up and args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, int):
                at = 1
            if at is not None and len(args) > at and isinstance(args[at], ast.Constant) \
                    and isinstance(args[at].value, str):
                found.add(args[at].value)
    return found


def documented() -> tuple[set[str], str]:
    """(the types in docs/api.md's table, its artifact row)."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    table = text.split("### Error types", 1)[1].split("\n#", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    types = {re.match(r"\| `([^`]+)`", row).group(1) for row in rows}
    return types, next(row for row in rows if row.startswith("| `artifact_<reason>`"))


def test_every_error_type_the_server_raises_has_a_row_and_every_row_a_type():
    raised = raised_types(ROOT / "server", TYPE_ARGUMENT, subclasses=True)
    types, _ = documented()
    assert len(raised) > 30  # the scan reads the code: it found the types, not nothing
    assert raised - types == set(), "types raised but missing from docs/api.md's table"
    assert types - {"artifact_<reason>"} - raised == set(), "rows of docs/api.md's table no code raises"


def test_every_artifact_refusal_reason_is_named_in_its_row():
    reasons = raised_types(ROOT / "modules_store", {"ArtifactError": 0}) | raised_types(ROOT / "server",
                                                                                          {"ArtifactError": 0})
    _, row = documented()
    assert len(reasons) > 10
    assert {r for r in reasons if f"`{r}`" not in row} == set()
