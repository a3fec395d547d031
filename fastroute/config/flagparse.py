"""The argparse machinery of the ``fastroute`` command line, shared by the modules that define
its flags (:mod:`fastroute.config.peerflags`, :mod:`fastroute.config.ownflags`) and by :mod:`fastroute.config.cli`,
which builds the parser from them and parses.

* :class:`Parser`: argument errors are start-up refusals (one line, JSON with ``--log-json``);
* :class:`Adder`: adds each flag to its help group plus the hidden ``--router-`` spelling that
  ``sglang.launch_server`` passes (never for ``--host``/``--port``/``--worker-urls``, nor for
  peer flags whose own name starts with ``--router-``);
* :class:`IgnoredFlag`, :class:`DiscoveryOption`: actions that note an inventory flag or a
  discovery sub-flag for :func:`fastroute.config.config_from_args` to judge;
* the value types (``--workers N|auto``, the power-of-two load metric) and the inventory's
  flags by status (:mod:`fastroute.config.flags` is the inventory).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

import fastroute.config.flags as flags
from fastroute.config.settings import P2C_LOAD_METRICS
from fastroute.log import startup_error
from fastroute.names import REFUSED_LOAD_METRICS

ROUTER_PREFIX = "--router-"
# Flags that sglang.launch_server never prefixes with --router- (protocol.md 9).
_NEVER_PREFIXED = frozenset({"--host", "--port", "--worker-urls"})
# Peer flags that start with --router- and are flags of their own, not a prefixed spelling
# (smg's --router-selector picks its mesh's router pods): the inventory judges them by name.
_OWN_PREFIXED = frozenset(f.name for f in flags.TABLE if f.name.startswith(ROUTER_PREFIX))

# Every peer flag fastroute accepts without a field of its own comes from the one inventory,
# fastroute.config.flags.TABLE (implemented / inert / refused, with the reason).
BY_STATUS: dict[str, tuple[str, ...]] = {
    status: tuple(n for n in flags.COMPAT_NAMES if flags.row_of(n).status == status) for status in flags.STATUSES
}
# Inert flags: accepted with one warning each.
IGNORED_FLAGS: tuple[str, ...] = BY_STATUS[flags.INERT]
# Whole flag families of the peers (`--redis-url`, `--jwt-issuer`, ...): matched by prefix
# before argparse sees the command line, because their members are not enumerable here.
IGNORED_FAMILIES: tuple[str, ...] = flags.FAMILY_PREFIXES

LOG_LEVEL_CHOICES = ("debug", "info", "warn", "warning", "error", "critical")


class Parser(argparse.ArgumentParser):
    """Argument errors are start-up refusals: one line (no usage block), JSON with --log-json."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        startup_error(message, self.json_errors)
        self.exit(2)


def wants_json(argv: Sequence[str]) -> bool:
    for token in argv:
        if token == "--":
            return False
        if token in ("--log-json", "--router-log-json"):
            return True
    return False


class IgnoredFlag(argparse.Action):
    """Swallow a compatibility flag and its values; remember both for fastroute.config.flags.apply."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "*")
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        flag = canonical(option_string or self.option_strings[0])
        if isinstance(values, str):
            values = [values]
        namespace.ignored_flags.append((flag, list(values or ())))


class DiscoveryOption(argparse.Action):
    """Store a discovery sub-flag and note its name: config drops the note when discovery is on
    and otherwise reports the flag as ignored (it means nothing without discovery)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.ignored_flags.append((canonical(option_string or self.option_strings[0]), []))


def canonical(flag: str) -> str:
    flag = flag.split("=", 1)[0]
    if flag.startswith(ROUTER_PREFIX) and flag not in _OWN_PREFIXED:
        return "--" + flag[len(ROUTER_PREFIX) :]
    return flag


def workers_value(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


def p2c_metric(text: str) -> str:
    value = text.strip().lower()
    if value in P2C_LOAD_METRICS or value in REFUSED_LOAD_METRICS:
        return value  # expected_wait parses and is refused with its reason (fastroute.config.checks)
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from " + ", ".join(P2C_LOAD_METRICS) + ")")


class Adder:
    """Adds a flag to a help group plus its hidden `--router-` alias on the parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.group: Any = parser

    def section(self, title: str, description: str | None = None) -> Adder:
        self.group = self.parser.add_argument_group(title, description)
        return self

    def __call__(self, *names: str, **kwargs: Any) -> None:
        action = self.group.add_argument(*names, **kwargs)
        if names[0] in _NEVER_PREFIXED:
            return
        alias_kwargs = dict(kwargs)
        alias_kwargs["help"] = argparse.SUPPRESS
        if not isinstance(action, IgnoredFlag):
            # Share the dest; the visible flag alone supplies the default.
            alias_kwargs["dest"] = action.dest
            if "default" in alias_kwargs or action.default is not None:
                alias_kwargs["default"] = argparse.SUPPRESS
        aliases = [
            ROUTER_PREFIX + n[2:] for n in names if n.startswith("--") and ROUTER_PREFIX + n[2:] not in _OWN_PREFIXED
        ]
        if aliases:
            self.parser.add_argument(*aliases, **alias_kwargs)
