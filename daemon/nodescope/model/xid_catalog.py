"""What each Xid code means to an operator: its class, severity and action, as data.

The table is ``nodescope/data/xid_catalog.json`` (docs/xids.md), after NVIDIA's Xid catalogue
(docs.nvidia.com/deploy/xid-errors): per code a short name, the class of fault
(:data:`CLASSES`), the severity a finding of it gets and what the operator should do
(:data:`ACTIONS`). A code the table does not list is of class ``unknown``, a warning, to be
investigated: a new driver's Xid is worth a look, not a page.

:func:`parse_catalog` is pure; :func:`load_catalog` reads the packaged file and is called by
whoever holds the catalog for the daemon's lifetime (the detector registry), not cached here.
"""

from __future__ import annotations

import json
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from nodescope.errors import ParseError
from nodescope.model.finding import Severity

FORMAT = "nodescope-xid-catalog/1"
CATALOG_FILE = "xid_catalog.json"

#: The classes of fault, each a finding kind ``gpu_xid_<class>``.
APPLICATION = "application"
MEMORY = "memory"
NVLINK = "nvlink"
BUS = "bus"
FIRMWARE = "firmware"
THERMAL_POWER = "thermal_power"
ENGINE = "engine"
UNKNOWN = "unknown"
CLASSES: tuple[str, ...] = (
    APPLICATION,
    MEMORY,
    NVLINK,
    BUS,
    FIRMWARE,
    THERMAL_POWER,
    ENGINE,
    UNKNOWN,
)

#: What the operator does about an Xid, with the words a finding's message uses.
ACTIONS: Mapping[str, str] = MappingProxyType(
    {
        "none": "no action needed",
        "check_application": "check the application (its own fault, not the GPU's)",
        "investigate": "investigate",
        "reset_gpu": "reset the GPU",
        "drain_node": "drain the node",
        "replace_gpu": "replace the GPU",
    }
)

_SEVERITIES: Mapping[str, Severity] = MappingProxyType({s.label: s for s in Severity})


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One code of the catalog; ``known`` is false for a code the catalog does not list."""

    code: int
    name: str
    xid_class: str
    severity: Severity
    action: str
    source: str
    known: bool = True

    @property
    def kind(self) -> str:
        """The finding kind of this code's class."""
        return f"gpu_xid_{self.xid_class}"

    @property
    def action_text(self) -> str:
        return ACTIONS[self.action]


@dataclass(frozen=True, slots=True)
class XidCatalog:
    """Code -> :class:`XidInfo`, and what an unlisted code gets."""

    entries: Mapping[int, XidInfo]
    unknown_severity: Severity = Severity.WARNING
    unknown_action: str = "investigate"

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", MappingProxyType(dict(self.entries)))

    def lookup(self, code: int) -> XidInfo:
        known = self.entries.get(code)
        if known is not None:
            return known
        return XidInfo(
            code,
            "not in the catalog",
            UNKNOWN,
            self.unknown_severity,
            self.unknown_action,
            "",
            known=False,
        )


def kind_of(xid_class: str) -> str:
    """The finding kind of an Xid class: ``gpu_xid_memory``."""
    return f"gpu_xid_{xid_class}"


#: Every finding kind an Xid can make.
KINDS: tuple[str, ...] = tuple(kind_of(c) for c in CLASSES)


def _field(source: str, pointer: str, obj: Mapping[str, Any], key: str, kind: type) -> Any:
    value = obj.get(key)
    # bool is an int to Python; a code of true is a mistake in the file.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ParseError(source, f"{pointer}/{key}: must be a {kind.__name__}, got {value!r}")
    return value


def _choice(source: str, pointer: str, value: str, allowed: Any, what: str) -> None:
    if value not in allowed:
        raise ParseError(
            source, f"{pointer}: {what} {value!r} is not one of {', '.join(sorted(allowed))}"
        )


def parse_catalog(document: Any, source: str = CATALOG_FILE) -> XidCatalog:
    """The catalog from the parsed JSON document; :class:`ParseError` naming a JSON pointer
    on any entry that is not as :mod:`nodescope.model.xid_catalog` describes."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ParseError(source, f"(document): not a {FORMAT} document")
    entries = document.get("entries")
    if not isinstance(entries, list):
        raise ParseError(source, "/entries: must be an array")
    table: dict[int, XidInfo] = {}
    for i, entry in enumerate(entries):
        pointer = f"/entries/{i}"
        if not isinstance(entry, dict):
            raise ParseError(source, f"{pointer}: must be an object")
        code = _field(source, pointer, entry, "code", int)
        if not 0 < code < 10000:
            raise ParseError(source, f"{pointer}/code: {code} is out of range")
        if code in table:
            raise ParseError(source, f"{pointer}/code: Xid {code} listed twice")
        xid_class = _field(source, pointer, entry, "class", str)
        _choice(source, f"{pointer}/class", xid_class, set(CLASSES) - {UNKNOWN}, "class")
        severity = _field(source, pointer, entry, "severity", str)
        _choice(source, f"{pointer}/severity", severity, _SEVERITIES, "severity")
        action = _field(source, pointer, entry, "action", str)
        _choice(source, f"{pointer}/action", action, ACTIONS, "action")
        # An application's own fault is its owner's to see, never a page for the operator.
        if xid_class == APPLICATION and severity != Severity.INFO.label:
            raise ParseError(source, f"{pointer}/severity: an application Xid must be info")
        table[code] = XidInfo(
            code,
            _field(source, pointer, entry, "name", str),
            xid_class,
            _SEVERITIES[severity],
            action,
            _field(source, pointer, entry, "source", str),
        )
    unknown = document.get("unknown", {})
    if not isinstance(unknown, dict):
        raise ParseError(source, "/unknown: must be an object")
    severity = unknown.get("severity", Severity.WARNING.label)
    _choice(source, "/unknown/severity", severity, _SEVERITIES, "severity")
    action = unknown.get("action", "investigate")
    _choice(source, "/unknown/action", action, ACTIONS, "action")
    return XidCatalog(table, _SEVERITIES[severity], action)


def load_catalog() -> XidCatalog:
    """The packaged catalog (``nodescope/data/xid_catalog.json``), read and checked."""
    # pkgutil.get_data rather than importlib.resources, which imports zipfile, tempfile and
    # shutil (with bz2 and lzma) for this one read: 1.4 MiB of the daemon's resident memory.
    data = pkgutil.get_data("nodescope", f"data/{CATALOG_FILE}")
    if data is None:
        raise ParseError(CATALOG_FILE, "the package's loader cannot read its data files")
    try:
        document = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ParseError(CATALOG_FILE, f"byte {exc.start}: not UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise ParseError(CATALOG_FILE, f"line {exc.lineno}: {exc.msg}") from exc
    return parse_catalog(document)
