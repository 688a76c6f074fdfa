"""The README and docs/ as a reader uses them: every command they show runs, every config snippet
loads.

Commands (tests/doc_snippets.py says which lines are commands) run with bash, one block after
another, each block in a fresh directory that holds the repository's top-level entries as links
(so ``.venv/bin/python``, ``scripts/`` and ``daemon/`` resolve while whatever a command writes
lands in the temporary directory) and the inputs the docs assume (:func:`_prepare_inputs`), with
the project venv first on PATH (``nodescope`` and ``python`` are the checkout's). What makes a
command fit a test machine is rewritten, nothing else: a ``--listen`` port becomes a free
loopback port (and the same address in the block's later commands), ``/tmp/`` the block's own
directory, a ``sleep`` of the doc one second (the test waits for what it waited for instead).
``nodescope run`` and ``nodescope demo`` serve until stopped: they run in the background until
their /metrics answers, stay up for the rest of their block and are stopped at its end. A
command that asks a running daemon (``nodescope alerts``, an address on the default port 9839)
asks one ``nodescope demo`` shared by the whole run, started when the first one needs it.

Commands that cannot run here (root, Slurm, a GPU, a kernel module, systemd as PID 1, the
network, minutes of benchmark) are listed, with the reason, in docs_marked.txt beside this file.
The list is kept current both ways: an entry that no longer appears in its doc fails, and so
does a new command that is neither run nor listed.

Snippets: every ``toml`` block loads through nodescope's configuration loader; every ``yaml``
block that is Prometheus rules passes ``promtool check rules``, a Prometheus configuration
``promtool check config`` (its rule files are the shipped ones), a web configuration nodescope's
own loader (with certificates made for it), an Alertmanager configuration ``amtool
check-config``; every ``json`` block that belongs to a scenario or fleet file loads through
the simulator's loaders, its expected finding kinds among the kinds the detectors emit.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import doc_snippets
from tests.conftest import FIXTURES, REPO
from tests.integration.daemon_harness import free_port

pytestmark = pytest.mark.integration

MARKED_FILE = Path(__file__).with_name("docs_marked.txt")
VENV_BIN = Path(sys.executable).parent
COMMAND_TIMEOUT = 120.0
SERVE_TIMEOUT = 60.0
DEFAULT_PORT = 9839

#: Commands whose documented outcome is not exit status 0: (doc, start of the command) ->
#: the statuses the doc gives, words of the doc that say so (checked to be there, so the two
#: cannot drift apart) and whether the doc says it prints nothing.
DOCUMENTED_STATUS: tuple[tuple[str, str, frozenset[int], str, bool], ...] = (
    ("docs/architecture.md", "grep ", frozenset({1}), "prints nothing (and exits 1", True),
    # This machine's own verdict: healthy, or degraded where a source cannot be read here.
    ("docs/check.md", "nodescope check", frozenset({0, 1}), "| 1 | degraded |", False),
    ("docs/check.md", "nodescope check --scenario", frozenset({1, 2}), "| 2 | failed |", False),
)

#: Long-running commands: they serve /metrics until stopped.
_SERVER = re.compile(r"^nodescope (run|demo)\b(?!.*--list)")
_LISTEN = re.compile(r"--listen (?:127\.0\.0\.1|localhost|\[::1\]):(\d+)")
_SLEEP = re.compile(r"^sleep \d+(\.\d+)?$")


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _all_commands() -> list[doc_snippets.Command]:
    return [
        command
        for path in _docs()
        for command in doc_snippets.commands(str(path.relative_to(REPO)), path.read_text())
    ]


@dataclass(frozen=True, slots=True)
class Marked:
    doc: str
    command: str
    reason: str


def _marked() -> list[Marked]:
    entries: list[Marked] = []
    for number, line in enumerate(MARKED_FILE.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        doc, _, rest = line.partition(" | ")
        command, _, reason = rest.rpartition(" | ")
        assert doc and command and reason.strip(), f"{MARKED_FILE.name}:{number}: {line!r}"
        entries.append(Marked(doc, doc_snippets.normalise(command), reason.strip()))
    return entries


def test_marked_commands_are_still_in_the_docs() -> None:
    shown = {(c.doc, c.text) for c in _all_commands()}
    stale = [m for m in _marked() if (m.doc, m.command) not in shown]
    assert not stale, f"listed in {MARKED_FILE.name} but no longer in the docs: {stale}"


def test_documented_statuses_are_what_the_docs_say() -> None:
    for doc, _, _, words, _ in DOCUMENTED_STATUS:
        assert words in (REPO / doc).read_text(), (doc, words)


def _documented(command: doc_snippets.Command) -> tuple[frozenset[int], bool]:
    """The exit statuses the doc gives the command, and whether it must print nothing (the
    longest matching start wins)."""
    best: tuple[int, frozenset[int], bool] = (-1, frozenset({0}), False)
    for doc, start, statuses, _, silent in DOCUMENTED_STATUS:
        if doc == command.doc and command.text.startswith(start) and len(start) > best[0]:
            best = (len(start), statuses, silent)
    return best[1], best[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("NOTIFY_SOCKET", None)
    return env


def _prepare_inputs(workdir: Path) -> None:
    """The repository's top-level entries as links, and the files the docs assume a reader has:
    a job's traces (traces/, rank*.json.gz, /tmp/fr/dump_rank_*) from the PyTorch captures in
    tests/fixtures/torch-traces, and a real ``lspci -vvv`` of an HGX H100 as lspci.txt."""
    for entry in REPO.iterdir():
        if entry.name not in {".git", "build"}:
            (workdir / entry.name).symlink_to(entry)
    traces = FIXTURES / "torch-traces"
    (workdir / "traces").mkdir()
    (workdir / "tmp" / "fr").mkdir(parents=True)
    for rank in range(4):
        profile = (traces / f"rank{rank}.json").read_bytes()
        (workdir / "traces" / f"rank{rank}.json").write_bytes(profile)
        (workdir / f"rank{rank}.json.gz").write_bytes(gzip.compress(profile))
        shutil.copy(
            traces / f"fr_trace_rank_{rank}.json", workdir / "tmp" / "fr" / f"dump_rank_{rank}"
        )
    shutil.copy(FIXTURES / "captures" / "hgx-h100" / "lspci-vvv.hgx-h100", workdir / "lspci.txt")


def _adapt(text: str, workdir: Path, ports: dict[str, int], daemon: _SharedDaemon) -> str:
    """The command as it runs here: loopback ports free, /tmp the block's own, a daemon the
    command asks (the default port, ``nodescope alerts``) the shared one."""
    for listen in _LISTEN.finditer(text):
        if listen.group(1) != "0":
            ports.setdefault(listen.group(1), free_port())
    for documented, port in ports.items():
        text = re.sub(
            rf"(127\.0\.0\.1|localhost|\[::1\]):{documented}\b", f"127.0.0.1:{port}", text
        )
    text = re.sub(r"(?<![\w.])/tmp/", f"{workdir}/tmp/", text)
    if re.search(rf"(127\.0\.0\.1|localhost):{DEFAULT_PORT}\b", text):
        text = re.sub(rf"(127\.0\.0\.1|localhost):{DEFAULT_PORT}\b", daemon.url()[7:], text)
    if re.match(r"^nodescope alerts\b", text) and "--url" not in text:
        text += f" --url {daemon.url()}"
    if _SLEEP.match(text):
        return "sleep 1"
    if _SERVER.match(text.removesuffix("&").strip()) and "--listen" not in text:
        port = free_port()
        text = text.removesuffix("&").strip() + f" --listen 127.0.0.1:{port}"
    if re.match(r"^nodescope run\b", text) and not re.search(r"--run(=|\s|$)", text):
        # The host's /run/nodescope holds the hook socket of any other daemon on this machine
        # (another test's, side by side): the block's daemon keeps its own.
        text = text.removesuffix("&").strip() + f" --run {workdir}/run"
    return text


@dataclass
class _Server:
    command: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self, port: int) -> None:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"{self.command!r} exited:\n{self.output()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    if r.status == 200 and b"nodescope_" in r.read():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.command!r}: no /metrics within {SERVE_TIMEOUT}s")

    def stop(self) -> None:
        alive = self.process.poll() is None
        if alive:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        assert alive, f"{self.command!r} stopped before its block ended:\n{self.output()}"


class _SharedDaemon:
    """One ``nodescope demo`` of the healthy baseline for every command that talks to a running
    daemon (``nodescope alerts``, an address on the default port 9839), started on first use."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.server: _Server | None = None
        self.port = 0

    def url(self) -> str:
        if self.server is None:
            self.port = free_port()
            command = f"nodescope demo dgx-h100 --no-tty --listen 127.0.0.1:{self.port}"
            self.server, _ = _start(command, self.workdir, 0)
            self.server.wait_serving(self.port)
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def _start(text: str, workdir: Path, index: int) -> tuple[_Server, int]:
    listen = _LISTEN.search(text)
    assert listen, f"{text!r}: a server command with no loopback --listen"
    log = workdir / f"server-{index}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", "exec " + text.removesuffix("&").strip()],
            cwd=workdir,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return _Server(text, process, log), int(listen.group(1))


