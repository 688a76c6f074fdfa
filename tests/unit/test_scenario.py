"""The scenario format: the bundled scenarios, the JSON schema, validation errors that name the
file and the JSON pointer, hardware shared by ``base``, and the lspci converter."""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.sim import convert
from nodescope.sim.lspci import bridge_chains, parse_lspci_vvv
from nodescope.sim.scenario import (
    ACTIVITY_FIELDS,
    DATA_DIR,
    FORMAT,
    INSTANT_KINDS,
    NFS4_OPS,
    SCENARIO_DIR,
    SCHEMA_PATH,
    Activity,
    Burst,
    bundled_scenarios,
    load_scenario,
    merge_patch,
    parse_scenario,
    pointer_join,
)
from tests.conftest import FIXTURES
from tests.unit.json_strategy import json_paths

CAPTURE = FIXTURES / "captures" / "hgx-h100" / "lspci-vvv.hgx-h100"
IB_CAPTURE = FIXTURES / "captures" / "h100-node-infiniband" / "sys" / "class" / "infiniband"
BUNDLED = (
    "aer-correctable-flood-root-port",
    "aer-correctable-isolated-control",
    "allreduce-hang-nfs-lock",
    "allreduce-spin-nfs-lock",
    "busy-gpus-host-network",
    "checkpoint-sync-write",
    "collective-balanced-traces-control",
    "collective-hang-rank-died",
    "collective-straggler-traces",
    "dgx-h100",
    "epoch-boundary-pause",
    "escaped-nccl-thread-cgroup",
    "escaped-nccl-threads",
    "foreign-rank-in-job-cgroup",
    "gpu-ecc-corrected-control",
    "gpu-ecc-corrected-storm",
    "gpu-ecc-uncorrectable",
    "gpu-fabric-degraded",
    "gpu-fabric-healthy-control",
    "gpu-hw-slowdown-blip-control",
    "gpu-page-retirement-control",
    "gpu-page-retirement-pending",
    "gpu-peer-nvlink-control",
    "gpu-peer-pcie-contention",
    "gpu-power-brake-slowdown",
    "gpu-power-cap-slowdown",
    "gpu-power-clock-collapse",
    "gpu-power-default-limit-control",
    "gpu-row-remap-failed",
    "gpu-row-remap-pending",
    "gpu-thermal-hw-slowdown-one-finding",
    "gpu-thermal-idle-control",
    "gpu-thermal-slowdown-under-load",
    "gpudirect-acs-redirect",
    "gpudirect-rdma-dmabuf",
    "gpudirect-rdma-line-rate",
    "hca-numa-mismatch",
    "ib-port-errors-isolated-control",
    "ib-symbol-errors-failing-link",
    "ib-symbol-errors-healthy-control",
    "ib-xmit-discards-flood",
    "job-memory-limit-page-cache-control",
    "job-memory-limit-thrash",
    "job-memory-limit-warmup",
    "job-ranks-exit-control",
    "link-downtrained",
    "nccl-threads-threaded-cgroup-control",
    "nvlink-crc-storm",
    "nvlink-crc-trickle-control",
    "nvlink-nvml-busy-control",
    "nvlink-saturation-nvml",
    "nvlink-stall-blip",
    "nvlink-stall-bursts",
    "nvme-driver-rebind",
    "nvme-hot-removed",
    "nvme-removed-under-job",
    "nvswitch-stall",
    "nvswitch-sxid-fatal",
    "nvswitch-sxid-forged-control",
    "nvswitch-sxid-nonfatal",
    "pcie-replay-busy-control",
    "pcie-replay-storm",
    "pcie-saturation-a100",
    "root-port-contention",
    "xid-forged-kernel-log-control",
    "xid13-application-fault",
    "xid48-double-bit-ecc",
    "xid79-fell-off-bus",
    "xid79-kernel-log-fell-off-bus",
)
SCHEMA = json.loads(SCHEMA_PATH.read_text())


