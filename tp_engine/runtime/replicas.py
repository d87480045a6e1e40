"""One `generate` call of a data-parallel job, on each kind of rank: rank 0 runs its replica's engine and the
coordinator (runtime/coordinator.py); the other replicas' first ranks run theirs on what they ask rank 0 for
(`LeaderFeed`) and send back each result as it finishes; the other ranks follow their replica's first rank.

A replica that has done its share waits until the whole job has (its leader for rank 0's word, the others
for their leader's: comm.replicas.end_call), so that every rank leaves the call together and the next call,
or the end of the job, finds them in step. A failure on rank 0 between steps reaches every leader as the
answer to its next message; one inside a step, or a rank that dies, ends the job through the launcher.
"""
from __future__ import annotations

from typing import Callable, Iterator

from tp_engine import comm
from tp_engine.comm.replicas import ABORT, OVER, DPGroup, end_call, recv_obj, send_obj
from tp_engine.runtime.coordinator import Coordinator, granted, result_of
from tp_engine.runtime.request import RequestOutput


class LeaderFeed:
    """A replica's share of the job, asked of rank 0 as its scheduler has room (Scheduler.feed's `take`)."""

    def __init__(self, dp: DPGroup) -> None:
        self.dp, self.results, self.exhausted = dp, [], False

    def take(self, n: int) -> list[RequestOutput]:
        """Up to `n` requests (none once rank 0 has no more); sends the results finished since the last
        call."""
        want = 0 if self.exhausted else n
        if not want and not self.results:
            return []
        reply = self._ask(("work", want, self.results))
        self.results = []
        _, items, self.exhausted = reply
        return [granted(item) for item in items]

    def finished(self, out: RequestOutput) -> None:
        self.results.append(result_of(out))

    def _ask(self, msg: tuple, wait: bool = True) -> tuple:
        """Send `msg` to rank 0 and return its answer: at once, within timeout_s, or (`wait` False) when the
        whole job is done, however long that takes."""
        send_obj(msg, 0, self.dp.leaders, self.dp.timeout_s)
        _, reply = recv_obj(self.dp.leaders, 0, self.dp.timeout_s if wait else None)
        if reply[0] == "abort":
            raise RuntimeError(f"rank 0 ended the call: {reply[1]}")
        return reply


def run_share(engine, dp: DPGroup, check_token: Callable[[RequestOutput], bool] | None) -> None:
    """A replica's first rank other than rank 0: run what rank 0 hands out until it has no more, then wait for
    the end of the call and tell this replica's other ranks how it ended."""
    feed = LeaderFeed(dp)
    status = ABORT
    counts = engine.spec.policy.counts if engine.spec is not None else None
    before = counts.fields() if counts is not None else {}
    try:
        try:
            engine.run(feed, check_token, feed.finished)
        except Exception as e:
            if engine.broken is None and "rank 0 ended the call" not in str(e):  # rank 0 waits for this one
                try:
                    why = f"rank {dp.world_rank}: {type(e).__name__}: {e}"
                    send_obj(("failed", why), 0, dp.leaders, dp.timeout_s)
                except RuntimeError:  # rank 0 is gone too: the launcher ends the job
                    pass
            raise
        spec = {k: n - before[k] for k, n in counts.fields().items()} if counts is not None else {}
        feed._ask(("done", engine.num_preempted, spec, feed.results), wait=False)
        status = OVER
    finally:
        if engine.broken is None:  # else the other ranks are stuck in a step, or gone: they fail on their own
            end_call(dp, status)


def follow_share(engine, dp: DPGroup) -> None:
    """Any rank but a replica's first: follow its steps, then wait for the end of the call (ended early, the
    leader raises why)."""
    engine.follow()
    end_call(dp)


def release(engine, dp: DPGroup | None) -> None:
    """A replica's first rank failed before its first step: its other ranks leave the call."""
    engine.release_followers()
    if dp is not None:
        end_call(dp, ABORT)


def run_job(engine, dp: DPGroup, requests: Iterator[RequestOutput],
            check_token: Callable[[RequestOutput], bool] | None,
            finish: Callable[[RequestOutput], None], on_remote: Callable[[RequestOutput], None]) -> None:
    """Rank 0: run its replica's share and coordinate the others; `requests` yields every request of the call,
    those that cannot run with their error set. `finish` gets rank 0's results, `on_remote` the others' (and
    the error ones), all on this thread."""
    coordinator = Coordinator(dp, requests, engine.kv.page_size, on_remote).start()
    try:
        engine.run(coordinator, check_token, finish)
        coordinator.wait()
        engine.sched.num_preempted += coordinator.preempted  # the summary counts every replica's
        if engine.spec is not None:
            engine.spec.policy.counts.add(coordinator.spec)
    except BaseException as e:
        coordinator.abort(f"{type(e).__name__}: {e}")
        # the other replicas go on until their next message: this engine cannot meet them in step again
        broken = engine.broken
        engine.broken = broken or comm.mark_out_of_step(f"rank 0: {type(e).__name__}: {e}")
        if broken is None:
            end_call(dp, ABORT)
        raise
    end_call(dp, OVER)
