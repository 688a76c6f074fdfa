"""Object budgets: how many Python objects decoding a trace file may build, known before it
is decoded.

A byte cap alone does not bound memory. ``[{},{},...]`` is three bytes per dict of 64; a
pickle names an object once and refers to it again with a two-byte memo get (``BINGET``) or
a one-byte ``DUP``, so a 2 MB pickle holds millions of references, each one an entry the
flight recorder parser turns into a record. So before a file is decoded its objects are
counted from its bytes, and a file over the budget is refused without being decoded:

* JSON: every value but the document itself follows a ``[``, a ``,`` or a ``:`` and every
  key a ``{`` or a ``,``, so those bytes plus one bound the values and keys ``json.loads``
  builds (bytes inside strings count as well: the bound is never low). ``bytes.count`` runs
  at memory speed.
* pickle: every opcode that pushes onto the unpickler's stack (an object built, a memo get,
  a ``DUP``) counts one; the walk (:func:`pickletools.genops`, which decodes the opcodes
  without building anything) stops as soon as the budget is passed, so its cost is bounded
  by the budget, not by the file.
"""

from __future__ import annotations

import pickletools

from nodescope.collectives.values import BadRecord

#: How the error of a file refused for a budget begins (the daemon tells it apart from a file
#: that is merely not a trace: it is recorded and never read again).
OVER_BUDGET = "over the budget: "

#: Pickle opcodes that push nothing: framing, the end, memo stores and the mark.
_NO_OBJECT = frozenset(
    {"PROTO", "FRAME", "STOP", "MARK", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "POP"}
)


class OverBudget(BadRecord):
    """A file that would build more objects or records than it may: refused whole."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{OVER_BUDGET}{detail}")


def json_objects(data: bytes) -> int:
    """An upper bound on the values and keys ``json.loads(data)`` builds."""
    return data.count(b"[") + data.count(b"{") + data.count(b",") + data.count(b":") + 1


def check_json(data: bytes, budget: int) -> int:
    """The bound of :func:`json_objects`; :class:`OverBudget` when it passes ``budget``."""
    count = json_objects(data)
    if count > budget:
        raise OverBudget(f"up to {count} JSON values, {budget} allowed")
    return count


def check_pickle(data: bytes, budget: int) -> int:
    """The objects and references a pickle pushes, counted opcode by opcode up to
    ``budget``; :class:`OverBudget` past it. A pickle whose opcodes cannot be decoded is
    refused as well (the unpickler reads the same opcodes)."""
    count = 0
    try:
        for opcode, _, _ in pickletools.genops(data):
            if opcode.name not in _NO_OBJECT:
                count += 1
                if count > budget:
                    raise OverBudget(f"more than {budget} pickled objects and references")
    except OverBudget:
        raise
    except Exception as exc:  # genops raises ValueError and friends on a damaged stream
        raise BadRecord(f"not a readable pickle: {type(exc).__name__}") from None
    return count


def check_records(count: int, budget: int) -> None:
    """:class:`OverBudget` once a file has given more than ``budget`` call records."""
    if count > budget:
        raise OverBudget(f"more than {budget} call records")
