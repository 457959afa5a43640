"""agent/gcpause.py: what a pass made ends in the oldest generation, nothing stays frozen away
from the collector, and cyclic garbage made in a pause is still collected."""

from __future__ import annotations

import gc
import weakref

from agent.gcpause import paused


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic collector frees it


def test_what_a_pause_made_is_in_the_oldest_generation_and_the_collector_is_on_again():
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0  # none left in the permanent generation
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(o) in oldest for o in made)


def test_a_pause_inside_a_collector_already_off_leaves_it_off():
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_cyclic_garbage_made_in_a_pause_is_collected_by_the_next_full_collection():
    with paused():
        node = Node()
        gone = weakref.ref(node)
        del node
    assert gone() is not None  # a cycle: the pause kept the collector from it
    gc.collect()
    assert gone() is None
