"""The backends' typed options: checked when made, handed to the backend they name, and the deprecated
``backend_extra`` moved into them."""

from __future__ import annotations

import pytest

from moriio_async import CmaOptions, InvalidArgument, IOEngine, IOEngineConfig, MockOptions, TcpOptions, VerbsOptions
from moriio_async.backends.described import MockFacts
from moriio_async.backends.mock import MockFabric
from moriio_async.core.faultplan import FaultPlan


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: TcpOptions(max_data_hellos=0), "TcpOptions.max_data_hellos"),
        (lambda: TcpOptions(reactor_threads=65), "TcpOptions.reactor_threads"),
        (lambda: VerbsOptions(ib_port=0), "VerbsOptions.ib_port"),
        (lambda: VerbsOptions(retry_cnt=8), "VerbsOptions.retry_cnt"),
        (lambda: CmaOptions(threads=65), "CmaOptions.threads"),
        (lambda: CmaOptions(ptracer="all"), "CmaOptions.ptracer"),
        (lambda: MockOptions(hold=1), "MockOptions.hold"),
        (lambda: IOEngineConfig(tcp=CmaOptions()), "IOEngineConfig.tcp"),
    ],
)
def test_a_bad_value_is_refused_when_the_options_are_made_naming_the_field(make: object, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
        make()  # type: ignore[operator]


def test_each_backend_is_handed_its_own_options_and_its_transport_position() -> None:
    config = IOEngineConfig(backends=("cma", "tcp"), tcp=TcpOptions(max_data_hellos=3), cma=CmaOptions(threads=2))
    assert config.backend_options("tcp", tag=1).specific == TcpOptions(max_data_hellos=3)
    assert config.backend_options("tcp", tag=1).qp_tag == 1
    assert config.backend_options("cma").specific == CmaOptions(threads=2)


def test_backend_extra_still_works_with_a_deprecation_warning_and_lands_in_the_typed_options() -> None:
    fabric, plan = MockFabric(), FaultPlan()
    with pytest.warns(DeprecationWarning, match="backend_extra"):
        config = IOEngineConfig(
            backend_extra={"hold": True, "fabric": fabric, "threads": 2, "verbs_flush_grace": 0.5, "fault_plan": plan}
        )
    assert config.mock == MockOptions(hold=True, fabric=fabric)
    assert config.cma.threads == 2
    assert (config.verbs.flush_grace, config.verbs.plan, config.tcp.fault_plan) == (0.5, plan, plan)
    with (
        pytest.warns(DeprecationWarning, match="backend_extra"),
        pytest.raises(InvalidArgument, match="no backend has"),
    ):
        IOEngineConfig(backend_extra={"holdd": True})
    with (
        pytest.warns(DeprecationWarning, match="backend_extra"),
        pytest.raises(InvalidArgument, match=r"CmaOptions\.threads"),
    ):
        IOEngineConfig(backend_extra={"threads": 0})


async def test_a_fabric_that_is_not_one_is_refused_when_the_backend_opens() -> None:
    with pytest.raises(InvalidArgument, match=r"MockOptions\.fabric"):
        await IOEngine("x", IOEngineConfig(backend="mock", mock=MockOptions(fabric="f"))).start()


async def test_an_engine_opened_with_mock_options_holds_its_nic() -> None:
    async with IOEngine("held", IOEngineConfig(backend="mock", mock=MockOptions(hold=True))) as engine:
        facts = engine.describe_backend()
        assert isinstance(facts, MockFacts) and facts.hold is True
    async with IOEngine("free", IOEngineConfig(backend="mock")) as engine:
        facts = engine.describe_backend()
        assert isinstance(facts, MockFacts) and facts.hold is False
