"""Flow-control policy files and tenants: smg 1.13's priority-scheduler YAML, its tenant
rate-limit YAML, and the rule that names the tenant of a request.

Read once at start-up (``load_scheduler``, ``load_rate_limits``); any error is a
:class:`PolicyError` whose message starts with ``file:line``, so the CLI can exit 1 naming the
place. Nothing here runs per request except :meth:`Tenants.resolve` and
:meth:`RateLimits.rule_for`, and only when a flow-control flag is given
(:mod:`fastroute.dataplane.flowcontrol` holds the per-request state).

The formats are smg's (its reference pages "Priority Scheduler" and "Tenant Rate Limiting"):

* scheduler: ``classes: {<class>: {reserved_floor, reserved_per_slot, queue_size, queue_timeout_secs,
  starvation_threshold_secs, can_preempt}}`` and ``tenant_policies: {<tenant key>: {max_class}}``;
* rate limits: ``default_policy`` and ``tenants[]`` with ``tenant_key``, ``tokens_per_minute``,
  ``requests_per_minute`` and ``model_rules[]`` (``rule_id``, ``matcher: {type: exact|prefix,
  value}``, ``tokens_per_minute``, ``requests_per_minute``).

Pure Python; imports nothing else from fastroute (the config checks and the data plane read it).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml  # type: ignore[import-untyped]


def flow_enabled(config: Any) -> bool:
    """Whether any flow-control flag is given (else the plain admission stays)."""
    return bool(
        config.priority_scheduler_enabled
        or config.tenant_rate_limit_enabled
        or config.tenant_api_key
        or config.worker_overload_shed
    )


# The tenant label of the counts of tenants past a bound (the metrics' top N, the counters' fold).
OTHER_TENANT = "other"


def fold_tenants(counters: list[dict], keep: int) -> list[dict]:
    """``counters`` (keys whose first item is a tenant) with every tenant but the ``keep``
    most counted over all of them (ties by name) merged into OTHER_TENANT: new dicts, the same
    totals."""
    per_tenant: dict[str, int] = {}
    for d in counters:
        for k, v in d.items():
            per_tenant[k[0]] = per_tenant.get(k[0], 0) + v
    named = set(sorted(per_tenant, key=lambda t: (-per_tenant[t], t))[:keep])
    out = []
    for d in counters:
        folded: dict = {}
        for k, v in d.items():
            key = k if k[0] in named else (OTHER_TENANT, *k[1:])
            folded[key] = folded.get(key, 0) + v
        out.append(folded)
    return out


# The classes, highest first: a smaller index is served first.
CLASSES: tuple[str, ...] = ("system", "interactive", "default", "bulk")
DEFAULT_CLASS = 2
_CLASS_INDEX = {name: i for i, name in enumerate(CLASSES)}


def class_index(value: str | bytes | None) -> int:
    """The class a header value asks for: case-insensitive, trimmed; unknown or missing is
    ``default`` (smg's header rule: a typo never fails admission)."""
    if value is None:
        return DEFAULT_CLASS
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return _CLASS_INDEX.get(value.strip().lower(), DEFAULT_CLASS)


class PolicyError(ValueError):
    """A policy file that cannot be used; the message starts with ``path:line``."""


@dataclass(frozen=True)
class ClassSpec:
    """One class's knobs (smg 1.13's names)."""

    reserved_floor: int
    queue_size: int
    queue_timeout_secs: float
    starvation_threshold_secs: float
    can_preempt: bool = False
    reserved_per_slot: float = 0.0

    def reserved(self, capacity: float) -> int:
        """Slots this class reserves under ``capacity``: max(floor, ceil(share x capacity))."""
        share = math.ceil(self.reserved_per_slot * capacity) if self.reserved_per_slot and capacity < math.inf else 0
        return max(self.reserved_floor, share)


# smg's built-in table, except two knobs. can_preempt: fastroute does not cancel admitted
# requests (a file that asks for it is refused by its line). reserved_floor: fastroute holds a
# class's reservation back whole from the classes below it, not only its unused part, so smg's
# 32 + 128 would shut default and bulk out under a small capacity; given in a file, the floors
# must stay under --max-concurrent-requests (when given; FlowAdmission.room shrinks them under a
# smaller reported capacity).
BUILTIN_CLASSES: dict[str, ClassSpec] = {
    "system": ClassSpec(0, 64, 30, 5),
    "interactive": ClassSpec(0, 256, 30, 5),
    "default": ClassSpec(0, 512, 60, 30),
    "bulk": ClassSpec(0, 1024, 300, 120),
}


@dataclass
class SchedulerPolicy:
    """The scheduler's classes (in ``CLASSES`` order) and the tenants' ceilings."""

    classes: list[ClassSpec]
    max_class: dict[str, int] = field(default_factory=dict)
    default_max_class: int = DEFAULT_CLASS

    def ceiling(self, tenant: str) -> int:
        return self.max_class.get(tenant, self.default_max_class)


# ---- YAML with line numbers -------------------------------------------------------------------


class _Doc:
    """A composed YAML document: nodes keep their line, values are built on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise PolicyError(f"{path}: cannot be read: {exc.strerror or exc}") from None
        self._loader = yaml.SafeLoader(text)
        try:
            self.root = self._loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            raise PolicyError(f"{path}:{line}: not valid YAML: {exc.problem or exc}") from None
        except yaml.YAMLError as exc:
            raise PolicyError(f"{path}:1: not valid YAML: {exc}") from None

    def fail(self, node: Any, message: str) -> PolicyError:
        line = node.start_mark.line + 1 if node is not None else 1
        return PolicyError(f"{self.path}:{line}: {message}")

    def mapping(self, node: Any, where: str, allowed: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
        """{key: (key node, value node)}; unknown or repeated keys are errors."""
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{where} must be a mapping")
        out: dict[str, tuple[Any, Any]] = {}
        for k, v in node.value:
            key = self.scalar(k)
            if not isinstance(key, str):
                raise self.fail(k, f"{where}: keys must be strings")
            if allowed and key not in allowed:
                raise self.fail(k, f"{where}: unknown field {key!r} (known: {', '.join(allowed)})")
            if key in out:
                raise self.fail(k, f"{where}: {key!r} is given twice")
            out[key] = (k, v)
        return out

    def scalar(self, node: Any) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, "expected a single value")
        return self._loader.construct_object(node, deep=True)

    def integer(self, node: Any, where: str, lo: int) -> int:
        v = self.scalar(node)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(node, f"{where} must be an integer")
        if v < lo:
            raise self.fail(node, f"{where} must be >= {lo}")
        return int(v)

    def share(self, node: Any, where: str) -> float:
        v = self.scalar(node)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise self.fail(node, f"{where} must be a finite number >= 0")
        return float(v)

    def boolean(self, node: Any, where: str) -> bool:
        v = self.scalar(node)
        if not isinstance(v, bool):
            raise self.fail(node, f"{where} must be true or false")
        return v

    def string(self, node: Any, where: str) -> str:
        v = self.scalar(node)
        if not isinstance(v, str) or not v or v != v.strip():
            raise self.fail(node, f"{where} must be a non-empty string without surrounding whitespace")
        return v

    def empty(self) -> bool:
        return self.root is None or (isinstance(self.root, yaml.ScalarNode) and self.scalar(self.root) is None)


def _class_name(doc: _Doc, node: Any, where: str) -> int:
    name = doc.scalar(node)
    if name not in _CLASS_INDEX:
        raise doc.fail(node, f"{where}: unknown class {name!r} (one of {', '.join(CLASSES)})")
    return _CLASS_INDEX[name]


_CLASS_FIELDS = (
    "reserved_floor",
    "reserved_per_slot",
    "queue_size",
    "queue_timeout_secs",
    "starvation_threshold_secs",
    "can_preempt",
)


def load_scheduler(path: str | None, default_max_class: str = "default") -> SchedulerPolicy:
    """The scheduler policy of ``--priority-scheduler-config`` (None: the built-in classes)."""
    ceiling = class_index(default_max_class)
    classes = dict(BUILTIN_CLASSES)
    max_class: dict[str, int] = {}
    if path is not None:
        doc = _Doc(path)
        if not doc.empty():
            top = doc.mapping(doc.root, "the scheduler config", ("classes", "tenant_policies"))
            if "classes" in top:
                for name, (kn, vn) in doc.mapping(top["classes"][1], "classes", ()).items():
                    _class_name(doc, kn, "classes")
                    where = f"classes.{name}"
                    given = doc.mapping(vn, where, _CLASS_FIELDS)
                    base = classes[name]
                    vals: dict[str, Any] = {
                        "reserved_floor": base.reserved_floor,
                        "reserved_per_slot": base.reserved_per_slot,
                        "queue_size": base.queue_size,
                        "queue_timeout_secs": base.queue_timeout_secs,
                        "starvation_threshold_secs": base.starvation_threshold_secs,
                        "can_preempt": False,
                    }
                    for key, (_, node) in given.items():
                        if key == "can_preempt":
                            if doc.boolean(node, f"{where}.can_preempt"):
                                raise doc.fail(
                                    node,
                                    f"{where}.can_preempt: cancelling an admitted request to make room is "
                                    "not implemented by fastroute; set it to false",
                                )
                        elif key in ("reserved_floor", "queue_size"):
                            vals[key] = doc.integer(node, f"{where}.{key}", 0)
                        elif key == "reserved_per_slot":
                            vals[key] = doc.share(node, f"{where}.{key}")
                        else:
                            vals[key] = float(doc.integer(node, f"{where}.{key}", 1))
                    classes[name] = ClassSpec(**vals)
            if "tenant_policies" in top:
                for tenant, (kn, vn) in doc.mapping(top["tenant_policies"][1], "tenant_policies", ()).items():
                    _check_tenant_key(doc, kn, tenant)
                    pol = doc.mapping(vn, f"tenant_policies.{tenant}", ("max_class",))
                    if "max_class" not in pol:
                        raise doc.fail(vn, f"tenant_policies.{tenant}: max_class is required")
                    max_class[tenant] = _class_name(doc, pol["max_class"][1], f"tenant_policies.{tenant}.max_class")
    return SchedulerPolicy([classes[n] for n in CLASSES], max_class, ceiling)


# ---- tenant rate limits -----------------------------------------------------------------------

_RULE_ID = re.compile(r"[A-Za-z0-9._-]+\Z")
_TENANT_PREFIXES = ("auth:", "header:", "ip:")


def _check_tenant_key(doc: _Doc, node: Any, key: Any) -> None:
    if not isinstance(key, str) or not key or key != key.strip():
        raise doc.fail(node, f"tenant key {key!r} must be a non-empty string without surrounding whitespace")
    if key != "anonymous" and not (key.startswith(_TENANT_PREFIXES) and len(key) > key.index(":") + 1):
        raise doc.fail(node, f"tenant key {key!r} must be auth:<id>, header:<id>, ip:<address> or anonymous")


@dataclass
class Bucket:
    """A continuous-refill bucket: holds at most ``per_minute``, refills it every minute."""

    per_minute: float
    level: float = -1.0
    at: float = 0.0

    def fill(self, now: float) -> float:
        if self.level < 0.0:
            self.level = self.per_minute
        else:
            self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now
        return self.level

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is affordable (after ``fill``)."""
        return max(0.0, (amount - self.level) * 60.0 / self.per_minute)


@dataclass
class Rule:
    """A scope: the tenant's global limits, or one of its model rules."""

    rule_id: str
    tokens_per_minute: int
    requests_per_minute: int
    exact: str | None = None
    prefix: str | None = None


@dataclass
class TenantLimits:
    scope: Rule
    exact: dict[str, Rule] = field(default_factory=dict)
    prefixes: list[Rule] = field(default_factory=list)  # longest prefix first

    def rule_for(self, model: str | None) -> Rule | None:
        if not model:
            return None
        r = self.exact.get(model)
        if r is not None:
            return r
        for r in self.prefixes:
            if model.startswith(r.prefix or ""):
                return r
        return None


@dataclass
class RateLimits:
    """The tenant rate-limit policy: the default and the listed tenants."""

    default: TenantLimits
    tenants: dict[str, TenantLimits]

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)


