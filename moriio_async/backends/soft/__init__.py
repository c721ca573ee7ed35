"""The software NICs' shared skeleton: what the tcp and cma backends (and, for its completion queue,
the mock) build on.

``cq`` (the software completion queue), ``pair`` (a batch's shape checks, folding successes into
completions), ``state`` (a pair's locked state: slots, posted spans, flushes, entering ERR, and the
lock rules every software pair follows), ``qp`` (post admission, connect and close skeletons, the NIC
threads' guard), ``backend`` (completion queues, pair numbering with ``BackendOptions.qp_tag``,
close) and ``dial`` (passive pairs waiting by token, the active side's handshake socket). Nothing
here imports a backend built on it (import-linter).
"""
