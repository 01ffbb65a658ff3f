"""The policy registry (every built-in registered here), policies bound for a call, and composition helpers.

A `Policy` is a score function (`vdjax.engine.scores`, higher = keep) with its keyword defaults; `bind`
resolves it once per call into a hashable `BoundPolicy` that the jit programs take as a static argument. New
policies are one function and one `register` line away:

    vdjax.register(vdjax.Policy("mine", lambda k, v, attn, pos, **_: -pos.astype(jnp.float32)))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from vdjax.checks import check_int
from vdjax.engine.mixes import bind_mix, calibrated, hybrid
from vdjax.engine.scores import (
    _INF,
    AttnInfo,
    _recent,
    bind_snapkv,
    fastcaote,
    h2o,
    keydiff,
    keynorm,
    manifoldkv,
    snapkv,
    standardize,
    streaming,
    tova,
    valid_mask,
    valuediff,
    valuediff_dir,
    valuediff_norm,
)

__all__ = ["AttnInfo", "BoundPolicy", "POLICIES", "Policy", "bind", "combine", "default_policies",
           "get_policy", "protect_recent", "protect_sinks", "register", "standardize"]


# ---- registry -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Policy:
    """A named eviction policy: a score function, its keyword defaults, and what the pipeline must provide."""

    name: str
    score: Callable[..., jax.Array] | None  # None = dense (no eviction)
    defaults: tuple[tuple[str, Any], ...] = ()
    accumulates: bool = False  # reads attn.acc (accumulated attention carried in the cache)
    bind: Callable[..., tuple] | None = None  # (params, hyper, budget) -> hyper: model-dependent keywords
    # (checkpoint folder) -> whether the model has the calibration data the policy needs by default
    # (e.g. hybrid's fitted weights); None: the policy needs none
    calibration: Callable[[Any], bool] | None = None

    def calibrated(self, folder) -> bool:
        """Whether the model in `folder` has what this policy needs to run with its defaults."""
        return self.calibration is None or bool(self.calibration(folder))

    def bind_hyper(self, params, hyper: tuple, budget: int | None = None) -> tuple:
        """hyper with model- and budget-dependent keywords resolved for `params` at `budget` (e.g. hybrid's
        saved mix for that budget; unchanged for most policies)."""
        return hyper if self.bind is None else self.bind(params, hyper, budget)

    @property
    def is_dense(self) -> bool:
        """True for the no-eviction baseline."""
        return self.score is None

    def hyper(self, **overrides) -> tuple[tuple[str, Any], ...]:
        """Defaults updated with `overrides` (unknown names raise a TypeError naming the allowed ones)."""
        allowed = dict(self.defaults)
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise TypeError(f"policy {self.name!r} got unknown keyword(s) {unknown}; it accepts "
                            f"{sorted(allowed) or 'none'}")
        allowed.update(overrides)
        return tuple(sorted(allowed.items()))

    def __call__(self, k, v, attn, pos, *, slots: int, **hyper) -> jax.Array:
        """Score the candidates (see the module docstring)."""
        return self.score(k, v, attn, pos, slots=slots, **{**dict(self.defaults), **hyper})


@dataclasses.dataclass(frozen=True)
class BoundPolicy:
    """A policy bound once, after validation, for one call: its keywords resolved for the model and the budget
    asked for. Hashable: the jit programs take it as one static argument."""

    policy: Policy
    hyper: tuple[tuple[str, Any], ...]
    budget: int | None  # cache slots per head asked for; None for dense (it keeps everything)

    @property
    def name(self) -> str:
        """The policy's name."""
        return self.policy.name

    @property
    def is_dense(self) -> bool:
        """True for the no-eviction baseline (the programs take its causal path)."""
        return self.policy.is_dense

    @property
    def accumulates(self) -> bool:
        """Whether its score reads attention accumulated over every query so far (carried in the cache)."""
        return self.policy.accumulates

    def score(self, k, v, attn, pos, *, slots: int) -> jax.Array:
        """Scores [B, K, C] of one layer's candidates (see `vdjax.engine.scores`)."""
        return self.policy(k, v, attn, pos, slots=slots, **dict(self.hyper))


def bind(policy: Policy | str, params, budget: int | None = None, **policy_kwargs) -> BoundPolicy:
    """Resolve a policy (or name) for a call: the budget checked first (an evicting policy needs an integer
    >= 1; dense ignores it), then its keywords (unknown ones refused) and the model- and budget-dependent ones
    (e.g. hybrid's saved mix for that budget)."""
    pol = get_policy(policy)
    if pol.is_dense:
        budget = None
    elif budget is None:
        raise ValueError(f"policy {pol.name!r} needs budget=N (cache slots per head); only 'dense' does not")
    else:
        budget = check_int("budget", budget)
    return BoundPolicy(pol, pol.bind_hyper(params, pol.hyper(**policy_kwargs), budget), budget)


POLICIES: dict[str, Policy] = {}


BUILTIN: set[str] = set()  # vdjax's own policies: `register` replaces them only when asked


