"""oMLX's scheduler reads a step's responses as mlx-lm's loop gives them: at most one per request.
An MTP round gives a request several tokens in one step, and oMLX may end a request at any of
them on its own (a stop string found in the detokenized text — 0.6.x — or a protocol parser's
stop token — 0.3.8 on).  Read as one list, the tokens after that point would be processed for a
request already finished: they are appended to its output, and an unfinished output queued after
the finished one leaves a stream open for good.

So the step's responses are handed to the scheduler in waves — each request's first token, then
each one's second, … — and a request the scheduler finished in one wave gets no more tokens:
what plain decoding would have produced, at the cost of one more call per extra token."""

from __future__ import annotations

from functools import wraps

_WRAPPED = "_omlx_mtp_in_waves"


def process_in_waves(scheduler) -> None:
    """Make ``scheduler._process_batch_responses`` take a step's responses one token per request
    at a time (once per scheduler; a no-op for a host without that method)."""
    process = getattr(scheduler, "_process_batch_responses", None)
    if process is None or getattr(process, _WRAPPED, False):
        return

    @wraps(process)
    def in_waves(responses):
        waves = split_into_waves(responses)
        if len(waves) < 2:
            return process(responses)
        outputs, finished = [], set()
        for wave in waves:
            wave = [r for r in wave if scheduler.uid_to_request_id.get(r.uid) not in finished]
            if wave:
                wave_outputs, wave_finished = process(wave)
                outputs.extend(wave_outputs)
                finished.update(wave_finished)
        return outputs, finished

    setattr(in_waves, _WRAPPED, True)
    scheduler._process_batch_responses = in_waves


def split_into_waves(responses) -> list[list]:
    """``responses`` as lists in which each uid appears once: the k-th list holds every uid's k-th
    response, in the order they came."""
    waves: list[list] = []
    seen: dict[int, int] = {}
    for response in responses:
        k = seen.get(response.uid, 0)
        seen[response.uid] = k + 1
        if k == len(waves):
            waves.append([])
        waves[k].append(response)
    return waves