_POLICY_FIELDS = ("tenant_key", "tokens_per_minute", "requests_per_minute", "model_rules")


def _policy(doc: _Doc, node: Any, label: str, is_default: bool) -> tuple[str | None, TenantLimits]:
    m = doc.mapping(node, label, _POLICY_FIELDS)
    key: str | None = None
    if is_default:
        if "tenant_key" in m:
            raise doc.fail(m["tenant_key"][0], "default_policy must not set tenant_key")
    else:
        if "tenant_key" not in m:
            raise doc.fail(node, f"{label} is missing tenant_key")
        key = doc.scalar(m["tenant_key"][1])
        _check_tenant_key(doc, m["tenant_key"][1], key)
        label = f"tenant {key}"
    for need in ("tokens_per_minute", "requests_per_minute"):
        if need not in m:
            raise doc.fail(node, f"{label}: {need} is required")
    scope = Rule(
        "",
        doc.integer(m["tokens_per_minute"][1], f"{label}: tokens_per_minute", 1),
        doc.integer(m["requests_per_minute"][1], f"{label}: requests_per_minute", 1),
    )
    limits = TenantLimits(scope)
    if "model_rules" in m:
        rules_node = m["model_rules"][1]
        if not isinstance(rules_node, yaml.SequenceNode):
            raise doc.fail(rules_node, f"{label}: model_rules must be a list")
        ids: set[str] = set()
        prefixes: set[str] = set()
        for rn in rules_node.value:
            r = doc.mapping(
                rn, f"{label}: model rule", ("rule_id", "matcher", "tokens_per_minute", "requests_per_minute")
            )
            for need in ("rule_id", "matcher", "tokens_per_minute", "requests_per_minute"):
                if need not in r:
                    raise doc.fail(rn, f"{label}: a model rule is missing {need}")
            rid = doc.scalar(r["rule_id"][1])
            if not isinstance(rid, str) or not _RULE_ID.match(rid):
                raise doc.fail(r["rule_id"][1], f"{label}: rule_id {rid!r} must match [A-Za-z0-9._-]+")
            if rid in ids:
                raise doc.fail(r["rule_id"][1], f"{label}: duplicate rule_id {rid!r}")
            ids.add(rid)
            mt = doc.mapping(r["matcher"][1], f"{label}: rule {rid} matcher", ("type", "value"))
            if "type" not in mt or "value" not in mt:
                raise doc.fail(r["matcher"][1], f"{label}: rule {rid} matcher needs type and value")
            kind = doc.scalar(mt["type"][1])
            value = doc.string(mt["value"][1], f"{label}: rule {rid} matcher.value")
            rule = Rule(
                rid,
                doc.integer(r["tokens_per_minute"][1], f"{label}: rule {rid} tokens_per_minute", 1),
                doc.integer(r["requests_per_minute"][1], f"{label}: rule {rid} requests_per_minute", 1),
            )
            if kind == "exact":
                if value in limits.exact:
                    raise doc.fail(mt["value"][1], f"{label}: two exact rules for {value!r}")
                rule.exact = value
                limits.exact[value] = rule
            elif kind == "prefix":
                if value in prefixes:
                    raise doc.fail(mt["value"][1], f"{label}: two prefix rules for {value!r}")
                prefixes.add(value)
                rule.prefix = value
                limits.prefixes.append(rule)
            else:
                raise doc.fail(mt["type"][1], f"{label}: rule {rid} matcher.type must be exact or prefix")
        limits.prefixes.sort(key=lambda r: -len(r.prefix or ""))
    return key, limits