def small_document() -> dict[str, Any]:
    """A complete scenario with an inline PCIe tree: one root port, a switch, a GPU, an NVMe
    drive, a NIC and an NVSwitch."""
    gen5 = {"speed_gts": 32.0, "width": 16}

    def bridge(primary: int, secondary: int, subordinate: int, express: str) -> dict[str, Any]:
        return {
            "class": "0x060400",
            "vendor": "0x1000",
            "device": "0xc030",
            "express": express,
            "numa_node": 0,
            "link_cap": gen5,
            "link": gen5,
            "bus": {"primary": primary, "secondary": secondary, "subordinate": subordinate},
        }

    return {
        "format": FORMAT,
        "name": "small",
        "description": "a small node",
        "tick_seconds": 1,
        "duration_seconds": 10,
        "hardware": {
            "pcie": {
                "functions": {
                    "0000:00:01.0": bridge(0, 1, 5, "Root Port"),
                    "0000:01:00.0": bridge(1, 2, 5, "Upstream Port"),
                    "0000:02:00.0": bridge(2, 3, 3, "Downstream Port"),
                    "0000:02:01.0": bridge(2, 4, 4, "Downstream Port"),
                    "0000:02:02.0": bridge(2, 5, 5, "Downstream Port"),
                    "0000:03:00.0": {
                        "class": "0x030200",
                        "vendor": "0x10de",
                        "device": "0x2330",
                        "express": "Endpoint",
                        "numa_node": 0,
                        "link_cap": gen5,
                        "link": gen5,
                    },
                    "0000:04:00.0": {
                        "class": "0x010802",
                        "vendor": "0x1344",
                        "device": "0x51c3",
                        "express": "Endpoint",
                        "numa_node": 0,
                    },
                    "0000:05:00.0": {
                        "class": "0x020700",
                        "vendor": "0x15b3",
                        "device": "0x1021",
                        "express": "Endpoint",
                        "numa_node": 0,
                    },
                    "0000:06:00.0": {"class": "0x068000", "vendor": "0x10de", "device": "0x22a3"},
                }
            },
            "cpu": {"sockets": 1, "cores_per_socket": 4, "threads_per_core": 1},
            "gpus": {
                "0": {"pci": "0000:03:00.0", "nvlinks": [{"peer": "0000:06:00.0", "count": 4}]}
            },
            "nvswitches": ["0000:06:00.0"],
            "nvme": {"nvme0n1": {"pci": "0000:04:00.0"}},
            "nics": {"mlx5_0": {"pci": ["0000:05:00.0"]}},
            "mounts": {"/mnt/ckpt": {"device": "nfs:/ckpt", "fstype": "nfs4"}},
            "os": {"background_processes": 20},
        },
        "jobs": [
            {
                "id": 7,
                "user": "alice",
                "gpus": [0],
                "nics": ["mlx5_0"],
                "memory_max": {"job": "max", "step": 1073741824},
                "processes": [
                    {
                        "key": "rank",
                        "comm": "python3",
                        "gpu": "each",
                        "threads": {"NCCL Service 0": 2},
                    },
                    {"key": "writer", "comm": "python3"},
                ],
            }
        ],
        "timeline": [
            {"kind": "gpu_pcie", "gpu": 0, "h2d_bytes_per_second": 1e9},
            {
                "kind": "nvlink",
                "gpu": 0,
                "tx_bytes_per_second": 1e9,
                "burst": {"period_seconds": 1, "on_seconds": 0.2},
            },
            {"kind": "disk", "disk": "nvme0n1", "read_bytes_per_second": 1e8},
            {"kind": "ib", "device": "mlx5_0", "tx_bytes_per_second": 1e9},
            {"kind": "xid", "from": 5, "gpu": 0, "xid": 48},
            {
                "kind": "lock",
                "from": 2,
                "holder": "writer",
                "waiters": ["rank#0"],
                "mount": "/mnt/ckpt",
                "inode": 9,
            },
            {
                "kind": "process",
                "from": 2,
                "process": "rank",
                "state": "D",
                "wchan": "rpc_wait_bit_killable",
            },
        ],
        "expect": {
            "metrics": [
                {
                    "name": "nodescope_gpu_pcie_rx_bytes_total",
                    "labels": {"gpu": "0"},
                    "aggregate": "rate",
                    "min": 1,
                }
            ]
        },
    }