def _run_block(
    block: list[doc_snippets.Command], workdir: Path, daemon: _SharedDaemon
) -> list[str]:
    """Run a block's commands in order; what went wrong, one line each."""
    failures: list[str] = []
    ports: dict[str, int] = {}
    servers: list[_Server] = []
    try:
        for index, command in enumerate(block):
            text = _adapt(command.text, workdir, ports, daemon)
            where = f"{command.doc}:{command.line}: {command.text}"
            started = time.monotonic()
            if _SERVER.match(text.removesuffix("&").strip()) or text.endswith("&"):
                server, port = _start(text, workdir, index)
                servers.append(server)
                server.wait_serving(port)
                print(f"{time.monotonic() - started:6.1f}s serving: {where}")
                continue
            statuses, silent = _documented(command)
            # A documented pytest run gets its own temporary root: left to find its own, it
            # would clean up the numbered roots of this run's other pytest processes.
            env = _env()
            env["PYTEST_ADDOPTS"] = f"--basetemp={workdir / 'pytest-tmp'} -p no:cacheprovider"
            try:
                done = subprocess.run(
                    ["bash", "-c", text],
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=COMMAND_TIMEOUT,
                )
            except subprocess.TimeoutExpired:
                failures.append(f"{where}: still running after {COMMAND_TIMEOUT:.0f}s")
                continue
            output = (done.stdout + done.stderr).decode(errors="replace")
            print(f"{time.monotonic() - started:6.1f}s exit {done.returncode}: {where}")
            if done.returncode not in statuses:
                failures.append(
                    f"{where}: exit {done.returncode} (documented {sorted(statuses)}):\n"
                    f"{output[-3000:]}"
                )
            elif silent and output:
                failures.append(f"{where}: the doc says it prints nothing; it printed:\n{output}")
    finally:
        for server in servers:
            try:
                server.stop()
            except AssertionError as error:
                failures.append(f"{block[0].doc}: {error}")
    return failures


