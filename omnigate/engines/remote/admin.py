"""Operating the engine tier: deploy replicas, scale, drain the emptiest replica, show state.

``python -m omnigate.engines.remote deploy --replicas 2 --engine synthetic --ray-address HOST:PORT`` and friends.
Scale-out adds engine applications; scale-in drains the replica with the fewest live streams (it stops admitting,
gateways move their sessions at the next utterance, live utterances finish up to the deadline, the rest end with
a typed ``shutting_down`` error) and only then deletes it, so Serve never picks a busy replica to stop.

These calls block (they wait on the Serve controller); the gateway never uses them on its event loop.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence

import msgspec
import ray
from ray import serve

from omnigate.engines.registry import LOADERS
from omnigate.engines.remote.protocol import DrainResult, ReplicaReport, ReplicaStats, decode_drain, decode_stats
from omnigate.engines.remote.serve import DEFAULT_APP_PREFIX, EngineAppArgs, engine_app, is_engine_app

CALL_TIMEOUT_S = 30.0


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` as a driver (no-op when this process already joined one)."""
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)


def engine_apps(prefix: str = DEFAULT_APP_PREFIX) -> list[str]:
    status = serve.status()
    return sorted((n for n in status.applications if is_engine_app(n, prefix)), key=_index_key)


def deploy(args: EngineAppArgs, replicas: int, prefix: str = DEFAULT_APP_PREFIX) -> list[str]:
    """Add ``replicas`` engine replicas, each its own application; returns their names once they run."""
    # Gateways call replicas through handles: no Serve HTTP proxy (it would also take port 8000 on every node).
    serve.start(proxy_location="Disabled")
    taken = {_index_key(n) for n in engine_apps(prefix)}
    names: list[str] = []
    index = 0
    while len(names) < replicas:
        if index not in taken:
            names.append(f"{prefix}-{index}")
        index += 1
    for name in names:
        serve.run(engine_app(msgspec.to_builtins(args)), name=name, route_prefix=None)
    return names


def replica_stats(name: str) -> ReplicaStats:
    handle = serve.get_app_handle(name)
    data: bytes = handle.options(method_name="stats").remote().result(timeout_s=CALL_TIMEOUT_S)
    return decode_stats(data)


def choose_emptiest(reports: Mapping[str, ReplicaReport]) -> str:
    """The replica to drain: fewest live streams; among equals the newest (highest index)."""
    if not reports:
        raise ValueError("no engine replica to choose from")
    return min(reports, key=lambda name: (reports[name].active, -_index_key(name), name))


def drain(name: str, deadline_s: float, *, remove: bool = True) -> DrainResult:
    """Drain ``name`` (see the module docstring), then delete its application unless ``remove`` is false."""
    handle = serve.get_app_handle(name)
    data: bytes = handle.options(method_name="drain").remote(deadline_s).result(timeout_s=deadline_s + CALL_TIMEOUT_S)
    if remove:
        serve.delete(name)
    return decode_drain(data)


def drain_emptiest(deadline_s: float, prefix: str = DEFAULT_APP_PREFIX, *, remove: bool = True) -> DrainResult:
    reports = {name: replica_stats(name).report for name in engine_apps(prefix)}
    return drain(choose_emptiest(reports), deadline_s, remove=remove)


def scale(args: EngineAppArgs, replicas: int, deadline_s: float, prefix: str = DEFAULT_APP_PREFIX) -> list[str]:
    """Make the engine tier ``replicas`` strong; returns the replicas deployed afterwards."""
    current = engine_apps(prefix)
    if replicas > len(current):
        deploy(args, replicas - len(current), prefix)
    for _ in range(len(current) - replicas):
        drain_emptiest(deadline_s, prefix)
    return engine_apps(prefix)


def _index_key(name: str) -> int:
    match = re.search(r"-(\d+)$", name)
    return int(match.group(1)) if match else -1


# ---- command line -----------------------------------------------------------------------------------------------


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m omnigate.engines.remote",
        description="Run omnigate's engine replicas on a Ray cluster (Ray Serve), one application per replica.",
    )
    parser.add_argument("--ray-address", default=None, help="the Ray cluster (HOST:PORT); default: RAY_ADDRESS")
    parser.add_argument("--prefix", default=DEFAULT_APP_PREFIX, help="engine application name prefix")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("deploy", "add engine replicas"), ("scale", "grow, or shrink by draining the emptiest")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--replicas", type=int, required=True, help="replicas to add (deploy) or to have (scale)")
        cmd.add_argument("--engine", default="synthetic", choices=sorted(LOADERS))
        cmd.add_argument("--model", default=None, help="what the engine loads (see omnigate serve --model)")
        cmd.add_argument("--engine-option", "-E", action="append", type=_pair, default=[], metavar="KEY=VALUE")
        cmd.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (1 for a model engine)")
        cmd.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
        cmd.add_argument("--resource", action="append", type=_pair, default=[], metavar="NAME=AMOUNT")
        cmd.add_argument("--drain-deadline", type=float, default=120.0, help="scale-in: seconds for live streams")
    drain_cmd = sub.add_parser("drain", help="drain one replica and delete it")
    which = drain_cmd.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help="the engine application to drain")
    which.add_argument("--emptiest", action="store_true", help="the replica with the fewest live streams")
    drain_cmd.add_argument("--deadline", type=float, default=120.0, help="seconds live streams may take")
    drain_cmd.add_argument("--keep", action="store_true", help="leave it deployed (and refusing) after the drain")
    sub.add_parser("status", help="print every engine replica's state as JSON")
    return parser


def _app_args(args: argparse.Namespace) -> EngineAppArgs:
    return EngineAppArgs(
        engine=args.engine,
        model=args.model,
        engine_options=dict(args.engine_option),
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
        resources={key: float(value) for key, value in args.resource},
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    connect(args.ray_address)
    if args.command == "deploy":
        print(json.dumps({"deployed": deploy(_app_args(args), args.replicas, args.prefix)}))
    elif args.command == "scale":
        print(json.dumps({"replicas": scale(_app_args(args), args.replicas, args.drain_deadline, args.prefix)}))
    elif args.command == "drain":
        if args.emptiest:
            result = drain_emptiest(args.deadline, args.prefix, remove=not args.keep)
        else:
            result = drain(args.name, args.deadline, remove=not args.keep)
        print(msgspec.json.encode(result).decode())
    else:
        stats = {name: replica_stats(name) for name in engine_apps(args.prefix)}
        print(msgspec.json.encode(stats).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
