"""Rank 0's coordinator of a data-parallel job: it hands the job's requests to the replicas as they ask for
them, and passes the other replicas' results to the main thread.

Each replica's first rank asks for work when its scheduler has room (a pull: a replica that drew long
requests asks less often, and the others take the rest). Rank 0's own replica asks through `take`, between
its steps; the others through messages (runtime/replicas.py), which a thread of this process per replica
answers at once, whatever rank 0's engine is doing (a receive from one rank, unlike one from any, fails at
once when that rank dies). A grant prefers, among the next LOOKAHEAD requests, those whose
first page of tokens that replica was already given (its prefix cache likely holds their KV), then takes
them in order; it is at most an even share of what is pending, so that a small job is spread over all
replicas. The results of the other replicas, and the requests that ended in error before they ran, are
handed to `on_done` on the main thread.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from typing import Callable, Iterator

from tp_engine.comm import PeerLost
from tp_engine.comm.replicas import DPGroup, recv_obj, send_obj
from tp_engine.runtime.request import RequestOutput

log = logging.getLogger("tp_engine")

LOOKAHEAD = 256  # pending requests looked through for a replica's cached prefixes (and made ahead)
KEPT_PREFIXES = 4096  # first pages remembered per replica, the most recent


def first_page(ids: list[int], page_size: int) -> int | None:
    """A key of a prompt's first KV page, or None for a prompt shorter than a page (nothing to share)."""
    return hash(tuple(ids[:page_size])) if len(ids) >= page_size else None


def grant_of(req: RequestOutput) -> tuple:
    """What rank 0 sends another replica of a request to run (`granted` makes it again there)."""
    return req.index, req.sample, req.prompt_ids, req.params, req.think_open, req.think_end


def granted(item: tuple) -> RequestOutput:
    index, sample, ids, params, think_open, think_end = item
    return RequestOutput(index, ids, params, sample=sample, think_open=think_open, think_end=think_end)


def result_of(out: RequestOutput) -> tuple:
    """What a replica sends back of a finished request."""
    return (out.index, out.sample, out.output_ids, out.finish_reason, out.error, out.text,
            out.cached_prompt_tokens, out.logprobs)


