"""Python's cyclic garbage collector paused while a burst of objects is made to live on.

A pass that makes objects by the ten thousand and frees few (the start: modules, classes, the
parts; a journal replayed; a reconciliation) makes the collector walk the growing heap again
and again to find no cycle (a third of a replay's time at 10,000 records), and then walk all of
it once more at its first collection after the pass, in whichever thread allocates then (an
Allocate, say). `paused()` turns the collector off for such a pass; `resume()` turns it back
on with every object moved to the oldest generation (gc.freeze then gc.unfreeze: two list
splices, no walk), where only a full collection looks at it again. Nothing is kept from the
collector: garbage among those objects goes at the next full collection.

Owns: those two. Must not import anything of `agent`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def resume() -> None:
    """The collector on, with no young generation left to walk (see the module docstring)."""
    gc.freeze()  # every tracked object to the permanent generation ...
    gc.unfreeze()  # ... and from there into the oldest one
    gc.enable()


@contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block; on again after it (`resume`) if it was on before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            resume()
