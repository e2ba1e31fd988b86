"""Hand-built snapshots in PyTorch's format (torch.cuda.memory._snapshot), for CPU tests.

Only the fields memfit reads are filled: segments[i] = {device, address, total_size, stream,
segment_type, allocated_size, active_size, requested_size, blocks}; blocks[j] = {address, size,
requested_size, state, frames}; device_traces[d][k] = {action, addr, size, stream, time_us, frames}.
"""

import random

from memfit.allocator.model import CachingAllocatorModel

MIB = 1 << 20
BASE = 0x7F0000000000


def entry(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def segment(address, blocks, device=0, stream=0, segment_type="large"):
    """blocks: (size, state, requested_size or None) in address order; addresses are laid out contiguously."""
    out, offset = [], 0
    for size, state, requested in blocks:
        out.append(
            {
                "address": address + offset,
                "size": size,
                "state": state,
                "requested_size": size if requested is None else requested,
                "frames": [],
            }
        )
        offset += size
    active = sum(b["size"] for b in out if b["state"] != "inactive")
    return {
        "device": device,
        "address": address,
        "total_size": offset,
        "stream": stream,
        "segment_type": segment_type,
        "segment_pool_id": (0, 0),
        "allocated_size": active,
        "active_size": active,
        "requested_size": sum(b["requested_size"] for b in out if b["state"] != "inactive"),
        "blocks": out,
    }


def snapshot(segments, traces=None):
    return {"segments": segments, "device_traces": traces or [[]], "allocator_settings": {}}


def fragmented():
    """Two large segments with holes, one small segment; an awaiting-free block; a short trace."""
    a = segment(
        0x7F0000000000,
        [
            (40 * MIB, "active_allocated", 40 * MIB - 300),
            (12 * MIB, "inactive", 0),
            (20 * MIB, "active_allocated", 20 * MIB),
            (8 * MIB, "inactive", 0),
        ],
    )
    b = segment(
        0x7F0010000000,
        [(6 * MIB, "inactive", 0), (10 * MIB, "active_awaiting_free", 10 * MIB - 512), (4 * MIB, "inactive", 0)],
    )
    c = segment(0x7F0020000000, [(512, "active_allocated", 100), (2 * MIB - 512, "inactive", 0)], segment_type="small")
    trace = [
        {
            "action": "segment_alloc",
            "addr": 0x7F0000000000,
            "size": 80 * MIB,
            "stream": 0,
            "time_us": 1_000,
            "frames": [],
        },
        {"action": "alloc", "addr": 0x7F0000000000, "size": 40 * MIB, "stream": 0, "time_us": 1_010, "frames": []},
        {"action": "alloc", "addr": 0x7F0002800000, "size": 12 * MIB, "stream": 0, "time_us": 1_020, "frames": []},
        {
            "action": "free_requested",
            "addr": 0x7F0002800000,
            "size": 12 * MIB,
            "stream": 0,
            "time_us": 1_030,
            "frames": [],
        },
        {
            "action": "free_completed",
            "addr": 0x7F0002800000,
            "size": 12 * MIB,
            "stream": 0,
            "time_us": 1_031,
            "frames": [],
        },
        {"action": "oom", "size": 64 * MIB, "device_free": 3 * MIB, "stream": 0, "time_us": 1_040, "frames": []},
    ]
    return snapshot([a, b, c], [trace])


def sawtooth(steps=30):
    """A trace of growing temporaries freed between long-lived allocations (classic fragmentation),
    with the final snapshot state consistent with the trace."""
    trace, addr, t = [], 0x7F0000000000, 0
    for i in range(1, steps + 1):
        tmp = {"action": "alloc", "addr": addr, "size": i * 3 * MIB + 512, "stream": 0, "time_us": t, "frames": []}
        keep = {"action": "alloc", "addr": addr + 1, "size": 5 * MIB, "stream": 0, "time_us": t + 1, "frames": []}
        free = {
            "action": "free_completed",
            "addr": addr,
            "size": i * 3 * MIB + 512,
            "stream": 0,
            "time_us": t + 2,
            "frames": [],
        }
        trace += [tmp, keep, free]
        addr += 16
        t += 10
    return snapshot([segment(0x7E0000000000, [(5 * MIB, "active_allocated", None)] * steps)], [trace])


def _runs(pages):
    """Contiguous runs of page numbers: [(first, count)] in order."""
    out = []
    for p in sorted(pages):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def _mapped_pages(seg):
    return {o // seg.page for b in seg.blocks if b.mapped for o in range(b.offset, b.offset + b.size, seg.page)}


def model_workload(settings, seed, events=700):
    """A random workload through the allocator model, written as a snapshot (an expandable segment as
    one snapshot segment per contiguous mapped range), with the model's own (allocated, reserved,
    external free, largest free) after every trace entry."""
    m = CachingAllocatorModel(1 << 40, settings)
    rng = random.Random(seed)
    base = {}  # segment id -> address; segments 16 TiB apart so none touch (an expandable one spans 1 TiB)
    mapped: dict[int, object] = {}  # segment id -> its bytes (cudaMalloc'd) or its mapped pages (expandable)
    page_of: dict[int, int] = {}
    trace, truth, live = [], [], []
    state = {"allocated": 0, "reserved": 0}  # as the trace stands: a malloc's segment events precede its alloc

    def record(entry):
        trace.append(entry)
        if entry["action"].startswith("segment"):
            state["reserved"] += entry["size"] * (1 if entry["action"] in ("segment_alloc", "segment_map") else -1)
            truth.append((state["allocated"], state["reserved"], None, None))
        else:
            state["allocated"] = m.allocated
            assert state["reserved"] == m.reserved
            truth.append((m.allocated, m.reserved, m.reserved - m.allocated, m.largest_free_block()))

    def sync_segments():
        """Segment events for what the last call changed: releases first, as the allocator makes them."""
        for sid in list(mapped):
            seg = m.segments.get(sid)
            if isinstance(mapped[sid], int):
                if seg is None:
                    record(entry("segment_free", base[sid], mapped.pop(sid), len(trace)))
                continue
            now = _mapped_pages(seg) if seg is not None else set()
            for first, n in _runs(mapped[sid] - now):
                record(entry("segment_unmap", base[sid] + first * page_of[sid], n * page_of[sid], len(trace)))
            mapped[sid] &= now
        for sid, seg in m.segments.items():
            base.setdefault(sid, BASE + (len(base) << 44))
            page_of[sid] = seg.page
            if not seg.expandable:
                if sid not in mapped:
                    record(entry("segment_alloc", base[sid], seg.size, len(trace)))
                    mapped[sid] = seg.size
                continue
            now = _mapped_pages(seg)
            for first, n in _runs(now - mapped.get(sid, set())):
                record(entry("segment_map", base[sid] + first * seg.page, n * seg.page, len(trace)))
            mapped[sid] = now

    def addr(block):
        return base[block.segment.sid] + block.offset

    for _ in range(events):
        roll = rng.random()
        if live and roll < 0.45:
            b, req = live.pop(rng.randrange(len(live)))
            record(entry("free_requested", addr(b), req, len(trace)))  # the block stays until free_completed
            a = addr(b)
            m.free(b)
            record(entry("free_completed", a, req, len(trace)))
        elif roll < 0.47:
            m.empty_cache()
            sync_segments()
        else:
            req = rng.choice(
                [rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 40 << 20), rng.randrange(40 << 20, 300 << 20)]
            )
            b = m.malloc(req)
            sync_segments()
            record(entry("alloc", addr(b), req, len(trace)))
            live.append((b, req))
    segments = []
    for sid, seg in m.segments.items():
        runs = [[b for b in seg.blocks]] if not seg.expandable else []
        for b in seg.blocks if seg.expandable else []:
            if not b.mapped:
                continue
            if runs and runs[-1][-1].next is b:
                runs[-1].append(b)
            else:
                runs.append([b])
        for run in runs:
            blocks = [
                {
                    "address": base[sid] + b.offset,
                    "size": b.size,
                    "state": "active_allocated" if b.allocated else "inactive",
                    "requested_size": getattr(b, "requested", b.size) if b.allocated else 0,
                    "frames": [],
                }
                for b in run
            ]
            segments.append(
                {
                    "device": 0,
                    "address": base[sid] + run[0].offset,
                    "total_size": sum(b.size for b in run),
                    "stream": 0,
                    "segment_type": seg.pool,
                    "is_expandable": seg.expandable,
                    "blocks": blocks,
                }
            )
    return {"segments": segments, "device_traces": [trace]}, truth