class Coordinator:
    def __init__(self, dp: DPGroup, requests: Iterator[RequestOutput], page_size: int,
                 on_done: Callable[[RequestOutput], None]) -> None:
        self.dp, self.page_size, self.on_done = dp, page_size, on_done
        self.source = requests
        self.pending: deque[tuple[RequestOutput, int | None]] = deque()  # with its first page's key
        self.exhausted = False  # `requests` has given its last
        self.given: dict[tuple[int, int], RequestOutput] = {}  # running on another replica
        self.prefixes: list[OrderedDict] = [OrderedDict() for _ in range(dp.count)]
        self.served = [0] * dp.count
        self.finished: deque[RequestOutput] = deque()  # for on_done, on the main thread
        self.done: list[int] = []  # the leaders (global ranks) that have done their share
        self.preempted = 0  # requests the other replicas recomputed
        self.spec: dict[str, int] = {}  # their speculative decoding's counts (speculative/policy.SpecCounts)
        self.error: str | None = None  # the serving thread's failure
        self.aborted: str | None = None  # the main thread's
        self.lock = threading.Condition()
        self.threads = [threading.Thread(target=self._serve, args=(replica,), name=f"dp-replica-{replica}",
                                         daemon=True) for replica in range(1, dp.count)]

    def start(self) -> "Coordinator":
        """Start answering the other leaders."""
        for thread in self.threads:
            thread.start()
        return self

    # ---- on the main thread ----

    def take(self, n: int) -> list[RequestOutput]:
        """Rank 0's replica's share, up to `n`; first the other replicas' results go to on_done."""
        self._pass_on()
        with self.lock:
            return self._grant(0, n)

    def wait(self) -> None:
        """After rank 0's own share: pass on the others' results until every replica is done; then end the
        call on every leader."""
        while True:
            self._pass_on()
            with self.lock:
                if len(self.done) == self.dp.count - 1 and not self.finished:
                    break
                self.lock.wait(timeout=1.0)
        for thread in self.threads:
            thread.join()
        for leader in self.done:
            send_obj(("over",), leader, self.dp.leaders, self.dp.timeout_s)
        log.info("data parallel: requests served per replica: %s", self.served)

    def abort(self, why: str) -> None:
        """The call failed on rank 0: every other leader is told so at its next message."""
        with self.lock:
            self.aborted = why
            self.source.close()

    def _pass_on(self) -> None:
        while True:
            with self.lock:
                if self.error is not None:
                    raise PeerLost(self.error)
                if not self.finished:
                    return
                req = self.finished.popleft()
            self.on_done(req)

    # ---- under the lock, on either thread ----

    def _grant(self, replica: int, n: int) -> list[RequestOutput]:
        if n <= 0 or self.aborted:
            return []
        while len(self.pending) < LOOKAHEAD and not self.exhausted:
            req = next(self.source, None)
            if req is None:
                self.exhausted = True
            elif req.finish_reason is not None:  # a prompt that cannot run: its error line is its result
                self.finished.append(req)
            else:
                self.pending.append((req, first_page(req.prompt_ids, self.page_size)))
        n = min(n, -(-len(self.pending) // (self.dp.count - len(self.done))))  # at most an even share
        seen = self.prefixes[replica]
        chosen = {i for i, (_, k) in enumerate(self.pending) if k is not None and k in seen}
        chosen = set(sorted(chosen)[:n])
        chosen |= set([i for i in range(len(self.pending)) if i not in chosen][:n - len(chosen)])
        out = [self.pending[i] for i in sorted(chosen)]
        self.pending = deque(p for i, p in enumerate(self.pending) if i not in chosen)
        for req, k in out:
            if k is not None:
                seen[k] = None
                seen.move_to_end(k)
                if len(seen) > KEPT_PREFIXES:
                    seen.popitem(last=False)
            if replica:
                self.given[req.index, req.sample] = req
        self.served[replica] += len(out)
        return [req for req, _ in out]

    def _collect(self, results: list[tuple]) -> None:
        for index, sample, *fields in results:
            req = self.given.pop((index, sample))
            (req.output_ids, req.finish_reason, req.error, req.text, req.cached_prompt_tokens,
             req.logprobs) = fields
            self.finished.append(req)

    # ---- a thread per other replica ----

    def _serve(self, replica: int) -> None:
        """Answer a replica's leader until it has done its share: ("work", n, results) gets ("grant",
        requests, no more to come) at once; ("done", preempted, speculation's counts, results) gets its answer
        at the end of the call (wait); ("failed", why) ends the call. After an abort, each gets ("abort",
        why)."""
        src, msg = self.dp.leader_of(replica), ("work",)
        try:
            while msg[0] == "work":
                _, msg = recv_obj(self.dp.leaders, src)
                reply = None
                with self.lock:
                    if msg[0] == "failed":
                        self.error = f"{self.dp.describe(replica)} failed: {msg[1]}"
                        self.done.append(src)
                    else:
                        self._collect(msg[-1])
                    if msg[0] == "work":
                        items = [grant_of(r) for r in self._grant(replica, msg[1])]
                        reply = ("grant", items, self.exhausted and not self.pending)
                    elif msg[0] == "done":
                        self.done.append(src)
                        self.preempted += msg[1]
                        for name, n in msg[2].items():
                            self.spec[name] = self.spec.get(name, 0) + n
                    if self.aborted is not None and msg[0] != "failed":
                        reply = ("abort", self.aborted)
                    self.lock.notify_all()
                if reply is not None:
                    send_obj(reply, src, self.dp.leaders, self.dp.timeout_s)
        except RuntimeError as e:  # the leader died (its connection closed), or did not take an answer
            why = "timed out" if "Timed out" in str(e) else "one of its ranks probably died"
            with self.lock:
                self.error = self.error or f"lost contact with {self.dp.describe(replica)}: {why}; the " \
                    "launcher names it"
                self.lock.notify_all()