def write(path: Path, document: Any) -> Path:
    path.write_text(json.dumps(document))
    return path


# --------------------------------------------------------------------------------------------
# Bundled scenarios and the schema


def test_bundled_scenarios_are_listed() -> None:
    assert tuple(bundled_scenarios()) == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_scenario_loads_and_is_named_after_its_file(name: str) -> None:
    scenario = load_scenario(name)
    assert scenario.name == name
    assert scenario.source_path == SCENARIO_DIR / f"{name}.json"
    assert scenario.description
    assert scenario.hardware.gpus and scenario.timeline and scenario.expect.metrics


@pytest.mark.parametrize("name", BUNDLED)
def test_schema_accepts_every_bundled_scenario(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    document = json.loads((SCENARIO_DIR / f"{name}.json").read_text())
    jsonschema.Draft202012Validator(SCHEMA).validate(document)


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d.pop("duration_seconds"), "duration_seconds"),
        (lambda d: d["timeline"].append({"kind": "teleport"}), "kind"),
        (lambda d: d["timeline"][0].update(h2d_bytes_per_second="fast"), "h2d_bytes_per_second"),
        (lambda d: d["jobs"][0]["processes"][0].update(state="Q"), "state"),
        (lambda d: d["hardware"].update(gpu={}), "gpu"),
        (lambda d: d.update(format="nodescope-scenario/2"), "format"),
    ],
)
def test_schema_rejects_a_broken_scenario(mutate: Any, where: str) -> None:
    document = small_document()
    validator = jsonschema.Draft202012Validator(SCHEMA)
    assert not list(validator.iter_errors(document))
    mutate(document)
    errors = list(validator.iter_errors(document))
    assert errors
    assert any(where in json.dumps([list(e.absolute_path), e.message]) for e in errors)


def test_schema_activities_match_the_loader() -> None:
    defs = SCHEMA["$defs"]
    assert set(SCHEMA["$defs"]["activity"]["properties"]["kind"]["enum"]) == set(ACTIVITY_FIELDS)
    for kind, fields in ACTIVITY_FIELDS.items():
        props = set(defs[f"activity_{kind}"]["properties"])
        common = {"kind", "from", "description"} | (set() if kind in INSTANT_KINDS else {"to"})
        assert props == common | set(fields), kind
    assert defs["activity_nfs"]["properties"]["op"]["enum"] == list(NFS4_OPS)


def _schema_objects(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, list):
        return [found for item in node for found in _schema_objects(item)]
    if not isinstance(node, dict):
        return []
    return [node, *(found for value in node.values() for found in _schema_objects(value))]


def test_every_schema_message_belongs_to_a_keyword_beside_it() -> None:
    """``x-message`` words the failure of a keyword of the same schema object."""
    with_messages = [obj for obj in _schema_objects(SCHEMA) if "x-message" in obj]
    assert with_messages
    for obj in with_messages:
        assert set(obj["x-message"]) <= set(obj) - {"x-message"}, obj


def test_importing_the_records_leaves_jsonschema_unimported() -> None:
    """The simulated node and the lspci converter import this module's records; only a
    loader needs jsonschema."""
    code = "import sys, nodescope.sim.scenario; print('jsonschema' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# The loader


def test_small_document_loads(tmp_path: Path) -> None:
    scenario = parse_scenario(small_document(), tmp_path / "small.json")
    assert scenario.hardware.gpus[0].nvlink_count == 4
    assert scenario.hardware.gpus[0].link_peers() == ("0000:06:00.0",) * 4
    assert scenario.hardware.nvme[0].controller == "nvme0"
    assert scenario.jobs[0].memory_max_job is None
    assert scenario.jobs[0].memory_max_step == 1 << 30
    assert scenario.jobs[0].processes[0].gpu == -1
    assert scenario.jobs[0].processes[0].thread_count == 3
    assert [a.kind for a in scenario.timeline][:2] == ["gpu_pcie", "nvlink"]
    assert scenario.timeline[0].get("d2h_bytes_per_second") == 0.0
    assert scenario.expect.metrics[0].name == "nodescope_gpu_pcie_rx_bytes_total"


