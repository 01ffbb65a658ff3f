"""The policy registry (every built-in registered here), policies bound for a call, and composition helpers.

A `Policy` is a score function (`vdjax.engine.scores`, higher = keep) with its keyword defaults; `bind`
resolves it once per call into a hashable `BoundPolicy` that the jit programs take as a static argument. New
policies are one function and one `register` line away:

    vdjax.register(vdjax.Policy("mine", lambda k, v, attn, pos, **_: -pos.astype(jnp.float32)))

What a score reads is one typed context, `scores.AttnInfo`: the block's attention probabilities over the
candidates, the accumulated attention (`accumulates=True`), the layer index and weights (`attn.weights`), the
layer's RoPE frequencies, with `queries=True` the block's pre-RoPE queries, with `query_stats=True` their
running statistics, which the cache carries from block to block and step to step; a per-token feature computed
once when a token enters (`token_feature`) is carried per slot and read as `attn.feature`.

kvpress 0.5.5's presses in true block mode (kvpress runs each once after a full prefill; with
`block_size >= T` and a batch of one these keep kvpress's positions, tests/test_vs_kvpress.py). At a block
boundary a score sees the N cache slots plus the block; a decode step is a block of one token:
- `expected_attention`: the statistics of every query so far but the first `n_sink` (`stats="all"`) or of the
  block's (`"block"`; a decode step always uses every query so far), the RoPE averaged over the
  `n_future_positions` positions after the newest token; the softmax runs over the non-sink candidates.
- `lagkv`: partitions of absolute positions after the sinks, the prompt so far (decoded tokens included) as
  its length: a complete partition with a complete successor is scored against it, the newest complete one and
  the incomplete rest are kept as sinks are; a partition's members are those still cached.
- `cur`: 16-position windows of absolute positions over the candidates still cached.
- `leverage`: the candidates' pre-RoPE keys (the cache unrotated), centred over the head's candidates, one
  Gaussian sketch per layer and KV head from `seed`, z-scored over the row.
- `compactor`: leverage over the unprotected candidates (as `leverage`) plus the tile attention each token
  received when it entered: non-causal attention inside `chunk_size` tiles of its own block (computed once,
  carried per slot; a decoded token's tile is itself), times ||v||, pooled and z-scored; the first
  `sink_size_start` positions and the newest `sink_size_end` tokens protected; blending 1 - N / (tokens so
  far).
- `kvzip`: the most attention a token received from its block's replay (`replay`: the repeat prompt and the
  block again, run beside the block through every layer over the cache, the block and itself), computed once
  and carried per slot; a decoded token replays after the first prompt. kvpress's `layerwise=True` is
  `adakv:kvzip` with `alpha_safeguard=0`; its default (one top-k over every layer) needs a cross-layer pool:
  not offered (each layer's slots are fixed).
- `qfilter`: filters fitted by `vdjax analyze --qfilters`; `random`: a new draw per layer, row and step.

Budget wrappers (`wrapper:base` names, or `adakv(base)` etc.), composable with every policy and with
`protect_sinks` (`adakv:valuediff+sinks4`); `combine` refuses parts that set budgets (wrap the combination):
- `pyramidkv:base` / `pyramidkv`: per-layer budgets by PyramidKV's rule with T = the prompt length (the
  longest row of a batch, as kvpress's padded batch); fixed after the prefill. Memory: the layers' slots sum
  to L * N up to rounding. `budget` may also be a sequence, one per attention layer. Without the layer scan
  when budgets differ by layer (a scan step needs one cache size).
- `adakv:base`, `criticaladakv:base`: a layer's K KV heads share one pool of K * N slots (k, v [B, 1, K*N, D]
  and a head index per slot, `cache.LayerCache`); attention and scores read a per-head view of the pool (each
  head its own slots), and at every block and step the layer keeps its best K * N candidates across heads
  (`adaptive`). Memory: the uniform cache's plus one int32 per slot; attention reads K * N slots per head.
- `criticalkv:base`: a score wrapper (uniform slots); ||W_o v||_1 is computed once per token and carried.
- `chunkkv:base`: whole chunks of absolute positions by the base score summed over heads; the cache is filled
  to N, the last chunk cut to its earliest positions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from vdjax.checks import check_int
from vdjax.engine.adaptive import check_fraction, chunk_scores, critical_scores, pyramid_budgets, wo_l1_norm
from vdjax.engine.mixes import bind_mix, calibrated, hybrid
from vdjax.engine.qfilters import bind_qfilters, has_qfilters, qfilter
from vdjax.engine.replay import bind_kvzip, replay_feature
from vdjax.engine.scores import (
    INF,
    AttnInfo,
    bind_snapkv,
    compactor,
    compactor_tiles,
    cur,
    expected_attention,
    fastcaote,
    h2o,
    keydiff,
    keynorm,
    kvzip,
    lagkv,
    leverage,
    manifoldkv,
    random_scores,
    recent_mask,
    snapkv,
    snapkv_kvpress,
    standardize,
    streaming,
    tova,
    valid_mask,
    valuediff,
    valuediff_dir,
    valuediff_norm,
)

__all__ = ["AttnInfo", "BoundPolicy", "POLICIES", "Policy", "adakv", "bind", "chunkkv", "combine",
           "criticaladakv", "criticalkv", "default_policies", "get_policy", "protect_recent", "protect_sinks",
           "pyramidkv", "register", "standardize"]


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
    heads: str | None = None  # head-adaptive rule ("adakv", "criticaladakv"): the K heads share K * N slots
    # reads the block's pre-RoPE queries (`AttnInfo.queries`)
    queries: bool = False
    # reads the running statistics of every query so far (`AttnInfo.stats`, implies `queries`), which the
    # cache carries from block to block and step to step (queries at positions < its `n_sink` keyword left
    # out)
    query_stats: bool = False
    # (v_new [B, K, S, D], the layer's weights, *, k=k_new post-RoPE, q_pos [B, S], rope=(pre-RoPE queries or
    # None, inv_freq, scale, RoPE table or None), hyper=dict) -> [B, K, S] fp32: a per-token feature computed
    # once when a token enters, carried per slot and given to the score as `AttnInfo.feature` (CriticalKV's
    # ||W_o v||_1, Compactor's tile attention)
    token_feature: Callable[..., jax.Array] | None = None
    # (num_layers, n, t, hyper dict) -> per-layer budgets for a prompt of t tokens (PyramidKV); None: uniform
    layers: Callable[..., tuple[int, ...]] | None = None
    # the programs run KVzip's replay stream beside every block and step (`replay`) and hand its scores to
    # the policy as the new tokens' feature (its `token_feature` is then `replay_feature`)
    replay: bool = False
    # reads `AttnInfo.rope_table` (cos and sin of every position, for `unrotate`): the programs build it once
    # per prefill and decode instead of the score evaluating them per call
    rope_table: bool = False

    def calibrated(self, folder) -> bool:
        """Whether the model in `folder` has what this policy needs to run with its defaults."""
        return self.calibration is None or bool(self.calibration(folder))

    def bind_hyper(self, params, hyper: tuple, budget: int | None = None) -> tuple:
        """hyper with model- and budget-dependent keywords resolved for `params` at `budget` (e.g. hybrid's
        saved mix for that budget; unchanged for most policies)."""
        return hyper if self.bind is None else self.bind(params, hyper, budget)

    @property
    def reads_queries(self) -> bool:
        """Whether the programs hand the score the block's pre-RoPE queries (`queries` or `query_stats`)."""
        return self.queries or self.query_stats

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
    budget: int | tuple[int, ...] | None  # slots per head asked for (one per attention layer when a
    # sequence); None for dense (it keeps everything)
    # per-head budget of every layer (0 on a layer without a KV cache) when they differ by layer: the budget
    # sequence, or the policy's layer rule applied to the prompt length (`for_length`); None: uniform
    layer_budgets: tuple[int, ...] | None = None
    # the cache's storage: None (the compute dtype) or (bits, group, key layout, value layout) of
    # `quant.QuantTensor` keys and values (`inputs.kv_storage`)
    quant: tuple[int, int, str, str] | None = None

    def for_length(self, cfg, t: int) -> BoundPolicy:
        """Bound with the per-layer budgets of a prompt of t tokens filled in: the policy's layer rule (e.g.
        PyramidKV's) at the mean budget; unchanged for a uniform policy or a budget sequence."""
        if self.policy.layers is None or self.budget is None:
            return self
        if not isinstance(self.budget, int):
            raise ValueError(f"policy {self.name!r} sets its own layer budgets; give budget=N (an int), got "
                             f"{list(self.budget)}")
        per = self.policy.layers(cfg.num_layers, self.budget, t, dict(self.hyper))
        return dataclasses.replace(self, layer_budgets=tuple(n if cfg.attends(i) else 0
                                                             for i, n in enumerate(per)))

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
    layer_budgets = None
    if pol.is_dense:
        budget = None
    elif budget is None:
        raise ValueError(f"policy {pol.name!r} needs budget=N (cache slots per head); only 'dense' does not")
    elif isinstance(budget, (list, tuple)) or (hasattr(budget, "ndim") and budget.ndim == 1):
        budget, layer_budgets = _layer_sequence(params.config, budget)
    else:
        budget = check_int("budget", budget)
    hyper = pol.bind_hyper(params, pol.hyper(**policy_kwargs), _mean(budget))
    for name, value in hyper:  # a wrapper's keywords given at the call are checked as the wrapper checks them
        if name in WRAPPER_KEYWORDS:
            WRAPPER_KEYWORDS[name](name, value)
    return BoundPolicy(pol, hyper, budget, layer_budgets)


