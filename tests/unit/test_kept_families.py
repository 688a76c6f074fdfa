"""Families built once per slow read: kept while what they are made of is the same objects,
built again when any of it is a new object."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, hgx_h100
from nodescope.sources import infiniband as ib
from nodescope.sources import nvml as nv
from nodescope_exporters import event_metrics, gpu_metrics, network_metrics
from nodescope_exporters.catalog import Family, Metric
from nodescope_exporters.exposition import TextRenderer
from nodescope_exporters.kept import KeptFamilies, kept_or_built
from nodescope_exporters.prometheus import SnapshotCollector, keeps_families

NO_FILES = Roots.under("/nonexistent-nodescope-root")
IB_CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "captures" / "h100-node-infiniband"


def _family(name: str, *values: float) -> Family:
    family = Family(name, "gauge", "A test family.", ("n",))
    for i, v in enumerate(values):
        family.add_metric([str(i)], v)
    return family


def test_kept_while_every_field_is_the_same_object() -> None:
    built: list[Sequence[tuple[object, ...]]] = []

    def build(parts: Sequence[tuple[str, list[int]]]) -> list[Metric]:
        built.append(parts)
        return [_family("x_total", *(len(p[1]) for p in parts))]

    def other(parts: Sequence[tuple[str, list[int]]]) -> list[Metric]:
        return build(parts)

    kept = KeptFamilies()
    name, states = "eth0", [1, 2]
    first = kept.get(build, [(name, states)])
    assert kept.get(build, [(name, states)]) is first and len(built) == 1
    # Equal but not the same object: built again (identity decides whether, never what).
    again = kept.get(build, [(name, list(states))])
    assert again is not first and len(built) == 2
    assert again[0].values == first[0].values
    # One part more is a different key, even with every field of the others the same.
    more = kept.get(build, [(name, states), (name, states)])
    assert len(built) == 3
    # Each building function keeps its own; without a KeptFamilies every call builds.
    kept.get(other, [(name, states)])
    assert len(built) == 4
    assert kept.get(build, [(name, states), (name, states)]) is more and len(built) == 4
    assert kept_or_built(None, build, [(name, states)]) is not first and len(built) == 5


def test_areas_that_keep_families_say_so() -> None:
    assert keeps_families(gpu_metrics.families) and keeps_families(event_metrics.families)
    assert keeps_families(network_metrics.families)
    assert not keeps_families(lambda snapshot: [])


def _snapshot(cycle: int, data: object, source: str = "nvml") -> Snapshot:
    return Snapshot(
        cycle=cycle,
        monotonic=float(cycle),
        wall_time=0.0,
        current={source: SourceSample(source, float(cycle), 0.0, data)},
    )


def _by_name(families: list[Metric]) -> dict[str, Metric]:
    return {f.name: f for f in families}


def _render_round(
    collector: SnapshotCollector,
    renderer: TextRenderer,
    snapshot: Snapshot,
    area: Callable[[Snapshot], Iterable[Metric]],
) -> dict[str, Metric]:
    """The families ``collector`` hands out for ``snapshot``, by name, once ``renderer`` has
    written them as a fresh renderer writes the area's families built from scratch."""
    collector.set_snapshot(snapshot)
    families = list(collector.collect())
    assert renderer.render(families) == TextRenderer().render(area(snapshot))
    return _by_name(families)


def test_gpu_link_families_are_built_once_per_slow_read() -> None:
    """Between two slow reads of the NVML source its records carry the same link states, and
    the GPU area hands out the same families for them; a slow read that finds a link down
    builds them again and says so, in the same text a fresh render writes."""
    node = FakeNvml(hgx_h100())
    source = nv.NvmlSource(node, watch_xids=False, slow_every=3)
    collector = SnapshotCollector([gpu_metrics.families])
    renderer = TextRenderer()
    rounds: list[dict[str, Metric]] = []
    try:
        for cycle in range(1, 7):  # slow reads on the 1st and the 4th
            if cycle == 4:
                node.gpus[1].links[2].active = False
                node.gpus[1].links[2].errors[0] = 5
            snapshot = _snapshot(cycle, source.collect(NO_FILES))
            rounds.append(_render_round(collector, renderer, snapshot, gpu_metrics.families))
    finally:
        source.close()
    kept = (
        "nodescope_gpu_nvlink_up",
        "nodescope_gpu_nvlink_info",
        "nodescope_gpu_nvlink_errors",
        "nodescope_gpu_nvlink_bonded_links",
    )
    for name in kept:
        assert rounds[0][name] is rounds[1][name] is rounds[2][name], name
        assert rounds[3][name] is not rounds[2][name], name
        assert rounds[3][name] is rounds[4][name] is rounds[5][name], name
    # The payload counters are read every run: never kept.
    data_tx = "nodescope_gpu_nvlink_data_tx_bytes"
    assert rounds[0][data_tx] is not rounds[1][data_tx]
    up = rounds[2]["nodescope_gpu_nvlink_up"]
    assert up.values[up.label_values.index(("1", "2"))] == 1.0
    up = rounds[3]["nodescope_gpu_nvlink_up"]
    assert up.values[up.label_values.index(("1", "2"))] == 0.0
    errors = rounds[3]["nodescope_gpu_nvlink_errors"]
    pairs = zip(errors.label_values, errors.values, strict=True)
    assert 5 in [v for lv, v in pairs if lv[:2] == ("1", "2")]
    bonded = rounds[3]["nodescope_gpu_nvlink_bonded_links"]
    assert bonded.values != rounds[2]["nodescope_gpu_nvlink_bonded_links"].values


