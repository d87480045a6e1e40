"""Each engine owns its choices: several LLMs in one process do not see each other's steps."""
from __future__ import annotations

import threading

import torch

from tp_engine.base.batch import Batch, forward_context, get_context


def test_forward_context_belongs_to_the_thread_that_set_it():
    """Two engines running steps in two threads at once: each thread's layers read its own step, and none is
    left behind when the step ends."""
    z = torch.zeros(1, dtype=torch.long)
    batches = [Batch(False, z, z, z, [1], [1], [[0]], z) for _ in range(2)]
    inside, seen = threading.Barrier(2), [None, None]

    def step(i: int) -> None:
        with forward_context(batches[i], None, None):
            inside.wait(timeout=10)  # both threads are inside a step now
            seen[i] = get_context().batch
            inside.wait(timeout=10)

    threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0] is batches[0] and seen[1] is batches[1]
    assert get_context() is None