def _mean(budget):
    """The mean of a budget sequence (what a budget-dependent keyword, e.g. hybrid's mix, is looked up at)."""
    return budget if budget is None or isinstance(budget, int) else round(sum(budget) / len(budget))


def _layer_sequence(cfg, budget) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A per-layer budget sequence checked: one integer >= 1 per attention layer -> (the sequence, the budget
    of every layer with 0 on a layer without a KV cache)."""
    attending = [i for i in range(cfg.num_layers) if cfg.attends(i)]
    values = list(budget)
    if len(values) != len(attending):
        raise ValueError(f"budget has {len(values)} entries; a per-layer budget needs one per attention "
                         f"layer ({len(attending)} in this model)")
    values = [check_int(f"budget[{j}]", int(b) if hasattr(b, "item") else b) for j, b in enumerate(values)]
    per = dict(zip(attending, values, strict=True))
    return tuple(values), tuple(per.get(i, 0) for i in range(cfg.num_layers))


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


def _pyramid_rule(num_layers: int, n: int, t: int, hyper: dict) -> tuple[int, ...]:
    """PyramidKV's layer budgets (`adaptive.pyramid_budgets`) from a policy's `beta` and `window_size`."""
    return pyramid_budgets(num_layers, n, t, hyper["beta"], check_int("window_size", hyper["window_size"]))


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
    Policy("pyramidkv", snapkv_kvpress, (("beta", 20), ("kernel", 5), ("window_size", 64)),
           layers=_pyramid_rule),
    Policy("expected_attention", expected_attention,
           (("epsilon", 0.0), ("n_future_positions", 512), ("n_sink", 4), ("stats", "all"),
            ("use_covariance", True), ("use_vnorm", True)), queries=True, query_stats=True),
    Policy("random", random_scores, (("seed", 0),)),
    Policy("qfilter", qfilter, (("filters", None),), bind=bind_qfilters, calibration=has_qfilters),
    Policy("compactor", compactor, (("blending", None), ("chunk_size", 256), ("ridge", 1e-2), ("seed", 0),
                                    ("sink_size_end", 4), ("sink_size_start", 8), ("sketch_dimension", 48)),
           queries=True, token_feature=compactor_tiles, rope_table=True),
    Policy("kvzip", kvzip, (("chunk_size", 2048), ("continue_ids", None), ("kvzip_plus_normalization", False),
                            ("n_sink", 4), ("repeat_ids", None), ("suffix_ids", None)),
           bind=bind_kvzip, token_feature=replay_feature, replay=True),
    Policy("leverage", leverage, (("ridge", 1e-2), ("seed", 0), ("sketch_dimension", 48)), rope_table=True),
    Policy("lagkv", lagkv, (("cross_scoring", False), ("lag_size", 128), ("n_sink", 4))),
    Policy("cur", cur, (("leverage_type", "kv_product"), ("local_window_size", 16), ("num_sinks", 4),
                        ("seed", 0), ("use_random_leverage", False))),
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
        return jnp.where((pos >= 0) & (pos < self.n), INF, self.base.score(k, v, attn, pos, **kw))


@dataclasses.dataclass(frozen=True)
class _ProtectRecent:
    base: Policy
    n: int

    def __call__(self, k, v, attn, pos, **kw):
        return jnp.where(recent_mask(pos, attn, self.n), INF, self.base.score(k, v, attn, pos, **kw))


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
    adaptive = [p.name for p, _ in parts if p.heads is not None or p.layers is not None]
    if adaptive:
        raise ValueError(f"combine mixes scores; {adaptive} set budgets: wrap the combination instead "
                         "(e.g. vdjax.adakv(vdjax.combine(...)))")
    defaults = tuple(sorted({kv for p, _ in parts for kv in p.defaults}))
    features = {p.token_feature for p, _ in parts if p.token_feature is not None}
    if len(features) > 1 and features != {output_norm}:
        carriers = sorted(p.name for p, _ in parts if p.token_feature is not None)
        raise ValueError(f"combine: the parts {carriers} carry different per-token features; a cache carries "
                         "one (for CriticalKV wrap the combination: vdjax.criticalkv(vdjax.combine(...)))")
    return Policy(
        name or "+".join(f"{w:g}*{p.name}" for p, w in parts),
        _Combined(parts),
        defaults,
        accumulates=any(p.accumulates for p, _ in parts),
        queries=any(p.queries for p, _ in parts),  # a part reading queries gets them
        query_stats=any(p.query_stats for p, _ in parts),
        replay=any(p.replay for p, _ in parts),
        rope_table=any(p.rope_table for p, _ in parts),
        token_feature=features.pop() if len(features) == 1 else None,  # else each part computes its own
    )


# ---- adaptive budgets: wrappers around any evicting policy ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Base:
    """The wrapped policy's score, called with its own keywords only (the wrapper's are not its business)."""

    base: Policy

    def __call__(self, k, v, attn, pos, *, slots, **kw):
        own = {name: kw[name] for name, _ in self.base.defaults if name in kw}
        return self.base.score(k, v, attn, pos, slots=slots, **own)


@dataclasses.dataclass(frozen=True)
class _Critical(_Base):
    """CriticalKV around the base's score (`adaptive.critical_scores`); W_o from `attn.weights`. `carried`:
    ||W_o v||_1 is the carried per-token feature (False when the base carries its own: recomputed)."""

    carried: bool = True

    def __call__(self, k, v, attn, pos, *, slots, **kw):
        carried = self.carried and attn.feature is not None
        if not carried and (attn.weights is None or "wo" not in attn.weights):
            raise ValueError("criticalkv needs the layer's output projection: call it with AttnInfo(weights="
                             "{'wo': [Nq, D, H]}) (the engine passes every layer's weights)")
        scores = super().__call__(k, v, attn, pos, slots=slots, **kw)
        vnorm = attn.feature if carried else wo_l1_norm(v, attn.weights["wo"])
        return critical_scores(scores, pos, slots, vnorm, kw["critical_epsilon"], kw["first_stage_ratio"])


@dataclasses.dataclass(frozen=True)
class _Chunked(_Base):
    """ChunkKV around the base's score (`adaptive.chunk_scores`)."""

    def __call__(self, k, v, attn, pos, *, slots, **kw):
        return chunk_scores(super().__call__(k, v, attn, pos, slots=slots, **kw), pos, kw["chunk_length"])


