"""A step's sampled tokens: what the sampler needs of each row; the tokens (and log-probabilities) on their
way to rank 0's host, and back into the requests; on the device, into the next step's input ids."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tp_engine.attention.flashinfer_backend import slot_rows
from tp_engine.runtime.request import RequestState
from tp_engine.runtime.step_plan import Plan
from tp_engine.sampling.sampler import SamplingParams, request_seed


@dataclass
class Issued:
    """A step sent to the GPU whose tokens rank 0 has not read yet."""
    plan: Plan
    tokens: torch.Tensor  # [B] int64 on the host, filled by an asynchronous copy
    done: torch.cuda.Event | None  # recorded after the copies (None on CPU, where they are synchronous)
    # sampler.token_logprobs on the host, when a request asked for them
    logprobs: tuple[torch.Tensor, ...] = ()

    def host_tokens(self) -> list[int]:
        """The step's tokens, once their copy has reached the host (any thread may wait for it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.tokens.tolist()


def sampling_inputs(plan: Plan, seed: int) -> tuple[list[SamplingParams], list[int], list[int]]:
    """Each row's sampling parameters, seed (`seed`, the config's, where its parameters name none) and step
    (the output index it samples now: read before `Scheduler.commit` counts the step's tokens as pending)."""
    return sampling_inputs_of(plan.reqs, seed)


def sampling_inputs_of(reqs: list[RequestState],
                       seed: int) -> tuple[list[SamplingParams], list[int], list[int]]:
    """`sampling_inputs` of the requests `reqs`."""
    outs = [r.out for r in reqs]
    params = [o.params for o in outs]
    seeds = [request_seed(seed if p.seed is None else p.seed, o.index, o.sample)
             for o, p in zip(outs, params)]
    return params, seeds, [r.num_outputs for r in reqs]


def resolve(ids: torch.Tensor, last: torch.Tensor, slots: tuple | None = None, ops=None) -> torch.Tensor:
    """Replace each reference to the previous step's tokens (`step_plan.ref_token`: -1 - row) by last[row], in
    place. slots, (out_loc, page_size, k_rows, v_rows): also each token's K/V cache rows (slot_rows); with the
    engine's fused kernels `ops`, both in one launch (a decode graph's first)."""
    if ops is not None:
        return ops.resolve_tokens(ids, last, slots)
    if slots is not None:
        slot_rows(*slots)
    return ids.copy_(torch.where(ids >= 0, ids, last[(-1 - ids).clamp(min=0)]))


def to_host(plan: Plan, tokens: torch.Tensor, logprobs: tuple[torch.Tensor, ...]) -> Issued:
    """Queue the copies to the host without waiting for the GPU: into pinned memory, then one event. On CUDA
    they run on a stream of their own, behind the work queued so far, so that the next step's work does not
    queue behind them; `tokens` and `logprobs` must not be written again (the sampler's fresh tensors)."""
    if not tokens.is_cuda:
        return Issued(plan, tokens.clone(), None, logprobs)
    side = _copy_stream(tokens.device)
    side.wait_stream(torch.cuda.current_stream(tokens.device))
    host = []
    with torch.cuda.stream(side):
        for t in (tokens, *logprobs):
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            t.record_stream(side)  # the allocator keeps t's memory until the copy has run
            host.append(h)
        done = torch.cuda.Event()
        done.record(side)
    return Issued(plan, host[0], done, tuple(host[1:]))


_STREAMS: dict = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def add_logprobs(step: Issued, got: list[RequestState]) -> None:
    """Append one logprobs entry to each request that took a token from this step (a request that had already
    finished drops its token, and so its entry: the list stays aligned with output_ids)."""
    if not step.logprobs:
        return
    chosen, top_ids, top_vals = (t.tolist() for t in step.logprobs)
    took = {id(r) for r in got}
    for row, r in enumerate(step.plan.reqs):
        out = r.out
        k = out.params.logprobs
        if k and id(r) in took:
            out.logprobs.append({"token": out.output_ids[-1], "logprob": chosen[row],
                                 "top": [[i, v] for i, v in zip(top_ids[row][:k], top_vals[row][:k])]})