def _blocks(commands: list[doc_snippets.Command]) -> Iterator[list[doc_snippets.Command]]:
    current: list[doc_snippets.Command] = []
    for command in commands:
        if current and (command.doc, command.block) != (current[0].doc, current[0].block):
            yield current
            current = []
        current.append(command)
    if current:
        yield current


def test_every_documented_command_runs_or_is_marked(tmp_path: Path) -> None:
    marked = {(m.doc, m.command) for m in _marked()}
    runnable = [c for c in _all_commands() if (c.doc, c.text) not in marked]
    assert runnable, "no command found to run: the extraction no longer matches the docs"
    failures: list[str] = []
    daemon = _SharedDaemon(tmp_path)
    try:
        for number, block in enumerate(_blocks(runnable)):
            workdir = tmp_path / f"block{number}"
            workdir.mkdir()
            _prepare_inputs(workdir)
            failures.extend(_run_block(block, workdir, daemon))
    finally:
        daemon.stop()
    print(f"\n{len(runnable)} documented commands run, {len(marked)} marked")
    assert not failures, "\n\n".join(failures)


# --------------------------------------------------------------------------------------------
# Configuration snippets


def _all_snippets(languages: frozenset[str]) -> list[doc_snippets.Snippet]:
    return [
        snippet
        for path in _docs()
        for snippet in doc_snippets.snippets(
            str(path.relative_to(REPO)), path.read_text(), languages
        )
    ]


def test_every_toml_snippet_loads(tmp_path: Path) -> None:
    from nodescope import assembly

    snippets = _all_snippets(frozenset({"toml"}))
    assert snippets
    for number, snippet in enumerate(snippets):
        path = tmp_path / f"snippet{number}.toml"
        path.write_text(snippet.text)
        try:
            assembly.load(path)
        except Exception as error:  # the loader's own message says what is wrong
            pytest.fail(f"{snippet.doc}:{snippet.line}: {error}")
    print(f"\n{len(snippets)} toml snippets loaded")