def load_rate_limits(path: str, trust_tenant_header: bool) -> RateLimits:
    """The policy of ``--tenant-rate-limit-config``."""
    doc = _Doc(path)
    if doc.empty():
        raise doc.fail(doc.root, "default_policy is required")
    top = doc.mapping(doc.root, "the tenant rate-limit config", ("default_policy", "tenants"))
    if "default_policy" not in top:
        raise doc.fail(doc.root, "default_policy is required")
    _, default = _policy(doc, top["default_policy"][1], "default_policy", True)
    tenants: dict[str, TenantLimits] = {}
    if "tenants" in top:
        seq = top["tenants"][1]
        if not isinstance(seq, yaml.SequenceNode):
            raise doc.fail(seq, "tenants must be a list")
        for i, tn in enumerate(seq.value):
            key, lim = _policy(doc, tn, f"tenants[{i}]", False)
            assert key is not None
            if key in tenants:
                raise doc.fail(tn, f"duplicate tenant_key {key!r}")
            if key.startswith("header:") and not trust_tenant_header:
                raise doc.fail(tn, f"tenant_key {key!r} can never match without --trust-tenant-header")
            tenants[key] = lim
    return RateLimits(default, tenants)


# ---- tenants ----------------------------------------------------------------------------------


def parse_tenant_keys(specs: list[str]) -> list[tuple[str, str]]:
    """``--tenant-api-key tenant_id:key`` entries (split at the first ':', both parts trimmed).
    The message of an error never contains the key."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        tenant, sep, key = spec.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not sep:
            raise ValueError("expected 'tenant_id:key' (missing ':' separator)")
        if not tenant or not key:
            raise ValueError("expected 'tenant_id:key' with both parts non-empty")
        out.append((tenant, key))
    return out


class Tenants:
    """Who a request belongs to: ``auth:<id>`` (its bearer key is a ``--tenant-api-key``),
    ``header:<id>`` (``--trust-tenant-header``), ``ip:<address>``, else ``anonymous``."""

    def __init__(self, keys: list[tuple[str, str]], trust_header: bool, header_name: str) -> None:
        self._keys = {hashlib.sha256(k.encode()).digest(): t for t, k in keys}
        self.header = header_name.lower().encode("latin-1") if trust_header else None

    @property
    def has_keys(self) -> bool:
        return bool(self._keys)

    def by_key(self, auth: bytes | None) -> str | None:
        """The tenant id whose key this Authorization value carries, else None."""
        if not auth or not self._keys:
            return None
        scheme, _, token = auth.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return None
        digest = hashlib.sha256(token.strip()).digest()
        for d, tenant in self._keys.items():
            if hmac.compare_digest(d, digest):
                return tenant
        return None

    def resolve(self, auth: bytes | None, header: bytes | None, peer: str | None) -> str:
        t = self.by_key(auth)
        if t is not None:
            return "auth:" + t
        if header is not None:
            h = header.strip()
            if h:
                return "header:" + h.decode("latin-1")
        if peer:
            return "ip:" + peer
        return "anonymous"
