"""The CLI's argument types and shared checks: each bad value a `UsageError` naming the argument."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from vdjax.loading import compile_cache


class UsageError(Exception):
    """A bad command-line argument: reported on one line, exit code 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """The CLI's ArgumentParser: a bad argument raises UsageError (one line, exit 2) instead of exiting."""

    def error(self, message):
        raise UsageError(message, self.prog)


# ---- argument types ----------------------------------------------------------------------------------------
def int_at_least(minimum: int):
    """argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


POSITIVE = int_at_least(1)


def float_in(lo: float, hi: float, lo_open: bool = False):
    """argparse type: a float in [lo, hi] (or (lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or value > hi or value < lo or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {text!r}"
            )
        return value

    return parse


def policy_arg(text: str) -> tuple[str, object]:
    """argparse type: key=value, the value read as a Python literal (else kept as a string)."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"must look like key=value, got {text!r}")
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw


def mesh_shape(text: str) -> tuple[int, int]:
    """argparse type: device-mesh sizes DATAxMODEL, e.g. 2x4 (2-way batch split, 4-way head split)."""
    data, sep, model = text.lower().partition("x")
    try:
        sizes = (int(data), int(model)) if sep else (0, 0)
    except ValueError:
        sizes = (0, 0)
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must look like DATAxMODEL, sizes >= 1 (e.g. 2x4), got {text!r}")
    return sizes


def cli_mesh(shape):
    """The jax Mesh of --mesh DATAxMODEL (None without it), or a UsageError when the devices do not fit."""
    if shape is None:
        return None
    from vdjax.engine.sharding import make_mesh

    try:
        return make_mesh(*shape)
    except ValueError as e:
        raise UsageError(f"argument --mesh: {e}") from None


def check_policy(name: str, policy_args=(), argument: str = "--policy"):
    """The Policy for `name` with its keyword overrides checked, or a UsageError naming the allowed values."""
    from vdjax.engine.policies import get_policy

    try:
        policy = get_policy(name)
    except (ValueError, TypeError) as e:
        raise UsageError(f"argument {argument}: {e}") from None
    try:
        policy.hyper(**dict(policy_args))
    except TypeError as e:
        raise UsageError(f"argument --policy-arg: {e}") from None
    return policy


def resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """The HF checkpoint folder of --model (converting a registered name on first use, a Hub id from
    the HF cache or downloaded)."""
    from vdjax.loading import registry

    try:
        return registry.resolve(name_or_path, revision)
    except ValueError as e:
        raise UsageError(f"argument --model: {e}") from None


def results_model_name(model: str, folder: Path) -> str:
    """The results folder's model name: a registered name as is, a Hub id's
    repository name, else the folder's."""
    from vdjax.loading import registry

    if model in _registered_models():
        return model
    if registry.is_hub_id(model) and not Path(model).exists():
        return model.split("/")[-1]
    return Path(folder).resolve().name


def load_model(args):
    """(params, tokenizer) of --model / --revision / --dtype, the compile cache turned on."""
    folder = resolve_model(args.model, getattr(args, "revision", None))
    compile_cache()
    import vdjax

    return vdjax.load(folder, getattr(args, "dtype", None)), vdjax.load_tokenizer(folder)


def layer_scan_of(args, one_shot: bool) -> bool | None:
    """The layer_scan argument of --layer-scan: auto = scan for a one-shot command (each program runs once, so
    compiling dominates), else the backend's default (`vdjax.engine.inputs.default_layer_scan`)."""
    return {"on": True, "off": False}.get(args.layer_scan, True if one_shot else None)


# ---- eval --------------------------------------------------------------------------------------------------
def budget_list(text: str) -> list[int] | list[float]:
    """argparse type: comma-separated integers >= 1 (cache slots) or fractions in (0, 1), not mixed."""
    allowed = "integers >= 1 (cache slots) or fractions in (0, 1) (of the average dense generation length)"
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = int(item)
            ok = value >= 1
        except ValueError:
            try:
                value = float(item)
            except ValueError:
                value = float("nan")
            ok = 0 < value < 1  # false for nan and inf too
        if not ok:
            raise argparse.ArgumentTypeError(f"must be comma-separated {allowed}, got {item!r} in {text!r}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError(f"must list one or more {allowed}, got {text!r}")
    if len({type(v) for v in out}) > 1:
        raise argparse.ArgumentTypeError(
            f"mixes integers and fractions in {text!r}; give one kind: {allowed}")
    return out


def length_arg(text: str) -> int | str:
    """argparse type: an integer >= 1, or `model` (taken from the model's context length)."""
    if text == "model":
        return text
    return int_at_least(1)(text)


def name_list(text: str) -> list[str]:
    """argparse type: a non-empty comma-separated list of names."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of names, got {text!r}")
    return out


def _registered_models() -> list[str]:
    """Names of the registered models."""
    from vdjax.loading import registry

    return list(registry.REGISTRY)