def test_gpu_health_families_are_built_once_per_health_read() -> None:
    """The health figures are carried between health reads: their families are kept, and a
    health read that finds a GPU hotter builds them again."""
    node = FakeNvml(hgx_h100())
    source = nv.NvmlSource(node, watch_xids=False, slow_every=1, health_every=3)
    collector = SnapshotCollector([gpu_metrics.families])
    temperature = "nodescope_gpu_temperature_celsius"
    rounds: list[Metric] = []
    healths: list[object] = []
    try:
        for cycle in range(1, 8):
            if cycle == 4:
                node.gpus[3].temperature_gpu = 91
            data = source.collect(NO_FILES)
            healths.append(data.health)
            collector.set_snapshot(_snapshot(cycle, data))
            rounds.append(_by_name(list(collector.collect()))[temperature])
    finally:
        source.close()
    reads = [i for i in range(1, len(healths)) if healths[i] is not healths[i - 1]]
    assert reads, "no second health read in seven runs"
    for i in range(1, len(rounds)):
        assert (rounds[i] is rounds[i - 1]) == (i not in reads), i
    hot = rounds[-1]
    assert hot.values[hot.label_values.index(("3", "gpu"))] == 91


def test_infiniband_families_of_full_reads_are_kept_between_them(tmp_path: Path) -> None:
    """The infiniband source reads its traffic counters every run and the rest on full reads:
    the network area keeps the families of the rest between full reads and builds the
    traffic families every render, in the same text a fresh render writes."""
    shutil.copytree(IB_CAPTURE / "sys", tmp_path / "sys")
    roots = Roots.under(tmp_path)
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    source = ib.InfinibandSource(slow_every=3)
    collector = SnapshotCollector([network_metrics.families])
    renderer = TextRenderer()
    rounds: list[dict[str, Metric]] = []
    try:
        for cycle in range(1, 7):  # full reads on the 1st and the 4th
            for name, add in (("counters/port_xmit_data", 100), ("counters/symbol_error", 1)):
                path = port / name
                path.write_text(f"{int(path.read_text()) + add}\n")
            if cycle == 4:
                (port / "state").write_text("1: DOWN\n")
            snapshot = _snapshot(cycle, source.collect(roots), "infiniband")
            rounds.append(_render_round(collector, renderer, snapshot, network_metrics.families))
    finally:
        source.close()
    for name in (
        "nodescope_infiniband_info",
        "nodescope_infiniband_port_state_id",
        "nodescope_infiniband_port_errors",
        "nodescope_infiniband_port_hw_stats",
    ):
        assert rounds[0][name] is rounds[1][name] is rounds[2][name], name
        assert rounds[3][name] is not rounds[2][name], name
        assert rounds[3][name] is rounds[4][name] is rounds[5][name], name
    tx = "nodescope_infiniband_port_data_transmitted_bytes"
    assert rounds[0][tx] is not rounds[1][tx]
    sent = [r[tx].values[r[tx].label_values.index(("mlx5_0", "1"))] for r in rounds]
    assert [b - a for a, b in itertools.pairwise(sent)] == [400.0] * 5
    state = rounds[3]["nodescope_infiniband_port_state_id"]
    assert state.values[state.label_values.index(("mlx5_0", "1"))] == 1.0
    errors = rounds[3]["nodescope_infiniband_port_errors"]
    symbol = errors.values[errors.label_values.index(("mlx5_0", "1", "symbol_error"))]
    before = rounds[2]["nodescope_infiniband_port_errors"]
    assert symbol == before.values[before.label_values.index(("mlx5_0", "1", "symbol_error"))] + 3
