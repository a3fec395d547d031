"""Multi-model routing (``--enable-igw``): one routing group per model, chosen by the request.

Without ``--enable-igw`` the registry keeps one :class:`~fastroute.core.routing.Group` per role
and nothing here runs.  With it, each role's group is a :class:`ModelGroups`: the same
``acquire(tokens, key, meta, out_tokens)`` the data path already calls, which looks up
``meta.model`` and lets that model's own group (same policy and settings as the role's) balance
among that model's targets only.  A request for another model's name never reaches the others'
workers; it does not share their round-robin cursor, prefix tree or manual keys either.

Which model a worker serves is decided at registration (``fastroute.control.worker.
model_id_of``: the ``model_id`` given to ``POST /workers``, else the worker's
``served_model_name``, else the last segment of its ``model_path``).  A request may name the
model by that id, by the worker's ``served_model_name`` or full ``model_path``, or by an alias
from ``--model-alias ALIAS=MODEL``.

Workers added or removed at run time move between groups through ``set_targets`` (the registry
calls it on every change of the role's targets, as for a plain group); a model's group lives
as long as the model has targets, so its policy state survives other models' churn.  Under
``--dp-aware`` a worker's targets are its ranks, all in its model's group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastroute.errors import CODE_BAD_REQUEST, CODE_MODEL_NOT_FOUND, RouterError

__all__ = ["ModelGroups", "parse_aliases", "worker_model_names"]


def parse_aliases(items: Iterable[str]) -> dict[str, str]:
    """``["alias=model", ...]`` -> {alias: model}; ValueError names the bad item."""
    out: dict[str, str] = {}
    for item in items:
        alias, sep, model = item.partition("=")
        alias, model = alias.strip(), model.strip()
        if not sep or not alias or not model:
            raise ValueError(f"{item!r} is not ALIAS=MODEL")
        out[alias] = model
    return out


def worker_model_names(w: Any) -> tuple[str, ...]:
    """The names a request may use for ``w``'s model, its model id first."""
    names = [w.model_id]
    for info in (w.server_info, w.model_info):
        for field in ("served_model_name", "model_path"):
            v = info.get(field) if isinstance(info, dict) else None
            if isinstance(v, str) and v and v not in names:
                names.append(v)
    return tuple(names)


class ModelGroups:
    """A role's targets split by model, one routing group each; see the module docstring.

    ``make_group()`` builds an empty group configured like the role's; ``names_of(t)`` gives the
    model names of target ``t`` (its model id first)."""

    def __init__(
        self,
        make_group: Callable[[], Any],
        names_of: Callable[[int], Sequence[str]],
        aliases: dict[str, str] | None = None,
        policy: str = "unknown",
    ) -> None:
        self.policy = policy  # the metrics' policy label (every model's)
        self._make = make_group
        self._names_of = names_of
        self._aliases = dict(aliases or {})
        self._ledger: Any = None
        self.models: dict[str, Any] = {}  # model id -> group
        self.by_name: dict[str, Any] = {}  # every accepted name (ids, paths, aliases) -> group
        self.targets: list[int] = []
        self.names: list[str] = []

    # -- the Group interface the data path and the registry use ------------------------------
    def acquire(self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0) -> Any:
        model = meta.model if meta is not None else None
        g = self.by_name.get(model) if model is not None else self._only()
        if g is None:
            return None
        return g.acquire(tokens, key, meta, out_tokens)

    def set_targets(self, targets: Sequence[int], names: Sequence[str] | None = None) -> None:
        targets = [int(t) for t in targets]
        names = list(names) if names is not None else [str(t) for t in targets]
        parts: dict[str, tuple[list[int], list[str], list[str]]] = {}
        for t, n in zip(targets, names):
            model_names = self._names_of(t)
            ts, ns, known = parts.setdefault(model_names[0], ([], [], []))
            ts.append(t)
            ns.append(n)
            known.extend(x for x in model_names if x not in known)
        for model in [m for m in self.models if m not in parts]:
            self.models.pop(model).set_targets([], [])
        by_name: dict[str, Any] = {}
        for model, (ts, ns, known) in parts.items():
            g = self.models.get(model)
            if g is None:
                g = self.models[model] = self._make()
                if self._ledger is not None:
                    g.track_in(self._ledger)
            g.set_targets(ts, ns)
            for x in known:
                by_name.setdefault(x, g)
        for alias, model in self._aliases.items():
            g = by_name.get(model)
            if g is not None:
                by_name.setdefault(alias, g)
        self.by_name = by_name
        self.targets = targets
        self.names = names

    def track_in(self, ledger: Any) -> None:
        self._ledger = ledger
        for g in self.models.values():
            g.track_in(ledger)

    @property
    def kv_counts(self) -> dict[str, int]:
        out = {"agree": 0, "disagree": 0, "fallback": 0}
        for g in self.models.values():
            for k, v in g.kv_counts.items():
                out[k] += v
        return out

    @property
    def shadow_agree(self) -> int:
        return sum(g.shadow_agree for g in self.models.values())

    @property
    def shadow_disagree(self) -> int:
        return sum(g.shadow_disagree for g in self.models.values())

    # -- model checks -------------------------------------------------------------------------
    def _only(self) -> Any:
        # A request without "model" is unambiguous only when one model is served.
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        return None

    def refusal(self, model: str | None) -> RouterError | None:
        """The error for a request naming ``model`` (None: no "model" field), or None when a
        group serves it.  Unknown model: smg's 404 ``model_not_found`` (an OpenAI client does
        not retry a 404, while it retries a 503 twice), listing the models served."""
        if model is None:
            if self._only() is not None or not self.models:
                return None  # no models yet: the usual "no available workers" answers
            return RouterError(
                400,
                CODE_BAD_REQUEST,
                "'model' is required: this router serves several models (" + ", ".join(sorted(self.models)) + ")",
            )
        if model in self.by_name:
            return None
        return RouterError(
            404,
            CODE_MODEL_NOT_FOUND,
            f"No worker available for model '{model}'. Available models: " + ", ".join(sorted(self.models)),
        )


def group_like(router: Any, template: Any, kv_reserve: int = 0) -> Any:
    """An empty group configured like ``template`` (a role's group), for one model."""
    return router.group(
        [],
        template.policy,
        load_metric=template.load_metric,
        demand=template.demand,
        request_weight=template.request_weight,
        names=[],
        kv_fit=template.kv_fit,
        kv_reserve=kv_reserve,
        rank_slack=template.rank_slack,
        tokens_until_answer=template.tokens_until_answer,
        kv_index=template.kv_index,
    )
