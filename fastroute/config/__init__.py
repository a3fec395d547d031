"""Configuration: the command line (sglang-router / smg compatible) and the environment, turned
into one validated, typed :class:`Config`.

The face is what the rest of the router reads: :class:`Config`, :class:`ConfigError` (a start-up
refusal naming its flag), :func:`config_from_args`, :func:`default` and the policy and field
vocabularies below. Inside the package:

* ``settings``: the :class:`Config` dataclass and how parsed arguments become one;
* ``checks``: every start-up rule (one function per concern, each naming the flag it refuses);
* ``cli``: ``fastroute`` / ``python -m fastroute``: the parser, the subcommands, ``main``;
* ``flagparse``: the argparse machinery (actions, value parsers, the inventory's handling);
* ``peerflags``, ``ownflags``: the flags themselves, the peers' and fastroute's own;
* ``flags``: the inventory of the peers' flags not implemented as such (inert or refused).
"""

from fastroute.config.settings import (
    ALL_POLICIES,
    DEFAULT_DURATION_BUCKETS,
    DP_RANK_FIELDS,
    PREFILL_ONLY_POLICIES,
    Config,
    ConfigError,
    config_from_args,
    default,
)

__all__ = [
    "ALL_POLICIES",
    "DEFAULT_DURATION_BUCKETS",
    "DP_RANK_FIELDS",
    "PREFILL_ONLY_POLICIES",
    "Config",
    "ConfigError",
    "config_from_args",
    "default",
]