def test_a_path_loads_and_a_missing_bundled_name_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "mine.json", small_document())
    assert load_scenario(str(path)).name == "small"
    assert load_scenario(path).name == "small"
    with pytest.raises(ParseError, match="no bundled scenario 'no-such'"):
        load_scenario("no-such")


ERRORS: list[tuple[str, Any, str]] = [
    ("format", lambda d: d.update(format="nodescope-scenario/9"), "/format: must be"),
    ("tick", lambda d: d.update(tick_seconds=0), "/tick_seconds: must be > 0"),
    ("duration", lambda d: d.update(duration_seconds=True), "/duration_seconds: must be a number"),
    ("unknown top key", lambda d: d.update(extra=1), "/extra: unknown key"),
    ("gpu ref", lambda d: d["timeline"][0].update(gpu=9), "/timeline/0/gpu: no GPU 9 (GPUs: 0-0)"),
    ("kind", lambda d: d["timeline"][1].update(kind="warp"), "/timeline/1/kind: unknown kind"),
    (
        "to before from",
        lambda d: d["timeline"][0].update({"from": 5, "to": 2}),
        "/timeline/0/to: must be after",
    ),
    (
        "instant with to",
        lambda d: d["timeline"][4].update(to=8),
        "/timeline/4/to: xid happens once",
    ),
    (
        "burst",
        lambda d: d["timeline"][1]["burst"].update(on_seconds=2),
        "/timeline/1/burst/on_seconds: must be <= 1",
    ),
    (
        "disk ref",
        lambda d: d["timeline"][2].update(disk="nvme9n1"),
        "/timeline/2/disk: no disk 'nvme9n1'",
    ),
    (
        "process ref",
        lambda d: d["timeline"][6].update(process="ghost"),
        "/timeline/6/process: no process 'ghost'",
    ),
    (
        "replica",
        lambda d: d["timeline"][5].update(waiters=["rank#3"]),
        "/timeline/5/waiters/0: rank has 1 replicas",
    ),
    ("job gpu", lambda d: d["jobs"][0].update(gpus=[4]), "/jobs/0/gpus/0: no GPU 4"),
    ("job nic", lambda d: d["jobs"][0].update(nics=["mlx5_9"]), "/jobs/0/nics/0: no NIC 'mlx5_9'"),
    (
        "each",
        lambda d: d["jobs"][0]["processes"][0].update(count=2),
        "/jobs/0/processes/0/gpu: 'each' needs",
    ),
    (
        "dup key",
        lambda d: d["jobs"][0]["processes"][1].update(key="rank"),
        "/jobs/0/processes/1/key: process key 'rank' used twice",
    ),
    (
        "thread name",
        lambda d: d["jobs"][0]["processes"][0]["threads"].update({"a/b": 1}),
        "/jobs/0/processes/0/threads/a~1b: thread names",
    ),
    (
        "gpu pci",
        lambda d: d["hardware"]["gpus"]["0"].update(pci="0000:04:00.0"),
        "/hardware/gpus/0/pci: 0000:04:00.0 is not a display controller",
    ),
    (
        "gpu index gap",
        lambda d: d["hardware"]["gpus"].update({"2": {"pci": "0000:03:00.0"}}),
        "/hardware/gpus",
    ),
    (
        "nvlink peer",
        lambda d: d["hardware"]["gpus"]["0"]["nvlinks"][0].update(peer="0000:04:00.0"),
        "/hardware/gpus/0/nvlinks/0/peer: 0000:04:00.0 is neither",
    ),
    (
        "nvme pci",
        lambda d: d["hardware"]["nvme"]["nvme0n1"].update(pci="0000:09:00.0"),
        "/hardware/nvme/nvme0n1/pci: no PCI function 0000:09:00.0",
    ),
    (
        "mount pointer",
        lambda d: d["hardware"]["mounts"]["/mnt/ckpt"].pop("device"),
        "/hardware/mounts/~1mnt~1ckpt/device: must be a string",
    ),
    (
        "bdf",
        lambda d: d["hardware"]["pcie"]["functions"].update({"0000:3:00.0": {}}),
        "/hardware/pcie/functions/0000:3:00.0: '0000:3:00.0' is not a PCI address",
    ),
    (
        "new function",
        lambda d: d["hardware"]["pcie"]["functions"].update({"0000:07:00.0": {"class": "0x0200"}}),
        "/hardware/pcie/functions/0000:07:00.0/vendor: missing",
    ),
    (
        "tree",
        lambda d: d["hardware"]["pcie"]["functions"]["0000:02:01.0"]["bus"].update(secondary=3),
        "/hardware/pcie: the PCIe tree is inconsistent",
    ),
    (
        "sockets",
        lambda d: d["hardware"]["pcie"]["functions"]["0000:03:00.0"].update(numa_node=1),
        "/hardware/cpu/sockets: the PCIe tree has NUMA node 1",
    ),
    (
        "base",
        lambda d: d["hardware"].update(base="no-such-base"),
        "/hardware/base: no bundled scenario or file 'no-such-base'",
    ),
    (
        "nic port",
        lambda d: d["timeline"][3].update(port=2),
        "/timeline/3/port: mlx5_0 has 1 port(s)",
    ),
    (
        "lock mount",
        lambda d: d["hardware"]["mounts"]["/mnt/ckpt"].update(fstype="ext4"),
        "/timeline/5/mount: not an NFS mount",
    ),
    (
        "expect",
        lambda d: d["expect"]["metrics"][0].update(name="9bad"),
        "/expect/metrics/0/name: must be a metric name",
    ),
    (
        "negative",
        lambda d: d["timeline"][0].update(h2d_bytes_per_second=-1),
        "/timeline/0/h2d_bytes_per_second: must be >= 0",
    ),
    (
        "gpu key",
        lambda d: d["hardware"]["gpus"].update({"00": d["hardware"]["gpus"].pop("0")}),
        "/hardware/gpus/00: GPU keys are their NVML indices",
    ),
    (
        "final newline",
        lambda d: d["hardware"]["nvme"].update({"nvme1n1\n": {"pci": "0000:04:00.0"}}),
        "/hardware/nvme/nvme1n1\\n: disk names are nvme<N>n<M>",
    ),
    (
        "null",
        lambda d: d["timeline"][0].update({"from": None}),
        "/timeline/0/from: must be a number, got null",
    ),
]