def register(policy: Policy, *, replace: bool = False) -> Policy:
    """Add a policy to the registry under its name (new policies are one function away). A built-in policy's
    name is refused unless `replace=True`; a policy of your own is replaced by registering it again."""
    if not isinstance(policy, Policy):
        raise TypeError(f"register takes a vdjax Policy, got {type(policy).__name__}: {policy!r}")
    if policy.name in BUILTIN and not replace:
        raise ValueError(f"policy {policy.name!r} is built in; pass replace=True to replace it, or choose "
                         "another name")
    POLICIES[policy.name] = policy
    return policy


for _p in (
    Policy("dense", None),
    Policy("valuediff", valuediff),
    Policy("valuediff_dir", valuediff_dir),
    Policy("valuediff_norm", valuediff_norm),
    Policy("keydiff", keydiff),
    Policy("keynorm", keynorm),
    Policy("manifoldkv", manifoldkv),
    Policy("streaming", streaming, (("n_sink", 4),)),
    Policy("tova", tova, (("per_kv_head", False),)),
    Policy("snapkv", snapkv, (("kernel", None), ("pooling", "max"), ("window", 32)),
           bind=bind_snapkv),
    Policy("h2o", h2o, (("n_recent", None),), accumulates=True),
    Policy("fastcaote", fastcaote),
    Policy("hybrid", hybrid, (("mix", None),), bind=bind_mix, calibration=calibrated),
):
    register(_p)
    BUILTIN.add(_p.name)


def default_policies(model=None) -> list[str]:
    """Every registered policy (dense first) that the model can run with its defaults: those that need
    calibration data (hybrid's saved weights) only when `model` (Params or a checkpoint folder) has it."""
    folder = getattr(model, "source", model)
    return [name for name,
            p in POLICIES.items() if p.calibration is None or (folder and p.calibrated(folder))]


# ---- composition ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ProtectSinks:
    base: Policy
    n: int

    def __call__(self, k, v, attn, pos, **kw):
        return jnp.where((pos >= 0) & (pos < self.n), _INF, self.base.score(k, v, attn, pos, **kw))


@dataclasses.dataclass(frozen=True)
class _ProtectRecent:
    base: Policy
    n: int

    def __call__(self, k, v, attn, pos, **kw):
        return jnp.where(_recent(pos, attn, self.n), _INF, self.base.score(k, v, attn, pos, **kw))


@dataclasses.dataclass(frozen=True)
class _Combined:
    parts: tuple[tuple[Policy, float], ...]

    def __call__(self, k, v, attn, pos, **kw):
        valid = valid_mask(pos)
        total = 0.0
        for policy, weight in self.parts:
            own = {name: kw[name] for name, _ in policy.defaults if name in kw}
            total = total + weight * standardize(policy(k, v, attn, pos, slots=kw["slots"], **own), valid)
        return total


def _evicting(policy: Policy | str, helper: str) -> Policy:
    """The policy, refusing dense (which evicts nothing and has no score to protect)."""
    base = get_policy(policy)
    if base.is_dense:
        raise ValueError(f"{helper} needs an evicting policy, got {base.name!r} (dense keeps everything)")
    return base


def protect_sinks(policy: Policy | str, n: int = 4) -> Policy:
    """`policy` with the first `n` positions always kept."""
    base = _evicting(policy, "protect_sinks")
    return dataclasses.replace(base, name=f"{base.name}+sinks{n}", score=_ProtectSinks(base, n))


def protect_recent(policy: Policy | str, n: int) -> Policy:
    """`policy` with the `n` most recent positions always kept."""
    base = _evicting(policy, "protect_recent")
    return dataclasses.replace(base, name=f"{base.name}+recent{n}", score=_ProtectRecent(base, n))


def combine(weights: Mapping[Policy | str, float], name: str | None = None) -> Policy:
    """Weighted sum of per-head standardised scores of several policies (protected tokens stay protected)."""
    parts = tuple((get_policy(p), float(w)) for p, w in weights.items())
    if not parts or any(p.is_dense for p, _ in parts):
        raise ValueError(f"combine needs one or more non-dense policies, got {list(weights)}")
    defaults = tuple(sorted({kv for p, _ in parts for kv in p.defaults}))
    return Policy(
        name or "+".join(f"{w:g}*{p.name}" for p, w in parts),
        _Combined(parts),
        defaults,
        accumulates=any(p.accumulates for p, _ in parts),
    )


_SUFFIX = re.compile(r"\+(sinks|recent)(\d+)$")


def get_policy(policy: Policy | str) -> Policy:
    """A Policy object, or a registered name with optional `+sinksN` / `+recentN` suffixes."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name or a Policy, got {type(policy).__name__}: {policy!r}")
    m = _SUFFIX.search(policy)
    if m:
        base = get_policy(policy[: m.start()])
        return (protect_sinks if m.group(1) == "sinks" else protect_recent)(base, int(m.group(2)))
    if policy not in POLICIES:
        raise ValueError(
            f"unknown policy {policy!r}; registered: {sorted(POLICIES)} "
            "(suffix '+sinksN' or '+recentN' protects the first/last N positions)"
        )
    return POLICIES[policy]
