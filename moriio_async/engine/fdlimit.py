"""The process's file-descriptor limit, raised (within its hard limit) to what the engine's caps may hold.

Each peer holds a few descriptors on an engine: its control link, one data
connection per session on the tcp backend (two on the dialing side). Linux's
usual soft limit of 1,024 would stop a target near 500 peers with ``EMFILE``
long before ``max_links``; the hard limit (often 524,288 or more) is what a
process may raise its soft limit to without privileges. So at start an engine
raises the soft limit to ``4 * max_links + 1024``, at most the hard limit,
and never lowers it; an administrator's lower hard limit stands (and is
logged once).
"""

from __future__ import annotations

import logging
import resource

__all__ = ["raise_fd_limit"]

log = logging.getLogger("moriio_async.engine")


def raise_fd_limit(max_links: int) -> int:
    """Raise the soft RLIMIT_NOFILE for ``max_links`` links (within the hard limit); the soft limit now."""
    want = 4 * max_links + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft
        log.info("raised the open-file limit from %d to %d (max_links %d)", soft, target, max_links)
    if target < want:
        log.warning("open-file hard limit %d is below the %d that max_links %d may need (ulimit -Hn)",
                    hard, want, max_links)  # fmt: skip
    return target