def _make_tls_files(directory: Path, names: set[str]) -> dict[str, Path]:
    """A CA and a certificate it signed for localhost, under each name a snippet gives a
    certificate, key or CA file (``*.crt``: the certificate, ``ca.crt``: the CA)."""
    directory.mkdir(exist_ok=True)
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "leaf.key", directory / "leaf.csr", directory / "leaf.crt"
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make the web configuration's certificates"
    for args in (
        ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", ca_key, "-out", ca_crt, "-days", "2", "-subj", "/CN=docs test CA"],
        ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "2"],
    ):  # fmt: skip
        subprocess.run([openssl, *map(str, args)], check=True, capture_output=True)
    made: dict[str, Path] = {}
    for name in names:
        if name == "ca.crt":
            made[name] = ca_crt
        elif name.endswith(".key"):
            made[name] = key
        elif name.endswith((".crt", ".pem")):
            made[name] = crt
        else:  # a password file
            made[name] = directory / name
            made[name].write_text("docs-test-password\n")
    return made


def _local_paths(text: str, tmp_path: Path) -> str:
    """The snippet with the operator's paths made real: the shipped rule files for
    /etc/prometheus/nodescope/*.yml, files made here for certificates, keys and passwords."""
    shipped = REPO / "exporters" / "prometheus"
    text = re.sub(r"/etc/prometheus/nodescope/([\w.-]+\.yml)", lambda m: str(shipped / m[1]), text)
    wanted = set(re.findall(r"/etc/[\w/.-]*/([\w.-]+\.(?:crt|key|pem|password))", text))
    if wanted:
        made = _make_tls_files(tmp_path / "tls", wanted)
        text = re.sub(
            r"/etc/[\w/.-]*/([\w.-]+\.(?:crt|key|pem|password))", lambda m: str(made[m[1]]), text
        )
    return text


