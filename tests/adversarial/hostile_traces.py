"""Trace files a malicious job drops in its spool directory: flight recorder dumps in
torch's own format (``docs/collectives.md``; the entries are shaped as the fixtures in
tests/fixtures/torch-traces/ that torch wrote), each just under the daemon's per-file size
cap, and a small pickle of one entry referred to a million times through the pickle memo."""

from __future__ import annotations

import json
import pickle


def flight_entry(seq: int, rank: int) -> dict[str, object]:
    return {
        "collective_seq_id": seq,
        "input_dtypes": ["Float"],
        "input_sizes": [[4096]],
        "is_p2p": False,
        "op_id": seq,
        "output_dtypes": ["Float"],
        "output_sizes": [[4096]],
        "p2p_seq_id": 0,
        "pg_id": 0,
        "process_group": ["0", "default_pg"],
        "profiling_name": "nccl:all_reduce",
        "record_id": seq,
        "retired": True,
        "state": "completed",
        "thread_id": "140609696062336",
        "thread_name": "python",
        "time_created_ns": 1_796_343_467_438_332_875 + seq * 1_000_000 + rank * 1000,
        "time_discovered_completed_ns": 0,
        "time_discovered_started_ns": 0,
        "timeout_ms": 60000,
    }


def _head(ranks: int) -> dict[str, object]:
    return {
        "version": "2.10",
        "comm_lib_version": "",
        "pg_config": {
            "0": {"name": "default_pg", "desc": "default_pg", "ranks": str(list(range(ranks)))}
        },
        "pg_status": {},
        "nccl_comm_state": {},
    }


def flight_json_dump(rank: int, size: int, ranks: int = 6) -> bytes:
    """A valid flight recorder JSON dump of ``rank`` of at most ``size`` bytes, as many
    entries as fit."""
    each = len(json.dumps(flight_entry(10**9, rank))) + 2
    count = max(1, (size - 400) // each)
    document = _head(ranks)
    document["entries"] = [flight_entry(seq, rank) for seq in range(1, count + 1)]
    data = json.dumps(document).encode()
    assert len(data) <= size, (len(data), size)
    return data


def flight_pickle_bomb(references: int = 1_000_000) -> bytes:
    """A flight recorder dump as a pickle (``_dump_fr_trace()``'s format) whose entries are
    one dict referred to ``references`` times: two bytes per reference in the file, one call
    record per reference for a parser that walks the entries."""
    document = _head(2)
    document["entries"] = [flight_entry(1, 0)] * references
    return pickle.dumps(document, protocol=4)
