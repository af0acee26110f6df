"""Multi-node flags of `pdserve serve` and `pdserve router` (DESIGN §8).

``--worker-host``: where workers bind (default: their node's IP, advertised as is; a wildcard
binds every interface and advertises the node IP). ``--prefill-resources`` /
``--decode-resources``: Ray custom resources each worker of the role requires, matched by
``ray start --resources`` on the nodes of that role's group. ``--internal-token``: the shared
secret of worker gRPC calls and KV handshakes (pdserve/auth.py); the router and the workers take
it from the same flag or ``PDSERVE_INTERNAL_TOKEN``.
"""

from __future__ import annotations

import argparse
import json

from pdserve import env


def parse_resources(text: str) -> dict[str, float]:
    """'{"pdserve_prefill": 1}' -> {'pdserve_prefill': 1.0}. Raises argparse.ArgumentTypeError
    naming what is wrong (not a JSON object, a non-numeric or non-positive amount)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"pdserve_prefill\": 1}}', got {text!r} ({e.msg})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    out: dict[str, float] = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
            raise argparse.ArgumentTypeError(
                f"resource {name!r} needs a number > 0, got {amount!r}"
            )
        out[str(name)] = float(amount)
    return out


def add_multinode_args(p: argparse.ArgumentParser, *, launches_workers: bool) -> None:
    """Add the multi-node flags (the placement ones only where workers are launched)."""
    g = p.add_argument_group("multi-node")
    if launches_workers:
        g.add_argument(
            "--worker-host",
            default=None,
            help="address workers bind their gRPC and KV ports to (default: their node's IP; "
            "0.0.0.0 binds every interface and advertises the node IP)",
        )
        for role in ("prefill", "decode"):
            g.add_argument(
                f"--{role}-resources",
                type=parse_resources,
                default={},
                metavar="JSON",
                help=f"Ray custom resources each {role} worker needs, e.g. "
                f"'{{\"pdserve_{role}\": 1}}' for nodes started with `ray start --resources` "
                "(default: none, Ray places freely)%(default).0s",  # no second default note
            )
    g.add_argument(
        "--internal-token",
        default=None,
        help="shared secret every worker gRPC call and KV handshake must carry "
        f"(default: ${env.INTERNAL_TOKEN}, which `ps` does not show; none = no check, for one "
        "machine)",
    )


def internal_token(args: argparse.Namespace) -> str | None:
    """``--internal-token`` or ``PDSERVE_INTERNAL_TOKEN`` (None when neither is set)."""
    return args.internal_token or env.internal_token()
