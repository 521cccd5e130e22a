"""The one parser of JSON documents read from storage: commit markers, attempt records, DCP
metadata, a checkpoint's JSON state, aggregation parts.

Such bytes are input that anyone with write access to the bucket (or a damaged disk) can
shape. ``json.loads`` alone fails on them in ways a caller does not expect: a
``RecursionError`` on deep nesting (and a document it can still parse may be too deep for the
recursive code that walks it next), a bare ``ValueError`` on a number of thousands of digits.
``parse_json`` turns every such failure into ``JsonDocumentError``, a ``ValueError`` with a
one-line reason, which each caller wraps into its own error naming the file and the fix
(``CorruptCheckpointError`` for a checkpoint's files).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "JsonDocumentError", "parse_json"]

#: the deepest nesting of arrays and objects accepted: far beyond what Zephon writes (a state
#: dict's skeleton nests as deep as the user's state, a marker 3 levels), and shallow enough
#: for the recursive code that walks a parsed document (``zephon.state_tree``)
MAX_JSON_DEPTH = 100


class JsonDocumentError(ValueError):
    """Bytes that are not a JSON document Zephon reads; ``reason`` says why, in one line that
    reads after "<file> is" ("not valid JSON (...)", "nested deeper than 100 levels")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_json(data: bytes | str) -> Any:
    """The JSON value in ``data`` (UTF-8 bytes or text), nested at most ``MAX_JSON_DEPTH``
    deep; ``JsonDocumentError`` otherwise."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        value = json.loads(text)
    except UnicodeDecodeError as exc:
        raise JsonDocumentError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise JsonDocumentError(f"not valid JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise JsonDocumentError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # Python's limit on the digits of an integer
        raise JsonDocumentError("not readable: a number has too many digits") from None
    # Cheap first: a document with fewer brackets than the limit cannot be nested deeper.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _deeper_than(value, MAX_JSON_DEPTH):
        raise JsonDocumentError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects in ``value`` nest deeper than ``limit`` (iteratively: the
    point is not to recurse)."""
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
