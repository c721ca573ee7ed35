"""Bounds: the target touches only live regions, within range, with the access asked for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moriio_async import Access, MemoryDesc, TransferError, WcStatus, waiting_for_transfer_complete

from .conftest import backends, slow_examples
from .model import engine_pair

ARENA = 1 << 16
"""The target's buffer: regions are registered inside it; every other byte is a canary."""
ACCESSES = [
    Access.all(),
    Access.LOCAL_WRITE | Access.REMOTE_WRITE,
    Access.LOCAL_WRITE | Access.REMOTE_READ,
    Access.REMOTE_READ,
    Access.LOCAL_WRITE,
]


@dataclass(frozen=True, slots=True)
class RegionSpec:
    start: int
    length: int
    access: Access
    live: bool


@dataclass(frozen=True, slots=True)
class Request:
    write: bool
    region: int
    """Index of the region whose address and key the request starts from."""
    from_end: bool
    delta: int
    """Offset from that region's start (or end); may fall before it or past its end."""
    size: int
    key: str
    """"own": the region's rkey; "other": another region's; "random": a number no region has."""


regions = st.lists(
    st.builds(
        RegionSpec,
        st.integers(0, ARENA - 1),
        st.integers(1, 4096),
        st.sampled_from(ACCESSES),
        st.sampled_from([True, True, True, False]),
    ),
    min_size=1,
    max_size=4,
).map(lambda rs: [RegionSpec(r.start, min(r.length, ARENA - r.start), r.access, r.live) for r in rs])
requests = st.lists(
    st.builds(
        Request,
        st.booleans(),
        st.integers(0, 3),
        st.booleans(),
        st.integers(-600, 600),
        st.integers(1, 512),
        st.sampled_from(["own", "own", "own", "own", "other", "random"]),
    ),
    min_size=1,
    max_size=5,
)


EDGE = RegionSpec(1024, 2048, Access.all(), True)
"""A region with canary bytes on both sides, for the explicit edge examples."""


def edges(write: bool) -> list[Request]:
    """Requests at a region's edges: ending exactly at its end, one byte past it, starting at its end,
    starting at its start, one byte before it, and the whole region."""
    return [
        Request(write, 0, True, -64, 64, "own"),  # end == length: allowed
        Request(write, 0, True, -63, 64, "own"),  # end == length + 1
        Request(write, 0, True, 0, 1, "own"),  # offset == length
        Request(write, 0, False, 0, 64, "own"),  # offset == 0: allowed
        Request(write, 0, False, -1, 64, "own"),  # offset == -1
        Request(write, 0, False, 0, EDGE.length, "own"),  # the whole region: allowed
        Request(write, 0, False, 1, EDGE.length, "own"),  # the whole region, shifted one byte past its end
    ]


@settings(max_examples=slow_examples(30))
@example(specs=[EDGE], reqs=edges(write=True))
@example(specs=[EDGE], reqs=edges(write=False))
# Two registrations of the same byte without remote access have equal descriptors on rxe (rkey 0):
# deregistering one must leave the other registered (the guest found this).
@example(
    specs=[RegionSpec(0, 1, Access.LOCAL_WRITE, False), RegionSpec(0, 1, Access.LOCAL_WRITE, False)],
    reqs=[Request(False, 0, False, 0, 1, "own")],
)
@given(regions, requests)
@backends()
async def test_the_target_touches_only_live_regions_in_range_with_matching_access(
    backend: str, specs: list[RegionSpec], reqs: list[Request]
) -> None:
    """For random (offset, size, rkey) requests against random registered regions, the target never
    reads or writes a byte outside a live region with matching access, and rejects every request that
    would (REM_ACCESS_ERR at the initiator); the requests it accepts move exactly their bytes."""
    async with engine_pair(backend, abort_timeout=1.0) as p:
        arena = np.random.default_rng(3).integers(0, 256, ARENA, dtype=np.uint8)
        descs: list[MemoryDesc] = []
        for spec in specs:
            desc = p.b.register_memory(arena[spec.start : spec.start + spec.length], access=spec.access, export=True)
            descs.append(desc)
        for spec, desc in zip(specs, descs, strict=True):
            if not spec.live:
                p.b.deregister_memory(desc)
        live = [d for s, d in zip(specs, descs, strict=True) if s.live]
        rkeys = {d.rkey for d in descs}
        for n, req in enumerate(reqs):
            base = descs[req.region % len(descs)]
            if req.key == "own":
                rkey = base.rkey
            elif req.key == "other":
                rkey = descs[(req.region + 1) % len(descs)].rkey
            else:
                rkey = next(k for k in range(7, 1 << 32, 7919) if k not in rkeys)
            addr = base.addr + (base.length if req.from_end else 0) + req.delta
            allowed = any(
                d.rkey == rkey
                and d.addr <= addr
                and addr + req.size <= d.addr + d.length
                and d.access & (Access.REMOTE_WRITE if req.write else Access.REMOTE_READ)
                for d in live
            )
            forged = MemoryDesc("b", p.b.incarnation, "forged", addr, req.size, rkey, Access.all())
            session = await p.a.create_session(p.desc_a, forged)
            before = arena.copy()
            p.buf_a[: req.size] = (n * 37 + 11) % 256
            p.buf_a[req.size : 2 * req.size] = 0
            t = session.write(0, 0, req.size) if req.write else session.read(req.size, 0, req.size)
            try:
                await waiting_for_transfer_complete([t], timeout=30)
            except TransferError as exc:
                (failure,) = exc.failed
                assert not allowed, f"an allowed request was rejected: {failure}"
                assert failure.wc_status is WcStatus.REM_ACCESS_ERR
                assert np.array_equal(arena, before), "a rejected request changed the target's memory"
            else:
                assert allowed, f"the target accepted {req} outside every live region with that access"
                lo = addr - arena.ctypes.data
                changed = np.flatnonzero(arena != before)
                if req.write:
                    assert (arena[lo : lo + req.size] == (n * 37 + 11) % 256).all()
                    assert changed.size == 0 or (changed.min() >= lo and changed.max() < lo + req.size)
                else:
                    assert changed.size == 0, "a read changed the target's memory"
                    assert np.array_equal(p.buf_a[req.size : 2 * req.size], arena[lo : lo + req.size])
            await session.close()
