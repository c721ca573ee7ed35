"""``python -m moriio_async.serving {prefill,decode,proxy,demo}``: one serving process, or the whole demo.

python -m moriio_async.serving demo                      # 1P1D, both modes, checked against the reference
python -m moriio_async.serving demo --prefill 2 --decode 2 --mode read
python -m moriio_async.serving demo --serve --port 8000  # leave the proxy up for real clients
python -m moriio_async.serving prefill --port 8100 --name prefill-0
python -m moriio_async.serving decode --port 8200 --name decode-0
python -m moriio_async.serving proxy --port 8000 --prefill http://10.0.0.2:8100 --decode http://10.0.0.3:8200
"""

from __future__ import annotations

import os

# One BLAS thread per process: a fleet shares the machine's cores, and every process
# (and the reference) then runs the same kernels.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from .config import InstanceSettings, add_model_args, add_timeout_args, model_config  # noqa: E402

__all__ = ["main"]


def _instance_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], role: str) -> None:
    p = sub.add_parser(role, help=f"run one {role} instance")
    p.add_argument("--name", default=f"{role}-0", help="engine key, unique in the fleet")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: any free one; printed on stdout)")
    p.add_argument("--engine-port", type=int, default=0)
    p.add_argument(
        "--backend",
        default="auto",
        help="auto (cma when instances share the host, else verbs, else tcp), tcp, verbs or cma",
    )
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks in the pool (0: 4 max-length sequences)")
    p.add_argument("--parent-watch", action="store_true", help="exit when stdin closes (set by the launcher)")
    add_model_args(p)
    add_timeout_args(p)


def _run_instance(args: argparse.Namespace) -> int:
    model = model_config(args)
    settings = InstanceSettings(
        name=args.name,
        role=args.command,
        model=model,
        num_blocks=args.num_blocks or 4 * model.blocks_for(model.max_model_len),
        backend=args.backend,
        host=args.host,
        engine_port=args.engine_port,
        transfer_timeout=args.transfer_timeout,
        control_timeout=args.control_timeout,
        admission_timeout=args.admission_timeout,
    )
    from .web import serve

    if args.command == "prefill":
        from .prefill import create_prefill_app

        app = create_prefill_app(settings)
    else:
        from .decode import create_decode_app

        app = create_decode_app(settings)
    return serve(app, args.host, args.port, role=args.command, parent_watch=args.parent_watch)


def _run_proxy(args: argparse.Namespace) -> int:
    from .config import ProxySettings
    from .proxy import create_proxy_app
    from .web import serve

    settings = ProxySettings(
        prefill=args.prefill,
        decode=args.decode,
        model=model_config(args),
        mode=args.mode,
        transfer_timeout=args.transfer_timeout,
        control_timeout=args.control_timeout,
        admission_timeout=args.admission_timeout,
    )
    return serve(create_proxy_app(settings), args.host, args.port, role="proxy", parent_watch=args.parent_watch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moriio_async.serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _instance_parser(sub, "prefill")
    _instance_parser(sub, "decode")
    p = sub.add_parser("proxy", help="run the OpenAI-compatible proxy over given instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prefill", action="append", required=True, metavar="URL")
    p.add_argument("--decode", action="append", required=True, metavar="URL")
    p.add_argument("--mode", choices=["read", "write"], default="write", help="vLLM MoRIIO's read_mode")
    p.add_argument("--parent-watch", action="store_true")
    add_model_args(p)
    add_timeout_args(p)
    from .demo import add_demo_parser

    add_demo_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if args.command in ("prefill", "decode"):
        return _run_instance(args)
    if args.command == "proxy":
        return _run_proxy(args)
    from .demo import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