def _wrap(kind: str, policy: Policy | str, keywords: dict, score=_Base, **fields) -> Policy:
    """A wrapper `kind` around an evicting policy, its keywords added to the base's (refused on a clash)."""
    base = _evicting(policy, kind)
    feature = fields.get("token_feature")
    if feature is not None and base.token_feature not in (None, feature):
        raise ValueError(f"{kind} cannot wrap {base.name!r}: both carry a per-token feature (a cache "
                         "carries one)")
    clash = sorted(set(keywords) & {name for name, _ in base.defaults})
    if clash:
        raise ValueError(f"{kind} cannot wrap {base.name!r}: both have the keyword(s) {clash} "
                         "(already wrapped?)")
    return dataclasses.replace(base, name=f"{kind}:{base.name}", score=score(base),
                               defaults=tuple(sorted(base.defaults + tuple(keywords.items()))), **fields)


def _check_heads(kind: str, base: Policy) -> None:
    if base.heads is not None:
        raise ValueError(f"{kind} cannot wrap {base.name!r}: it already shares its heads' slots "
                         f"({base.heads})")


def output_norm(v, weights, **_) -> jax.Array:
    """CriticalKV's per-token feature: ||W_o v||_1 averaged over the GQA group (v [B, K, S, D] -> [B, K, S]),
    computed once when a token enters the cache."""
    return wo_l1_norm(v, weights["wo"])