@pytest.mark.parametrize(("mutate", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_validation_errors_name_the_file_and_the_json_pointer(
    tmp_path: Path, mutate: Any, message: str
) -> None:
    document = small_document()
    mutate(document)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ParseError) as caught:
        load_scenario(path)
    assert caught.value.source == str(path)
    assert caught.value.reason.startswith(message), caught.value.reason
    assert str(caught.value).startswith(f"{path}: /")


def test_the_error_reported_is_the_first_in_the_file(tmp_path: Path) -> None:
    """Of two bad functions, the one written first, whatever order the validator visits them."""
    document = small_document()
    functions = document["hardware"]["pcie"]["functions"]
    functions["0000:06:00.0"]["numa_node"] = -1
    functions["0000:00:01.0"]["numa_node"] = -2
    with pytest.raises(ParseError) as caught:
        parse_scenario(document, tmp_path / "s.json")
    assert caught.value.reason == (
        "/hardware/pcie/functions/0000:00:01.0/numa_node: must be >= 0, got -2"
    )


def test_json_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "format": "nodescope-scenario/1",\n  "name": oops\n}\n')
    with pytest.raises(ParseError) as caught:
        load_scenario(path)
    assert caught.value.line == 3
    path.write_text('{"name": "a", "name": "b"}')
    with pytest.raises(ParseError, match="duplicate key 'name'"):
        load_scenario(path)
    path.write_text('{"duration_seconds": NaN}')
    with pytest.raises(ParseError, match="not JSON"):
        load_scenario(path)


def test_pointer_escaping() -> None:
    assert pointer_join("/hardware/mounts", "/mnt/a~b") == "/hardware/mounts/~1mnt~1a~0b"


