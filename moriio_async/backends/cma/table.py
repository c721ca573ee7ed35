"""The target's region table, shared with its initiators read-only through a sealed memfd.

Every region a cma backend registers gets a slot here; its rkey is the slot
number in the low 16 bits and a fresh random tag in the high 16 bits, so a
key never comes back after its region is gone. An initiator maps the table
read-only when its queue pair connects and checks every remote request
against it (rkey, range, access) before any byte moves: a revocation is one
store by the target, visible to every initiator's next check at once, with
no message in between.

Ordering: the owner writes a slot as rkey := 0, fields, flags, rkey := key;
a reader reads rkey, the fields, then rkey again, and trusts the fields only
when both reads give its key. On x86-64 (stores are not reordered with
stores, loads not with loads) that is a seqlock. A slot is reused only after
every initiator connected at revocation time acknowledged it (``target.py``),
so a reader never sees a slot rewritten under a key it still believes in.

The file is sealed against shrinking and growing, so mapping it can never
fault (SIGBUS) whatever the owner does later, and against writes
(``F_SEAL_FUTURE_WRITE``, added once the owner has mapped it writable): the
owner's mapping is the only writable one there will ever be. A peer holding
the memfd (handed to it, or opened by path as ``/proc/<pid>/fd/N``, which a
same-user process may) cannot map it writable, ``mprotect`` a read-only
mapping writable, ``write`` or punch a hole in it: the kernel refuses
(EPERM/EACCES), so a revoked slot stays revoked whatever a peer does through
the file. The reader checks the seals.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import threading
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from ...errors import InvalidArgument
from .wire import VendorErr

__all__ = [
    "CLOSED",
    "FUTURE_WRITE",
    "LIVE",
    "READ",
    "RECORD",
    "SLOTS",
    "WRITE",
    "Checked",
    "Record",
    "RegionTable",
    "TableView",
    "first_outside",
    "seal_fd",
    "seal_writes",
]

RECORD: Final = np.dtype(
    [("rkey", "<u4"), ("flags", "<u4"), ("alloc", "<u4"), ("reserved", "<u4"),
     ("addr", "<u8"), ("length", "<u8"), ("alloc_off", "<u8")]
)  # fmt: skip
_NO_RECORDS: Final = np.empty(0, dtype=RECORD)
Record = tuple[int, int, int, int, int, int, int]
"""One record's fields, as ``RECORD`` orders them."""
SLOTS: Final = 1 << 16
READ: Final = 1
WRITE: Final = 2
LIVE: Final = 4
"""Set for every registered region (with or without remote access); a revocation clears every bit."""
CLOSED: Final = 8
"""In slot 0's flags (no region uses slot 0) once the owner closed its backend: every check fails."""
_MASK: Final = SLOTS - 1
FUTURE_WRITE: Final[int] = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1; Python names it from 3.14
"""No writable mapping, ``write`` or hole punch from now on, through any descriptor; mappings that
exist stay as they are (the owner's own keeps writing)."""
_SIZE_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS: Final = _SIZE_SEALS | FUTURE_WRITE

U32 = npt.NDArray[np.uint32]
U64 = npt.NDArray[np.uint64]


def seal_fd(fd: int) -> None:
    """Seal a memfd against shrinking and growing (a peer's mapping of it can never fault)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)


def seal_writes(fd: int) -> None:
    """Seal a memfd against every later write (``FUTURE_WRITE``), after the owner mapped it writable,
    and against any further seal (nothing else is needed of it).

    Raises OSError where the kernel has no such seal (before 5.1): then nothing here may be shared
    read-only, since a descriptor's read-only mode alone is undone by reopening ``/proc/self/fd/N``."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FUTURE_WRITE | fcntl.F_SEAL_SEAL)