def adakv(policy: Policy | str, alpha_safeguard: float = 0.2, standardize: bool = False) -> Policy:
    """Head-adaptive budgets (AdaKV): at every eviction a layer keeps its best K * N candidates across its K
    KV heads, each head first keeping its own top max(1, floor(alpha_safeguard * N)); the heads share one pool
    of K * N slots, so the memory is the uniform cache's. Scores of different heads are compared as they are
    (kvpress); `standardize=True` z-scores each head's first, for a scorer whose scale differs by head."""
    base = _evicting(policy, "adakv")
    _check_heads("adakv", base)
    kw = {"alpha_safeguard": check_fraction("alpha_safeguard", alpha_safeguard),
          "standardize": _check_bool("standardize", standardize)}
    return _wrap("adakv", base, kw, heads="adakv")


def criticalkv(policy: Policy | str, epsilon: float = 1e-4, first_stage_ratio: float = 0.5) -> Policy:
    """CriticalKV: the base's top `first_stage_ratio * N` candidates kept outright, the rest ranked by
    (score + epsilon) * ||W_o v||_1 (mean over the GQA group). The memory is the base's. `epsilon` is the
    policy keyword `critical_epsilon` (a base such as expected_attention has an `epsilon` of its own)."""
    kw = {"critical_epsilon": check_fraction("epsilon", epsilon, 0.0, math.inf),
          "first_stage_ratio": check_fraction("first_stage_ratio", first_stage_ratio)}
    base = _evicting(policy, "criticalkv")
    if base.token_feature is not None:  # the base carries its own feature: ||W_o v||_1 recomputed per score
        return _wrap("criticalkv", base, kw, score=functools.partial(_Critical, carried=False))
    return _wrap("criticalkv", base, kw, score=_Critical, token_feature=output_norm)


