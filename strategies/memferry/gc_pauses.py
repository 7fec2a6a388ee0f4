"""Python's full garbage collections kept out of training steps: what an engine's setup made
alive is frozen (``gc.freeze``), so a full collection walks only what the steps themselves made.

A full (generation 2) collection walks every object the collector tracks and holds the GIL
throughout: the training thread launches nothing, and the host optimizer's worker cannot take
its next piece, so the step it lands in runs that much longer. With torch and transformers
imported and a 128-block engine built there are about 380 thousand such objects, 133-141 ms a
pass on one core here; Python starts one whenever the objects that outlived younger collections
since the last reach a quarter of the long-lived ones, which the tensors and autograd nodes a
step keeps across a young collection do every 5-7 steps at 128 blocks
(``bench/results/2026-12-06-cpu-session45/gc_pauses.txt``). On the H100, steps 3 and 8 of
128-layer runs ran up to 23 % over the median of the others, 37 % at 64 layers, and so did a
rehearsal's third step, whose host work calibrates the plan (``bench/results/2026-12-06-h100-session45/``).

Not by default on the cpu backend's virtual devices (``MemFerry(freeze_setup=None)``): their
steps are not timed, and each freeze costs a full collection (170 ms each in the test suite's
process, which builds engines by the thousand).

Frozen objects stay alive until every engine that froze them is closed (:func:`release`), or
the process exits: the process's cyclic garbage made before then is freed only after (the setup
collects first, so none of what profiling or an earlier plan left; a plan built again releases
its engine's hold before its old parts are collected, which frees them where no other engine
holds one). What steps allocate is collected as before.
"""
from __future__ import annotations

import atexit
import gc

__all__ = ["hold", "release", "release_all", "holders"]

# The engines (by id) whose setup is frozen; the collector thaws when the last is released.
_holders: set[int] = set()


def hold(owner: object) -> None:
    """Collect once, then freeze every object alive now (``owner``'s parts among them), for
    ``owner``; again for an owner that made new parts (a plan built again adds them)."""
    gc.collect()  # garbage frozen would never be freed: what profiling or an earlier plan left
    gc.freeze()
    if not _holders:  # thawed at exit too: frozen objects outlive the interpreter's last collection,
        atexit.register(_thaw)  # which extension modules then report as leaks
    _holders.add(id(owner))


def release(owner: object) -> None:
    """``owner`` no longer holds the freeze; with no other holder, every frozen object goes back
    to the oldest generation (collected as usual from then on), those a process froze itself
    before the engine too (what the engine froze is not told apart). A no-op for a non-holder."""
    if id(owner) not in _holders:
        return
    _holders.discard(id(owner))
    if not _holders:
        _thaw()


def _thaw() -> None:
    """Every frozen object back to the oldest generation; the exit hook unregistered."""
    atexit.unregister(_thaw)
    gc.unfreeze()


def release_all() -> None:
    """Every hold dropped and the collector thawed: for a process (a notebook, a test session)
    that let engines go without closing them."""
    _holders.clear()
    _thaw()


def holders() -> int:
    """How many engines hold the freeze now."""
    return len(_holders)