class RegionTable:
    """The owner's side: slots, keys, and the memfd peers map."""

    def __init__(self) -> None:
        self.nbytes = SLOTS * RECORD.itemsize
        self.fd = os.memfd_create("moriio-cma-table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            seal_fd(self.fd)
            self._map = mmap.mmap(self.fd, self.nbytes)
            seal_writes(self.fd)  # the mapping above stays the only writable one: peers only read the table
        except BaseException:
            if hasattr(self, "_map"):
                self._map.close()
            os.close(self.fd)
            raise
        self.records = np.frombuffer(self._map, dtype=RECORD)
        self._lock = threading.Lock()
        self._free = list(range(SLOTS - 1, 0, -1))  # slot 0 stays empty: no rkey is ever 0
        self._tags = np.zeros(SLOTS, dtype=np.uint16)

    def publish(self, addr: int, length: int, flags: int, alloc: int = 0, alloc_off: int = 0) -> int:
        """Give a region a slot and a fresh key; its rkey."""
        with self._lock:
            if not self._free:
                raise InvalidArgument(f"the cma backend holds at most {SLOTS - 1} regions at once")
            slot = self._free.pop()
            tag = int(self._tags[slot])
            while tag == int(self._tags[slot]):
                tag = secrets.randbelow(0xFFFF) + 1
            self._tags[slot] = tag
        rkey = slot | (tag << 16)
        rec = self.records
        rec["rkey"][slot] = 0
        rec["addr"][slot] = addr
        rec["length"][slot] = length
        rec["alloc"][slot] = alloc
        rec["alloc_off"][slot] = alloc_off
        rec["flags"][slot] = flags
        rec["rkey"][slot] = rkey
        return rkey

    def grant(self, rkey: int, flags: int) -> None:
        """Set a live region's access bits (its export); a revoked or unknown key stays as it is."""
        slot = rkey & _MASK
        with self._lock:
            if int(self.records["rkey"][slot]) == rkey and int(self.records["flags"][slot]):
                self.records["flags"][slot] = flags

    def flags(self, rkey: int) -> int:
        """The table's bits for ``rkey`` now (0: not live under that key)."""
        slot = rkey & _MASK
        with self._lock:
            return int(self.records["flags"][slot]) if int(self.records["rkey"][slot]) == rkey else 0

    def revoke(self, rkey: int) -> bool:
        """Make ``rkey`` fail every later check (one store). False when it is not live."""
        slot = rkey & _MASK
        with self._lock:  # against a racing ``grant`` re-opening what was just revoked
            if int(self.records["rkey"][slot]) != rkey:
                return False
            self.records["flags"][slot] = 0
        return True

    def shut(self) -> None:
        """The backend is closing: every initiator's next check fails as from a vanished peer (one
        store). After it, ``TargetPort.quiesce`` waits for the windows that passed a check before."""
        self.records["flags"][0] = CLOSED

    def release(self, rkey: int) -> None:
        """The slot of a revoked key may be reused (every peer acknowledged the revocation)."""
        slot = rkey & _MASK
        with self._lock:
            if int(self.records["rkey"][slot]) == rkey:
                self.records["rkey"][slot] = 0
                self._free.append(slot)

    def close(self) -> None:
        del self.records
        self._map.close()
        os.close(self.fd)


_HUGE: Final = 1 << 63


def first_outside(addrs: U64, lengths: U64, base: int, size: int) -> int:
    """The first range ``addrs[i], lengths[i]`` not inside ``[base, base + size)``; their count when all are.

    Four reductions when every range is inside (the usual case, checked on the extremes: ends are summed
    only below 2**63, where uint64 cannot wrap), one pass per element only to find a failure."""
    n = len(addrs)
    lo, hi, longest = int(addrs.min()), int(addrs.max()), int(lengths.max())
    if lo >= base and hi < _HUGE and longest < _HUGE and int((addrs + lengths).max()) <= base + size:
        return n
    start, span = np.uint64(base), np.uint64(size)
    rel = addrs - start  # wraps below the region: those fail addrs >= start
    inside = (addrs >= start) & (rel <= span) & (lengths <= span - rel)
    return n if bool(inside.all()) else int(np.argmin(inside))


class Checked:
    """Remote ranges checked at once: the first that failed (their count when none did) and why,
    and for each the table record it used; or, when every range named one key, ``one``: that
    record's fields (``records`` is then empty)."""

    __slots__ = ("first_bad", "one", "records", "vendor")

    def __init__(
        self,
        first_bad: int,
        vendor: VendorErr,
        records: npt.NDArray[np.void],
        one: Record | None = None,
    ) -> None:
        self.first_bad = first_bad
        self.vendor = vendor
        self.records = records
        self.one = one
        """(rkey, flags, alloc, reserved, addr, length, alloc_off) of the one slot every range named."""


class TableView:
    """An initiator's read-only mapping of a target's table."""

    def __init__(self, fd: int) -> None:
        nbytes = SLOTS * RECORD.itemsize
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if st.st_size != nbytes or seals & _SEALS != _SEALS:
            raise ValueError(f"not a sealed region table ({st.st_size} bytes, seals {seals:#x})")
        self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        self.records = np.frombuffer(self._map, dtype=RECORD)
        self._rkeys = self.records["rkey"]
        self._flags = self.records["flags"]

    def check(self, rkeys: U32, addrs: U64, lengths: U64, write: bool, one_key: bool = False) -> Checked:
        """Every range against the table: a live slot under the key, inside it, with the access.
        ``one_key``: the caller knows every range names ``rkeys[0]`` (one record read, not one per range)."""
        n = len(rkeys)
        if self._flags.item(0) & CLOSED:  # the target closed its backend (``RegionTable.shut``)
            return Checked(0, VendorErr.PEER_CLOSED, np.empty(0, dtype=RECORD))
        if one_key or n == 1:
            return self._check_one_key(rkeys.item(0), addrs, lengths, write)
        slots = (rkeys & np.uint32(_MASK)).astype(np.intp)
        first = self.records[slots]  # a copy: the check works on one snapshot
        need = WRITE if write else READ
        keyed = first["rkey"] == rkeys
        allowed = (first["flags"] & np.uint32(need)) != 0
        base, size = first["addr"], first["length"]
        offset = addrs - base  # wraps below the region: those fail addrs >= base
        inside = (addrs >= base) & (offset <= size) & (lengths <= size - offset)
        again = self.records["rkey"][slots] == rkeys  # the seqlock's second read
        ok = keyed & again & allowed & inside
        bad = int(np.argmin(ok)) if not bool(ok.all()) else n
        vendor = VendorErr.NONE
        if bad < n:
            if not (keyed[bad] and again[bad]):
                vendor = VendorErr.UNKNOWN_RKEY
            elif not first["flags"][bad] & LIVE:
                vendor = VendorErr.REMOTE_REVOKED
            elif not allowed[bad]:
                vendor = VendorErr.REMOTE_NO_ACCESS
            else:
                vendor = VendorErr.REMOTE_OUT_OF_BOUNDS
        return Checked(bad, vendor, first)

    def _check_one_key(self, rkey: int, addrs: U64, lengths: U64, write: bool) -> Checked:
        slot = rkey & _MASK
        rec = cast(Record, self.records.item(slot))  # a copy: the check works on one snapshot
        again = self._rkeys.item(slot)  # the seqlock's second read
        flags = rec[1]
        bad, vendor = 0, VendorErr.NONE
        if rec[0] != rkey or again != rkey:
            vendor = VendorErr.UNKNOWN_RKEY
        elif not flags & LIVE:
            vendor = VendorErr.REMOTE_REVOKED
        elif not flags & (WRITE if write else READ):
            vendor = VendorErr.REMOTE_NO_ACCESS
        else:
            bad = first_outside(addrs, lengths, rec[4], rec[5])
            if bad < len(addrs):
                vendor = VendorErr.REMOTE_OUT_OF_BOUNDS
        return Checked(bad, vendor, _NO_RECORDS, rec)

    def close(self) -> None:
        del self.records, self._rkeys, self._flags
        self._map.close()