def criticaladakv(policy: Policy | str, alpha_safeguard: float = 0.2, epsilon: float = 1e-4,
                  first_stage_ratio: float = 0.5, standardize: bool = False) -> Policy:
    """CriticalAdaKV: head budgets by the AdaKV rule from the base's scores, then CriticalKV's two stages
    inside each head's budget (kvpress's `CriticalAdaKVPress`, each row on its own); K * N pooled slots.
    `epsilon` is the policy keyword `critical_epsilon`, as for `criticalkv`; `standardize` as for `adakv`."""
    base = _evicting(policy, "criticaladakv")
    _check_heads("criticaladakv", base)
    kw = {"alpha_safeguard": check_fraction("alpha_safeguard", alpha_safeguard),
          "critical_epsilon": check_fraction("epsilon", epsilon, 0.0, math.inf),
          "first_stage_ratio": check_fraction("first_stage_ratio", first_stage_ratio),
          "standardize": _check_bool("standardize", standardize)}
    if base.token_feature is not None:  # the base carries its own feature: ||W_o v||_1 recomputed per block
        return _wrap("criticaladakv", base, kw, heads="criticaladakv")
    return _wrap("criticaladakv", base, kw, heads="criticaladakv", token_feature=output_norm)


def pyramidkv(policy: Policy | str, beta: float = 20, window_size: int = 64) -> Policy:
    """PyramidKV's layer budgets around any policy: per-layer budgets falling linearly from the first layer
    to the last (`adaptive.pyramid_budgets`, the prompt length as T), summing to L * N up to rounding. The
    registered `pyramidkv` is kvpress's PyramidKVPress itself (SnapKV scores, kvpress's pooling)."""
    base = _evicting(policy, "pyramidkv")
    if base.layers is not None:
        raise ValueError(f"pyramidkv cannot wrap {base.name!r}: it already sets its layer budgets")
    kw = {"beta": _at_least_one("beta", beta), "window_size": check_int("window_size", window_size)}
    return _wrap("pyramidkv", base, kw, layers=_pyramid_rule)