def _check_yaml(snippet: doc_snippets.Snippet, tmp_path: Path) -> str:
    """Check one YAML snippet with the tool that reads it; what it was checked as."""
    import yaml

    text = _local_paths(snippet.text, tmp_path)
    document = yaml.safe_load(text)
    if isinstance(document, list):  # entries shown out of their list: a scrape_configs item
        assert all(isinstance(e, dict) and "job_name" in e for e in document), snippet
        text = "scrape_configs:\n" + text
        document = {"scrape_configs": document}
    assert isinstance(document, dict), f"{snippet.doc}:{snippet.line}: not a YAML mapping"
    path = tmp_path / "snippet.yml"
    path.write_text(text)
    keys = set(document)
    if "groups" in keys:
        tool = [_tool("promtool"), "check", "rules", str(path)]
        kind = "Prometheus rules (promtool check rules)"
    elif keys & {"scrape_configs", "rule_files", "remote_write", "global", "alerting"}:
        tool = [_tool("promtool"), "check", "config", str(path)]
        kind = "Prometheus configuration (promtool check config)"
    elif keys & {"tls_server_config", "http_server_config", "basic_auth_users"}:
        from nodescope import webconfig

        # The doc elides the bcrypt hash; a real one stands in for it.
        hashed = "$2y$10$" + "a" * 53
        path.write_text(re.sub(r"\$2[aby]\$\d\d\$\.\.\.", hashed, text))
        try:
            webconfig.load(str(path))
        except Exception as error:  # the loader's own message says what is wrong
            pytest.fail(f"{snippet.doc}:{snippet.line}: {error}")
        return "web configuration (nodescope's loader)"
    elif keys & {"route", "receivers"}:
        tool = [_tool("amtool"), "check-config", str(path)]
        kind = "Alertmanager configuration (amtool check-config)"
    else:
        return "YAML (parsed; no tool reads it here)"
    done = subprocess.run(tool, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{snippet.doc}:{snippet.line}: {done.stdout}{done.stderr}"
    return kind


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def test_every_yaml_snippet_is_valid(tmp_path: Path) -> None:
    snippets = _all_snippets(frozenset({"yaml", "yml"}))
    assert snippets
    kinds: list[str] = []
    for number, snippet in enumerate(snippets):
        directory = tmp_path / f"snippet{number}"
        directory.mkdir()
        kinds.append(f"{snippet.doc}:{snippet.line}: {_check_yaml(snippet, directory)}")
    print("\n" + "\n".join(kinds))


# --------------------------------------------------------------------------------------------
# Scenario and fleet examples (docs/scenarios.md and any doc that shows one)


def _finding_kinds() -> set[str]:
    """The kinds the detectors emit, as far as code and data say: every kind with a built-in
    alert rule, and every kind a bundled scenario expects (the replay tests prove those)."""
    from nodescope.detectors.registry import ALERT_RULES
    from nodescope.sim.scenario import SCENARIO_DIR

    kinds = set(ALERT_RULES)
    for path in SCENARIO_DIR.glob("*.json"):
        expect = json.loads(path.read_text()).get("expect", {})
        kinds.update(f["kind"] for f in expect.get("findings", []))
    return kinds


def _scenario_examples() -> list[tuple[doc_snippets.Snippet, Any]]:
    return [
        (snippet, doc_snippets.json_fragment(snippet.text))
        for snippet in _all_snippets(frozenset({"json"}))
    ]


def _placements(value: Any, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The example as whole scenario documents: a whole one as it is; a member shown out of its
    object at each level it may belong to (the top, ``hardware``, ``hardware.os``); a job or
    timeline entries put into the doc's own example scenario. Empty: not a scenario (a fleet,
    or JSON of another kind)."""
    if isinstance(value, dict) and "format" in value:
        return [value] if value["format"] == "nodescope-scenario/1" else []
    if isinstance(value, dict) and {"id", "user"} <= set(value):
        return [{**copy.deepcopy(base), "jobs": [value]}]
    if isinstance(value, dict) and "kind" in value:
        value = [value]
    if isinstance(value, list) and all(isinstance(e, dict) and "kind" in e for e in value):
        return [_with_stand_ins({**copy.deepcopy(base), "timeline": value})]
    if not isinstance(value, dict) or len(value) != 1:
        return []
    top = {**copy.deepcopy(base), **value}
    hardware = copy.deepcopy(base)
    hardware["hardware"] = {**hardware["hardware"], **value}
    os_level = copy.deepcopy(base)
    os_level["hardware"] = {**os_level["hardware"]}
    os_level["hardware"]["os"] = {**os_level["hardware"].get("os", {}), **value}
    return [top, hardware, os_level]


def _with_stand_ins(document: dict[str, Any]) -> dict[str, Any]:
    """Timeline entries shown together come from different scenarios: a process one names that
    the doc's examples do not define (``stale-rsync``) becomes a plain system process, so the
    loader judges the entries themselves."""
    defined = {p["key"] for job in document.get("jobs", []) for p in job.get("processes", [])}
    os_spec = document["hardware"].setdefault("os", {})
    system = os_spec.setdefault("system_processes", [])
    defined.update(p["key"] for p in system)
    for entry in document["timeline"]:
        names = [entry.get("holder"), entry.get("process"), *entry.get("waiters", [])]
        for name in names:
            if isinstance(name, str) and name.split("#")[0] not in defined:
                system.append({"key": name, "comm": name[:15]})
                defined.add(name)
    return document


def _load_one(documents: list[dict[str, Any]], path: Path) -> Any:
    """The first placement the loader accepts; its error for the first when none is."""
    from nodescope.sim.scenario import parse_scenario

    errors: list[str] = []
    for document in documents:
        try:
            return parse_scenario(document, path)
        except Exception as error:  # the loader's message names the file and the pointer
            errors.append(str(error))
    raise AssertionError(errors[0])


def test_every_scenario_example_loads(tmp_path: Path) -> None:
    from nodescope.sim.fleet import parse_fleet

    examples = _scenario_examples()
    wholes = [v for _, v in examples if isinstance(v, dict) and "format" in v]
    base = next(v for v in wholes if v["format"] == "nodescope-scenario/1")
    # The examples' jobs and processes, so that timeline entries naming them resolve.
    rich = copy.deepcopy(base)
    for _, value in examples:
        if isinstance(value, dict) and {"id", "user"} <= set(value):
            rich["jobs"] = [*rich.get("jobs", []), value]
        if isinstance(value, dict) and set(value) == {"system_processes"}:
            rich["hardware"] = {**rich["hardware"], "os": value}
    # The examples are read as files beside the bundled ones would be: `"hardware": {"base":
    # "hardware.json"}` is the file the doc's convert command writes, and a `trace` names a
    # file of the packaged traces as `../data/...`.
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (tmp_path / "data").symlink_to(REPO / "daemon" / "nodescope" / "sim" / "data")
    subprocess.run(
        [sys.executable, "-m", "nodescope.sim.convert",
         str(FIXTURES / "captures" / "hgx-h100" / "lspci-vvv.hgx-h100")],
        check=True, stdout=(scenarios / "hardware.json").open("wb"), timeout=60,
    )  # fmt: skip
    kinds = _finding_kinds()
    checked = 0
    for snippet, value in examples:
        where = f"{snippet.doc}:{snippet.line}"
        path = scenarios / f"{snippet.doc.replace('/', '_')}-{snippet.line}.json"
        if isinstance(value, dict) and value.get("format") == "nodescope-fleet/1":
            parse_fleet(value, path)
            checked += 1
            continue
        timeline = isinstance(value, list) or (isinstance(value, dict) and "kind" in value)
        documents = _placements(value, rich if timeline else base)
        if not documents:
            continue
        try:
            scenario = _load_one(documents, path)
        except AssertionError as error:
            pytest.fail(f"{where}: {error}")
        expected = {f.kind for f in scenario.expect.findings}
        assert expected <= kinds, f"{where}: no detector emits {sorted(expected - kinds)}"
        checked += 1
    assert checked >= len(wholes)
    print(f"\n{checked} scenario and fleet examples loaded")


def test_install_md_states_the_package_tests_exposure_bound() -> None:
    """install.md gives the bound the package test enforces, not a score that goes stale."""
    from tests.integration.test_packages import MAX_EXPOSURE

    text = " ".join((REPO / "docs" / "install.md").read_text().split())
    bounds = re.findall(r"(?:exposure is at most|scores the unit at most) ([0-9.]+)", text)
    assert len(bounds) == 2, bounds
    assert {float(b.rstrip(".")) for b in bounds} == {MAX_EXPOSURE}


def test_adapt_makes_ports_free_and_tmp_the_blocks_own(tmp_path: Path) -> None:
    daemon = _SharedDaemon(tmp_path)
    ports: dict[str, int] = {}
    served = _adapt("nodescope demo x --listen 127.0.0.1:19839 --no-tty &", tmp_path, ports, daemon)
    port = ports["19839"]
    assert served == f"nodescope demo x --listen 127.0.0.1:{port} --no-tty &"
    later = _adapt("curl -s http://localhost:19839/metrics > m.txt", tmp_path, ports, daemon)
    assert later == f"curl -s http://127.0.0.1:{port}/metrics > m.txt"
    assert _adapt("ls /tmp/fr/x /var/tmp/y", tmp_path, ports, daemon) == (
        f"ls {tmp_path}/tmp/fr/x /var/tmp/y"
    )
    assert _adapt("sleep 60", tmp_path, ports, daemon) == "sleep 1"
    bare = _adapt("nodescope run --config c.toml", tmp_path, ports, daemon)
    assert re.fullmatch(
        rf"nodescope run --config c\.toml --listen 127\.0\.0\.1:\d+ --run {tmp_path}/run", bare
    )
    assert daemon.server is None  # nothing asked the daemon: none started


def test_commands_that_ask_a_daemon_get_the_shared_demo(tmp_path: Path) -> None:
    """``nodescope alerts`` and the default port reach one demo; it serves both."""
    block = [
        doc_snippets.Command("x.md", 2, 1, "nodescope alerts --json"),
        doc_snippets.Command("x.md", 3, 1, "curl -sf http://127.0.0.1:9839/metrics > m.txt"),
    ]
    daemon = _SharedDaemon(tmp_path)
    try:
        assert _run_block(block, tmp_path, daemon) == []
        assert daemon.server is not None
    finally:
        daemon.stop()
    assert "nodescope_" in (tmp_path / "m.txt").read_text()


def test_command_blocks_say_they_are_shell() -> None:
    """A block of commands without a language tag would escape the test: it must say ``sh``.
    (A usage synopsis, ``nodescope run [-h] ...``, is no command.)"""
    from nodescope.cli.main import build_parser
    from nodescope.clidocs import commands

    subcommands = "|".join(sorted({c.words[1] for c in commands(build_parser()) if c.words[1:]}))
    programs = r"bash|sudo|python3?|make|curl|\.venv/bin/\S+"
    command = re.compile(rf"^(nodescope ({subcommands})\b|({programs}) )")
    untagged = [
        f"{path.relative_to(REPO)}:{block.line}"
        for path in _docs()
        for block in doc_snippets.blocks(path.read_text())
        if not block.lang
        and (lines := [line for line in block.body if line.strip()])
        and command.match(lines[0])
        and "[-h]" not in lines[0]
    ]
    assert not untagged, f"command blocks without ```sh: {untagged}"