def test_merge_patch_is_rfc_7396() -> None:
    target = {"a": {"b": 1, "c": [1, 2]}, "d": 2}
    patch = {"a": {"b": None, "c": [3]}, "e": {"f": 1}}
    assert merge_patch(target, patch) == {"a": {"c": [3]}, "d": 2, "e": {"f": 1}}
    assert target == {"a": {"b": 1, "c": [1, 2]}, "d": 2}


def test_base_hardware_is_merged_per_key() -> None:
    """pcie-saturation-a100 takes dgx-h100's hardware and overrides GPU names, NVLinks and the
    PCIe links of the GPU functions; everything else is the base's."""
    base = load_scenario("dgx-h100").hardware
    a100 = load_scenario("pcie-saturation-a100").hardware
    assert [g.pci for g in a100.gpus] == [g.pci for g in base.gpus]
    assert {g.name for g in a100.gpus} == {"NVIDIA A100-SXM4-80GB"}
    assert {g.nvlink_count for g in a100.gpus} == {12}
    assert {g.nvlink_count for g in base.gpus} == {18}
    gpu1 = {d.bdf: d for d in a100.pcie.devices}["0000:3b:00.0"]
    assert (gpu1.device_id, gpu1.link_cap_speed_gts, gpu1.link_sta_speed_gts) == (
        0x20B2,
        16.0,
        16.0,
    )
    assert a100.nvme == base.nvme and a100.nics == base.nics and a100.mounts == base.mounts
    assert len(a100.pcie.devices) == len(base.pcie.devices)


def test_base_may_be_a_hardware_file_relative_to_the_scenario(tmp_path: Path) -> None:
    document = small_document()
    hardware = {"format": "nodescope-hardware/1", **document["hardware"]}
    (tmp_path / "hw").mkdir()
    write(tmp_path / "hw" / "node.json", hardware)
    document["hardware"] = {"base": "hw/node.json", "os": {"background_processes": 3}}
    scenario = load_scenario(write(tmp_path / "s.json", document))
    assert scenario.hardware.os.background_processes == 3
    assert scenario.hardware.gpus[0].pci == "0000:03:00.0"
    # The schema judges the hardware as base and patch make it: deleting the GPU's address
    # leaves a GPU without one.
    document["hardware"]["gpus"] = {"0": {"pci": None}}
    with pytest.raises(ParseError) as caught:
        load_scenario(write(tmp_path / "s.json", document))
    assert caught.value.reason == "/hardware/gpus/0/pci: must be a string, got nothing"
    # A base that refers back to itself is an error, not a recursion.
    write(tmp_path / "hw" / "node.json", {**hardware, "base": "node.json"})
    with pytest.raises(ParseError, match="refers back to itself"):
        load_scenario(tmp_path / "s.json")


def test_burst_overlap_counts_only_on_time() -> None:
    burst = Burst(period_seconds=0.5, on_seconds=0.1)
    activity = Activity("nvlink", 10.0, 20.0, (("burst", burst),))
    assert activity.overlap(0.0, 10.0) == 0.0
    assert activity.overlap(10.0, 11.0) == pytest.approx(0.2)
    assert activity.overlap(10.05, 10.55) == pytest.approx(0.1)
    assert activity.overlap(19.5, 30.0) == pytest.approx(0.1)
    plain = Activity("gpu_pcie", 1.0, None, ())
    assert plain.overlap(0.0, 3.5) == 2.5
    assert plain.active_at(1.0) and not plain.active_at(0.99)


# --------------------------------------------------------------------------------------------
# Fuzz: malformed documents raise ParseError only

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)  # fmt: skip


SMALL_PATHS = json_paths(small_document())


@settings(max_examples=200, deadline=None)
@given(
    where=st.lists(st.sampled_from(SMALL_PATHS[1:]), min_size=1, max_size=3),
    values=st.lists(json_values, min_size=3, max_size=3),
    delete=st.booleans(),
)
def test_fuzz_mutated_documents_raise_parse_error_only(
    where: list[tuple[Any, ...]], values: list[Any], delete: bool
) -> None:
    document = copy.deepcopy(small_document())
    for path, value in zip(where, values, strict=False):
        parent: Any = document
        try:
            for key in path[:-1]:
                parent = parent[key]
            if delete and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    try:
        parse_scenario(document, Path("/fuzz/scenario.json"))
    except ParseError as exc:
        assert exc.source == "/fuzz/scenario.json"


