"""Compiling behind: a program compiles in a thread while the device still runs the one before it.

`run` hands its decode program to `BACKGROUND` before the prefill finishes; `BACKGROUND.join()` waits for
every thread it started, and `BACKGROUND.compiled` holds the signatures it has compiled.
"""

from __future__ import annotations

import threading

import jax
import numpy as np


class BackgroundCompiler:
    """Compiles jitted functions for given arguments in threads it keeps (see `submit`)."""

    def __init__(self):
        self.compiled: set = set()  # signatures compiled (a later call finds them in the jit cache)
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    @staticmethod
    def signature(fn, args: tuple, kwargs: dict) -> tuple:
        """What a compiled program depends on: fn, the args' tree, each array's shape, dtype and sharding, and
        the static arguments as they are."""
        def aval(a):  # an array's shape, type and placement; a static argument as it is (hashable)
            if isinstance(a, (jax.Array, np.ndarray)):
                return (a.shape, a.dtype, getattr(a, "sharding", None))
            return a

        leaves, tree = jax.tree.flatten(args)
        return (fn, tree, tuple(map(aval, leaves)), tuple(sorted((k, aval(v)) for k, v in kwargs.items())))

    def submit(self, fn, args: tuple, kwargs: dict) -> threading.Thread:
        """Trace, lower and compile the jitted `fn` for these arguments in a thread (returned, started); a
        later `fn(*args, **kwargs)` then finds it compiled. The arrays may still be computing: only their
        shapes, types and shardings are read. A signature compiled before starts an empty thread. A failure is
        left to the call itself, which compiles again and raises the same error there."""
        sig = self.signature(fn, args, kwargs)

        def work():
            try:
                fn.lower(*args, **kwargs).compile()
            except Exception:  # noqa: BLE001 -- the call itself compiles again and raises there
                return
            with self._lock:
                self.compiled.add(sig)

        thread = threading.Thread(target=None if sig in self.compiled else work,
                                  name=f"compile-{fn.__name__}",
                                  daemon=True)
        with self._lock:
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def join(self, timeout: float | None = None) -> None:
        """Wait for every thread started so far."""
        with self._lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout)


BACKGROUND = BackgroundCompiler()  # the compiler `run` uses