def chunkkv(policy: Policy | str, chunk_length: int = 20) -> Policy:
    """ChunkKV: whole chunks of `chunk_length` positions kept by the base's score summed over the KV heads
    (mean over the chunk), so every head keeps the same chunks; the cache is filled to N, the last chunk cut
    to its earliest positions (kvpress keeps whole chunks only, fewer than N tokens, and applies row 0's
    choice to the batch; here each row decides on its own)."""
    return _wrap("chunkkv", policy, {"chunk_length": check_int("chunk_length", chunk_length)}, score=_Chunked)


def _check_bool(name: str, value) -> bool:
    """A bool, or a ValueError naming the keyword."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _at_least_one(name: str, value) -> float:
    """A number >= 1, or a ValueError naming the keyword."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ValueError(f"{name} must be a number >= 1, got {value!r}")
    return value


# the wrappers' keywords and their checks (at wrapping and again at `bind`, where a call may override them)
WRAPPER_KEYWORDS: dict[str, Callable[[str, Any], Any]] = {
    "alpha_safeguard": check_fraction,
    "first_stage_ratio": check_fraction,
    "critical_epsilon": lambda name, v: check_fraction(name, v, 0.0, math.inf),
    "chunk_length": check_int,
    "beta": _at_least_one,
    "window_size": check_int,
    "standardize": _check_bool,
}

WRAPPERS: dict[str, Callable[..., Policy]] = {"adakv": adakv, "chunkkv": chunkkv, "criticalkv": criticalkv,
                                              "criticaladakv": criticaladakv, "pyramidkv": pyramidkv}

_SUFFIX = re.compile(r"\+(sinks|recent)(\d+)$")
_WRAPPED = re.compile(r"^(" + "|".join(WRAPPERS) + r"):(.+)$")


def get_policy(policy: Policy | str) -> Policy:
    """A Policy object, or a registered name with optional `+sinksN` / `+recentN` suffixes."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name or a Policy, got {type(policy).__name__}: {policy!r}")
    w = _WRAPPED.match(policy)
    if w:
        return WRAPPERS[w.group(1)](get_policy(w.group(2)))
    m = _SUFFIX.search(policy)
    if m:
        base = get_policy(policy[: m.start()])
        return (protect_sinks if m.group(1) == "sinks" else protect_recent)(base, int(m.group(2)))
    if policy not in POLICIES:
        raise ValueError(
            f"unknown policy {policy!r}; registered: {sorted(POLICIES)} "
            "(suffix '+sinksN' or '+recentN' protects the first/last N positions; prefix 'adakv:', "
            "'criticalkv:', 'criticaladakv:', 'pyramidkv:' or 'chunkkv:' wraps a policy)"
        )
    return POLICIES[policy]
