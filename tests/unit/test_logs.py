"""Log lines: logfmt or JSON with the same fields, one quoting rule, RFC 3339 time stamps unless
stderr is the journal's; every log call in the code writes fields, not prose."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from nodescope import logs
from tests.conftest import REPO


def _record(template: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.LogRecord(
        "nodescope.test", logging.WARNING, __file__, 1, template, args, exc_info
    )


def _parse_logfmt(line: str) -> dict[str, str]:
    """A strict reader of the rule: bare values or double-quoted ones with escapes."""
    out: dict[str, str] = {}
    i = 0
    while i < len(line):
        m = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*)=").match(line, i)
        assert m, line[i:]
        key, i = m.group(1), m.end()
        if line[i : i + 1] == '"':
            i += 1
            value = []
            while line[i] != '"':
                if line[i] == "\\":
                    nxt = line[i + 1]
                    if nxt == "x":
                        value.append(chr(int(line[i + 2 : i + 4], 16)))
                        i += 4
                        continue
                    if nxt in "uU":
                        width = 4 if nxt == "u" else 8
                        value.append(chr(int(line[i + 2 : i + 2 + width], 16)))
                        i += 2 + width
                        continue
                    value.append({"n": "\n", "t": "\t"}.get(nxt, nxt))
                    i += 2
                    continue
                value.append(line[i])
                i += 1
            out[key] = "".join(value)
            i += 1
        else:
            end = line.find(" ", i)
            end = len(line) if end < 0 else end
            out[key] = line[i:end]
            i = end
        assert line[i : i + 1] in ("", " ")
        i += 1
    return out


def test_fields_follow_the_template_whatever_the_conversion() -> None:
    record = _record("source=%s state=down error=%r took_ms=%.1f", "nvml", "no 'lib'", 1.25)
    assert logs.fields(record) == [
        ("source", "nvml"),
        ("state", "down"),
        ("error", "no 'lib'"),
        ("took_ms", "1.2"),
    ]


def test_prose_is_one_msg_field() -> None:
    record = _record("something happened to %s", "x")
    assert logs.fields(record) == [("msg", "something happened to x")]


def test_logfmt_and_json_carry_the_same_fields() -> None:
    record = _record("event=x path=%s", '/tmp/a b"c')
    text = logs.FieldFormatter("logfmt").format(record)
    as_json = json.loads(logs.FieldFormatter("json").format(record))
    parsed = _parse_logfmt(text)
    assert parsed == as_json
    assert parsed["path"] == '/tmp/a b"c'
    assert parsed["level"] == "warning" and parsed["logger"] == "nodescope.test"
    # RFC 3339, UTC, milliseconds.
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", parsed["time"])
    datetime.fromisoformat(parsed["time"].replace("Z", "+00:00"))


def test_an_exception_is_one_field_on_the_same_line() -> None:
    line = logs.FieldFormatter("logfmt").format(_record("event=failed", exc=True))
    assert "\n" not in line
    assert "RuntimeError: boom" in _parse_logfmt(line)["exception"]


@given(st.text(max_size=2000))
def test_any_value_stays_one_printable_field_and_reads_back(value: str) -> None:
    line = logs.FieldFormatter("logfmt", with_time=False).format(_record("name=%s", value))
    assert line.isprintable()
    assert "\x1b" not in line
    assert _parse_logfmt(line)["name"] == value


def test_every_log_call_in_the_code_writes_key_value_fields() -> None:
    """A call written as prose would be one ``msg`` field: JSON readers could not select on it."""
    prose = []
    for root in ("daemon/nodescope", "exporters/nodescope_exporters"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "exception")
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log"
                    and node.args
                ):
                    continue
                template = node.args[0]
                if not (isinstance(template, ast.Constant) and isinstance(template.value, str)):
                    prose.append(f"{path.relative_to(REPO)}:{node.lineno} (not a literal)")
                    continue
                for token in template.value.split():
                    key, sep, _ = token.partition("=")
                    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key):
                        prose.append(f"{path.relative_to(REPO)}:{node.lineno}: {template.value}")
                        break
    assert not prose


def test_the_daemon_logs_json_with_time_and_none_under_the_journal(tmp_path: Path) -> None:
    script = (
        "import logging, sys; from nodescope import logs; logs.setup('info', sys.argv[1]);"
        " logging.getLogger('nodescope.t').info('event=hi n=%d', 3)"
    )
    err = tmp_path / "stderr"
    with err.open("w") as stream:
        subprocess.run([sys.executable, "-c", script, "json"], stderr=stream, check=True)
    document = json.loads(err.read_text())
    assert document["event"] == "hi" and document["n"] == "3" and "time" in document
    # journald stamps its lines itself: JOURNAL_STREAM names stderr's device and inode.
    st = os.stat(err)
    env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
    with err.open("w") as stream:
        subprocess.run([sys.executable, "-c", script, "logfmt"], stderr=stream, env=env, check=True)
    assert err.read_text() == "level=info logger=nodescope.t event=hi n=3\n"


@given(st.text(max_size=300))
def test_the_serving_process_quotes_by_the_same_rule(value: str) -> None:
    """The serving process (the standard library only) writes its own lines: its escape is
    the daemon's."""
    from nodescope import serving
    from nodescope.text import escape

    assert serving.escape(value) == escape(value)


def test_the_serving_process_writes_the_daemons_format(tmp_path: Path) -> None:
    from nodescope import serving

    script = (
        f"import sys; sys.path.insert(0, {str(Path(serving.__file__).parent)!r});"
        " import serving; serving.log('accept_failed', error='EMFILE: too \"many\"\\n')"
    )
    for form in ("logfmt", "json"):
        err = tmp_path / f"stderr-{form}"
        with err.open("w") as stream:
            subprocess.run(
                [sys.executable, "-I", "-S", "-c", script],
                stderr=stream,
                env={**os.environ, "NODESCOPE_LOG_FORMAT": form},
                check=True,
            )
        line = err.read_text()
        assert line.count("\n") == 1
        fields = json.loads(line) if form == "json" else _parse_logfmt(line.rstrip("\n"))
        assert fields["event"] == "accept_failed" and fields["level"] == "error"
        assert fields["error"] == 'EMFILE: too "many"\n'
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields["time"])
