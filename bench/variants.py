"""Scenario variants of ``dgx-h100`` for the scale curves, built as scenario documents.

Each variant changes one dimension of the bundled ``dgx-h100`` scenario and keeps the rest:

* GPUs (1, 8, 16, 32): fewer GPUs drop the later ones (and the jobs' and timeline's
  references to them); more add H100s, each behind a Gen5 x16 root port of its own in PCI
  domain 0001, with the same 18 NVLinks to the four NVSwitches and the same traffic;
* processes (100 … 20,000): ``os.background_processes`` (the jobs' processes come on top);
* jobs (1 … 64): the first N of dgx-h100's eight jobs, then copies of its CPU-only
  ``tokenize`` job under new ids;
* NVLinks per GPU (0, 6, 12, 18): the link groups cut down in order.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from nodescope.sim.scenario import SCENARIO_DIR

BASE = "dgx-h100"


def base_document() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SCENARIO_DIR / f"{BASE}.json").read_text())
    doc.pop("$schema", None)
    # Variants are measured, not checked: the base's expectations name GPUs and devices a
    # variant may not have.
    doc["expect"] = {}
    return doc


def _gpu_ref_ok(activity: dict[str, Any], gpus: int) -> bool:
    return not isinstance(activity.get("gpu"), int) or activity["gpu"] < gpus


def with_gpus(n: int) -> dict[str, Any]:
    doc = base_document()
    hw = doc["hardware"]
    gpus: dict[str, Any] = hw["gpus"]
    template = copy.deepcopy(gpus["0"])
    if n <= len(gpus):
        hw["gpus"] = {k: v for k, v in gpus.items() if int(k) < n}
        for job in doc["jobs"]:
            if "gpus" in job:
                job["gpus"] = [g for g in job["gpus"] if g < n]
                for spec in job["processes"]:
                    if spec.get("gpu") == "each" and job["gpus"]:
                        spec["count"] = len(job["gpus"])
                if not job["gpus"]:
                    del job["gpus"]
                    for spec in job["processes"]:
                        spec.pop("gpu", None)
                        spec.pop("gpu_memory_bytes", None)
        doc["timeline"] = [a for a in doc["timeline"] if _gpu_ref_ok(a, n)]
    else:
        functions = hw["pcie"].setdefault("functions", {})
        base_activities = [a for a in doc["timeline"] if a.get("gpu") == 0]
        have = len(gpus)
        for index in range(have, n):
            bus = index - have + 1
            port = f"0001:00:{bus:02x}.0"
            bdf = f"0001:{bus:02x}:00.0"
            numa = 0 if index % 2 == 0 else 1
            functions[port] = {
                "class": "0x060400",
                "vendor": "0x8086",
                "device": "0x352a",
                "express": "Root Port",
                "numa_node": numa,
                "link_cap": {"speed_gts": 32.0, "width": 16},
                "link": {"speed_gts": 32.0, "width": 16},
                "bus": {"primary": 0, "secondary": bus, "subordinate": bus},
                "driver": "pcieport",
            }
            functions[bdf] = {
                "class": "0x030200",
                "vendor": "0x10de",
                "device": "0x2330",
                "express": "Endpoint",
                "numa_node": numa,
                "link_cap": {"speed_gts": 32.0, "width": 16},
                "link": {"speed_gts": 32.0, "width": 16},
                "aer": True,
                "driver": "nvidia",
            }
            gpu = copy.deepcopy(template)
            gpu["pci"] = bdf
            gpu.pop("uuid", None)
            gpus[str(index)] = gpu
            for activity in base_activities:
                extra = copy.deepcopy(activity)
                extra["gpu"] = index
                doc["timeline"].append(extra)
    doc["name"] = f"{BASE}-gpus-{n}"
    return doc


def with_processes(n: int) -> dict[str, Any]:
    doc = base_document()
    doc["hardware"]["os"]["background_processes"] = n
    doc["name"] = f"{BASE}-processes-{n}"
    return doc


def with_jobs(n: int) -> dict[str, Any]:
    doc = base_document()
    jobs: list[dict[str, Any]] = doc["jobs"]
    template = next(j for j in jobs if j["processes"][0]["comm"] == "tokenize")
    kept = jobs[:n]
    kept_ids = {j["id"] for j in kept}
    for i in range(len(kept), n):
        job = copy.deepcopy(template)
        job["id"] = 82000 + i
        job["user"] = f"user{i}"
        job["uid"] = 2000 + i
        for spec in job["processes"]:
            spec["key"] = f"j{job['id']}-{spec['key'].split('-', 1)[1]}"
        kept.append(job)
    doc["jobs"] = kept
    doc["timeline"] = [
        a for a in doc["timeline"] if not isinstance(a.get("job"), int) or a["job"] in kept_ids
    ]
    doc["name"] = f"{BASE}-jobs-{n}"
    return doc


def with_nvlinks(per_gpu: int) -> dict[str, Any]:
    doc = base_document()
    for gpu in doc["hardware"]["gpus"].values():
        left = per_gpu
        groups = []
        for group in gpu.get("nvlinks", []):
            take = min(left, group["count"])
            if take:
                groups.append({**group, "count": take})
            left -= take
        if groups:
            gpu["nvlinks"] = groups
        else:
            gpu.pop("nvlinks", None)
    if per_gpu == 0:
        doc["hardware"].pop("nvswitches", None)
        doc["timeline"] = [a for a in doc["timeline"] if a["kind"] != "nvlink"]
    doc["name"] = f"{BASE}-nvlinks-{per_gpu}"
    return doc


CURVES: dict[str, tuple[tuple[int, ...], Any]] = {
    "gpus": ((1, 8, 16, 32), with_gpus),
    "processes": ((100, 1000, 2000, 5000, 10000, 20000), with_processes),
    "jobs": ((1, 8, 16, 32, 64), with_jobs),
    "nvlinks": ((0, 6, 12, 18), with_nvlinks),
}


def write_variant(doc: dict[str, Any], directory: Path) -> Path:
    path = directory / f"{doc['name']}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path
