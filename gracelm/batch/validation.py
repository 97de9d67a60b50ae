"""The checks of a batch's input file, done when the batch is validated: each non-blank line must be a JSON
object with exactly `custom_id` (a string, unique in the file), `method` ("POST"), `url` (a supported
endpoint, the batch's own) and `body` (an object). Any failure fails the whole batch with OpenAI's
`errors.data` entries (code, message, line, param), as OpenAI's validation does; nothing runs.

What the body asks is not judged here: each line's body goes, when the line runs, through the same parsing
and checks as the online route's request, and a refusal is that line's answer (a 400 in the error file).
"""

from __future__ import annotations

import json
from typing import Any

from gracelm.batch.objects import ENDPOINTS, batch_error

# A failed batch lists at most this many errors (the first ones): its object stays small whatever the file.
MAX_ERRORS = 100
_FIELDS = {"custom_id": (str, "a string"), "method": (str, "a string"), "url": (str, "a string"),
           "body": (dict, "an object")}

# A valid line: its number (from 1), custom_id, url and body (JSON text, as given).
ValidLine = tuple[int, str, str, str]


def validate_input(content: bytes, endpoint: str | None) -> tuple[list[ValidLine], list[dict[str, Any]]]:
    """The lines of a batch input file for `endpoint` (None: each line's own, any supported one), or the
    errors that fail the batch (then the lines are not to be used)."""
    lines: list[ValidLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        entry, problems = _read_line(raw, number, endpoint)
        if not problems and entry[1] in seen:
            problems = [batch_error("duplicate_custom_id", "The custom_id for this request is a duplicate of "
                                    "another request. The custom_id parameter must be unique for each "
                                    "request in a batch.", number, "custom_id")]
        if problems:
            errors += problems
        else:
            seen.add(entry[1])
            lines.append(entry)
        if len(errors) >= MAX_ERRORS:
            return [], errors[:MAX_ERRORS]
    if not lines and not errors:
        errors.append(batch_error("empty_file", "The batch input file has no request lines."))
    return lines, errors


def _read_line(raw: bytes, number: int, endpoint: str | None) -> tuple[ValidLine, list[dict[str, Any]]]:
    try:
        request = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return (number, "", "", ""), [batch_error("invalid_json_line", "This line is not parseable as valid "
                                                  "JSON.", number)]
    if not isinstance(request, dict):
        return (number, "", "", ""), [batch_error("invalid_request", "Each line must be a JSON object with "
                                                  "custom_id, method, url and body.", number)]
    problems = [_field_problem(request, name, kind, what, number) for name, (kind, what) in _FIELDS.items()]
    problems = [p for p in problems if p is not None]
    problems += [batch_error("invalid_request", f"Unrecognized request argument supplied: {name}", number,
                             name) for name in request if name not in _FIELDS]
    if problems:
        return (number, "", "", ""), problems
    if request["method"] != "POST":
        problems.append(batch_error("invalid_value", f"Only the POST method is supported, got "
                                    f"{request['method']!r}.", number, "method"))
    url = request["url"]
    if url not in ENDPOINTS:
        problems.append(batch_error("invalid_url", f"The URL {url!r} is not an endpoint batches can use; "
                                    f"supported: {', '.join(ENDPOINTS)}.", number, "url"))
    elif endpoint is not None and url != endpoint:
        problems.append(batch_error("invalid_url", f"The URL provided for this request ({url}) does not "
                                    f"match the batch endpoint ({endpoint}).", number, "url"))
    return (number, request["custom_id"], url, json.dumps(request["body"])), problems


def _field_problem(request: dict[str, Any], name: str, kind: type, what: str,
                   number: int) -> dict[str, Any] | None:
    if name not in request:
        return batch_error("missing_required_parameter", f"Missing required parameter: '{name}'.", number,
                           name)
    if not isinstance(request[name], kind):
        return batch_error("invalid_type", f"Invalid type for '{name}': expected {what}.", number, name)
    return None