@settings(max_examples=200, deadline=None)
@given(document=json_values)
def test_fuzz_arbitrary_json_raises_parse_error_only(document: Any) -> None:
    with pytest.raises(ParseError):
        parse_scenario(document, Path("/fuzz/any.json"))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_fuzz_arbitrary_text_raises_parse_error_only(text: str) -> None:
    from nodescope.sim.scenario import parse_json

    try:
        parse_scenario(parse_json(text, "fuzz.json"), Path("fuzz.json"))
    except ParseError:
        pass
    else:  # pragma: no cover - no text of 200 characters is a whole scenario
        raise AssertionError("accepted")


# --------------------------------------------------------------------------------------------
# Bundled data and the converter


def test_bundled_capture_is_the_fixture() -> None:
    assert (DATA_DIR / "lspci-vvv.hgx-h100").read_bytes() == CAPTURE.read_bytes()


def test_bundled_infiniband_capture_regenerates_from_the_fixture() -> None:
    bundled = json.loads((DATA_DIR / "h100-node-infiniband.json").read_text())
    regenerated = convert.infiniband_capture_to_json(IB_CAPTURE, str(IB_CAPTURE))
    assert regenerated["devices"] == bundled["devices"]
    assert set(bundled["devices"]) == {
        "mlx5_0",
        "mlx5_1",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_7",
        "mlx5_8",
        "mlx5_9",
        "mlx5_bond_0",
    }


def test_converter_on_the_real_capture(tmp_path: Path) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert convert.main([str(CAPTURE)]) == 0
    hardware = json.loads(out.getvalue())
    assert hardware["format"] == "nodescope-hardware/1"
    dump = parse_lspci_vvv(CAPTURE.read_text(), str(CAPTURE))
    chains = bridge_chains(dump)
    gpus = hardware["gpus"]
    assert [gpus[str(i)]["pci"] for i in range(len(gpus))] == [
        f"0000:{b}:00.0" for b in ("19", "3b", "4c", "5d", "9b", "bb", "cb", "db")
    ]
    assert {g["name"] for g in gpus.values()} == {"NVIDIA H100 80GB HBM3"}
    assert all(sum(n["count"] for n in g["nvlinks"]) == 18 for g in gpus.values())
    assert hardware["nvswitches"] == [f"0000:{b}:00.0" for b in ("83", "84", "85", "86")]
    assert len(hardware["nvme"]) == 8 and hardware["cpu"]["sockets"] == 2
    # Twelve Mellanox functions: eight ConnectX-7 (compute), two dual-port ConnectX-6 Dx.
    roles = [n["role"] for n in hardware["nics"].values()]
    assert roles.count("compute") == 8 and roles.count("storage") == 4
    # A scenario built on the converted hardware has the capture's tree, function by function.
    write(tmp_path / "hw.json", hardware)
    document = small_document()
    document["hardware"] = {"base": "hw.json"}
    document["jobs"], document["timeline"], document["expect"] = [], [], None
    scenario = load_scenario(write(tmp_path / "s.json", document))
    by_bdf = {d.bdf: d for d in scenario.hardware.pcie.devices}
    assert set(by_bdf) == {d.bdf for d in dump.devices}
    assert bridge_chains(scenario.hardware.pcie) == chains
    for dev in dump.devices:
        got = by_bdf[dev.bdf]
        assert (got.class_code, got.vendor_id, got.device_id, got.numa_node) == (
            dev.class_code, dev.vendor_id, dev.device_id, dev.numa_node,
        )  # fmt: skip
        assert (got.link_cap_speed_gts, got.link_cap_width, got.link_sta_speed_gts) == (
            dev.link_cap_speed_gts, dev.link_cap_width, dev.link_sta_speed_gts,
        )  # fmt: skip
        assert (got.express_type, got.bus, got.has_aer, got.driver) == (
            dev.express_type, dev.bus, dev.has_aer, dev.driver,
        )  # fmt: skip


def test_converter_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("this is not lspci\n")
    assert convert.main([str(bad)]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
