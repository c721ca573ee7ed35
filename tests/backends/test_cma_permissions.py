"""The cma backend's permissions: PtracerPolicy per policy and Yama scope, explain's refusal lines, CAP_SYS_PTRACE.

Yama and prctl are faked here (this machine may have no Yama, and PR_SET_PTRACER changes the test
process): ``yama_scope`` and ``set_ptracer`` are replaced where permissions.py looks them up, and
each call to ``set_ptracer`` is recorded.
"""

from __future__ import annotations

import errno
import logging
import os

import pytest

from moriio_async.backends.cma import permissions
from moriio_async.backends.cma.kernel import PR_SET_PTRACER_ANY
from moriio_async.backends.cma.permissions import PtracerPolicy, explain, has_cap_sys_ptrace

LOGGER = "moriio_async.cma"


class Prctl:
    """A fake ``set_ptracer``: records each pid it is given and answers with the next queued errno (0 after)."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.errors: list[int] = []

    def __call__(self, pid: int) -> int:
        self.calls.append(pid)
        return self.errors.pop(0) if self.errors else 0


@pytest.fixture
def prctl(monkeypatch: pytest.MonkeyPatch) -> Prctl:
    fake = Prctl()
    monkeypatch.setattr(permissions, "set_ptracer", fake)
    monkeypatch.setattr(permissions, "yama_scope", lambda: 1)
    return fake


def ptracer_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_peer_names_the_first_initiator_by_its_pid(prctl: Prctl, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    PtracerPolicy("peer").allow(4242)
    assert prctl.calls == [4242]
    assert ptracer_records(caplog, logging.INFO) == []
    assert ptracer_records(caplog, logging.WARNING) == []


def test_peer_does_nothing_for_the_same_initiator_again(prctl: Prctl) -> None:
    policy = PtracerPolicy("peer")
    policy.allow(4242)
    policy.allow(4242)
    assert prctl.calls == [4242]


def test_peer_switches_to_any_once_for_a_second_initiator_and_says_so_once(
    prctl: Prctl, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    policy = PtracerPolicy("peer")
    policy.allow(100)
    policy.allow(200)
    assert prctl.calls == [100, PR_SET_PTRACER_ANY]
    (info,) = ptracer_records(caplog, logging.INFO)
    assert info.getMessage() == (
        "cma: a second initiator (pid 200) needs PR_SET_PTRACER_ANY: Yama keeps one ptracer per "
        "process; any same-uid process may now attach to this one (CmaOptions(ptracer='off') to forbid)"
    )
    policy.allow(300)
    policy.allow(100)
    policy.allow(200)
    assert prctl.calls == [100, PR_SET_PTRACER_ANY]
    assert len(ptracer_records(caplog, logging.INFO)) == 1
    assert ptracer_records(caplog, logging.WARNING) == []


def test_any_goes_to_any_at_once_without_the_second_initiator_line(
    prctl: Prctl, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    policy = PtracerPolicy("any")
    policy.allow(100)
    policy.allow(200)
    policy.allow(100)
    assert prctl.calls == [PR_SET_PTRACER_ANY]
    assert ptracer_records(caplog, logging.INFO) == []
    assert ptracer_records(caplog, logging.WARNING) == []


def test_off_never_calls_prctl(prctl: Prctl) -> None:
    policy = PtracerPolicy("off")
    policy.allow(100)
    policy.allow(200)
    assert prctl.calls == []


@pytest.mark.parametrize("scope", [None, 0, 2, 3])
@pytest.mark.parametrize("name", ["peer", "any"])
def test_scopes_other_than_1_never_call_prctl(
    prctl: Prctl, monkeypatch: pytest.MonkeyPatch, scope: int | None, name: str
) -> None:
    monkeypatch.setattr(permissions, "yama_scope", lambda: scope)
    policy = PtracerPolicy(name)
    policy.allow(100)
    policy.allow(200)
    assert prctl.calls == []


def test_a_failing_prctl_for_the_first_initiator_is_a_warning_and_the_next_allow_tries_again(
    prctl: Prctl, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    prctl.errors = [errno.EPERM]
    policy = PtracerPolicy("peer")
    policy.allow(100)
    (warning,) = ptracer_records(caplog, logging.WARNING)
    assert warning.getMessage() == f"cma: prctl(PR_SET_PTRACER) failed: {os.strerror(errno.EPERM)}"
    # Nothing was recorded: the same pid is tried again, and named as the first initiator.
    policy.allow(100)
    policy.allow(100)
    assert prctl.calls == [100, 100]
    assert ptracer_records(caplog, logging.INFO) == []
    assert len(ptracer_records(caplog, logging.WARNING)) == 1


def test_a_failing_switch_to_any_is_a_warning_and_the_next_initiator_tries_again(
    prctl: Prctl, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    policy = PtracerPolicy("peer")
    policy.allow(100)
    prctl.errors = [errno.EINVAL]
    policy.allow(200)
    (warning,) = ptracer_records(caplog, logging.WARNING)
    assert warning.getMessage() == f"cma: prctl(PR_SET_PTRACER) failed: {os.strerror(errno.EINVAL)}"
    assert ptracer_records(caplog, logging.INFO) == []
    # The first initiator is still the named one; a later initiator asks for ANY again.
    policy.allow(100)
    policy.allow(300)
    policy.allow(400)
    assert prctl.calls == [100, PR_SET_PTRACER_ANY, PR_SET_PTRACER_ANY]
    assert len(ptracer_records(caplog, logging.INFO)) == 1


def test_a_failing_any_policy_tries_again_on_the_next_allow(prctl: Prctl, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    prctl.errors = [errno.EPERM]
    policy = PtracerPolicy("any")
    policy.allow(100)
    policy.allow(100)
    policy.allow(200)
    assert prctl.calls == [PR_SET_PTRACER_ANY, PR_SET_PTRACER_ANY]
    assert len(ptracer_records(caplog, logging.WARNING)) == 1
    assert ptracer_records(caplog, logging.INFO) == []


def test_an_unknown_policy_is_a_value_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="everyone") as info:
        PtracerPolicy("everyone")
    assert str(info.value) == "ptracer must be one of ('peer', 'any', 'off'), not 'everyone'"


@pytest.mark.parametrize("name", ["peer", "any", "off"])
def test_each_known_policy_is_kept(name: str) -> None:
    assert PtracerPolicy(name).policy == name


@pytest.mark.parametrize(
    ("scope", "yama", "hint"),
    [
        (None, "no Yama", "both processes must run as the same user"),
        (0, "Yama ptrace_scope=0", "both processes must run as the same user"),
        (1, "Yama ptrace_scope=1", "the target sets PR_SET_PTRACER for its peers"),
        (2, "Yama ptrace_scope=2", "ptrace_scope=2 needs CAP_SYS_PTRACE"),
        (3, "Yama ptrace_scope=3", "ptrace_scope=3 forbids it until reboot"),
    ],
)
def test_explain_names_errno_pid_uid_and_scope_with_the_hint_for_the_scope(
    monkeypatch: pytest.MonkeyPatch, scope: int | None, yama: str, hint: str
) -> None:
    monkeypatch.setattr(permissions, "yama_scope", lambda: scope)
    what, why = explain(errno.EPERM, 4242)
    assert what == f"cross-memory attach to pid 4242 refused (EPERM; uid {os.getuid()}, {yama})"
    assert why.startswith(hint)
    assert "backend='tcp'" in why


def test_explain_hints_are_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {
        3: "ptrace_scope=3 forbids it until reboot: use shared-memory buffers (allocate_memory) or backend='tcp'",
        2: "ptrace_scope=2 needs CAP_SYS_PTRACE (containers: --cap-add SYS_PTRACE), or use backend='tcp'",
        1: "the target sets PR_SET_PTRACER for its peers unless CmaOptions(ptracer='off'); "
        "or set kernel.yama.ptrace_scope=0, or grant CAP_SYS_PTRACE, or use backend='tcp'",
        0: "both processes must run as the same user and be dumpable (no setuid, PR_SET_DUMPABLE); or backend='tcp'",
    }
    for scope, hint in expected.items():
        monkeypatch.setattr(permissions, "yama_scope", lambda scope=scope: scope)
        assert explain(errno.ESRCH, 1)[1] == hint


def test_explain_gives_an_unnamed_errno_as_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(permissions, "yama_scope", lambda: None)
    what, _ = explain(99999, 7)
    assert "(99999; uid" in what


class FakeStatus:
    """Stands in for ``Path`` in permissions.py: /proc/self/status reads as ``text`` (or raises ``error``)."""

    def __init__(self, text: str = "", error: OSError | None = None) -> None:
        self.text = text
        self.error = error
        self.paths: list[str] = []

    def __call__(self, path: str) -> FakeStatus:
        self.paths.append(path)
        return self

    def read_text(self) -> str:
        if self.error is not None:
            raise self.error
        return self.text


STATUS = "Name:\tpython3\nCapInh:\t0000000000000000\nCapPrm:\t{prm}\nCapEff:\t{eff}\nCapBnd:\t000001ffffffffff\n"


@pytest.mark.parametrize(
    ("eff", "expected"),
    [
        ("0000000000080000", True),  # bit 19 alone
        ("00000000000fffff", True),  # bits 0-19: read as base 17 or 10 it is not
        ("000001ffffffffff", True),
        ("0000000000000000", False),
        ("000001fffff7ffff", False),  # every bit but 19
        ("0000000000040000", False),  # bit 18
        ("0000000000100000", False),  # bit 20
    ],
)
def test_has_cap_sys_ptrace_reads_bit_19_of_capeff(monkeypatch: pytest.MonkeyPatch, eff: str, expected: bool) -> None:
    # CapPrm has every bit set: only CapEff counts.
    fake = FakeStatus(STATUS.format(prm="000001ffffffffff", eff=eff))
    monkeypatch.setattr(permissions, "Path", fake)
    assert has_cap_sys_ptrace() is expected
    assert fake.paths == ["/proc/self/status"]


def test_has_cap_sys_ptrace_is_false_when_capeff_is_not_first_in_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # A line that only contains "CapEff:" further in is not the CapEff line.
    text = "Name:\tCapEff: 80000\nCapEff:\t0000000000000000\n"
    monkeypatch.setattr(permissions, "Path", FakeStatus(text))
    assert has_cap_sys_ptrace() is False


@pytest.mark.parametrize(
    "fake",
    [
        FakeStatus(error=PermissionError(errno.EACCES, "denied")),
        FakeStatus(error=FileNotFoundError(errno.ENOENT, "no /proc")),
        FakeStatus("Name:\tx\nCapEff:\tzzzz\n"),
        FakeStatus("Name:\tx\nCapEff:\n"),
        FakeStatus("Name:\tx\n"),
        FakeStatus(""),
    ],
    ids=["unreadable", "missing", "not-hex", "empty-field", "no-capeff", "empty"],
)
def test_has_cap_sys_ptrace_is_false_on_an_unreadable_or_garbled_status(
    monkeypatch: pytest.MonkeyPatch, fake: FakeStatus
) -> None:
    monkeypatch.setattr(permissions, "Path", fake)
    assert has_cap_sys_ptrace() is False


def test_has_cap_sys_ptrace_agrees_with_this_process() -> None:
    with open("/proc/self/status") as f:
        eff = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    assert has_cap_sys_ptrace() is bool(int(eff, 16) & (1 << 19))
