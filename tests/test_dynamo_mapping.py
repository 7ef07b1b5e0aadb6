"""meshnode dynamo-worker's mapping between Dynamo's requests and chunks and the node's submits and events
(pure: no Dynamo needed; tests/test_dynamo.py runs it under Dynamo's router)."""
import pytest

from meshnode.mesh.dynamo_worker import WorkerError, chunk_of, submit_of


def test_a_preprocessed_request_is_the_submit_it_means():
    req = {"token_ids": [5, 6, 7], "sampling_options": {"temperature": 0.7, "top_k": -1, "top_p": 0.9, "seed": 3,
                                                      "repetition_penalty": 1.1, "n": None, "best_of": None},
           "stop_conditions": {"max_tokens": 9, "stop": ["\n\n"], "stop_token_ids_hidden": [2], "ignore_eos": True},
           "output_options": {}}
    s = submit_of(req, "r1")
    assert (s.id, s.tokens, s.max_tokens, s.stop, s.stop_tokens, s.ignore_eos) == ("r1", [5, 6, 7], 9, ["\n\n"], [2], True)
    assert (s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, s.sampling.seed, s.sampling.repeat_penalty) == (
        0.7, 0, 0.9, 3, 1.1)  # top_k -1 is Dynamo's "off": the node's 0
    assert submit_of({"token_ids": [1]}, "r2").max_tokens is None  # no budget: up to the context


def test_the_nodes_events_are_dynamos_chunks_and_an_unfinished_session_raises():
    assert chunk_of({"event": "tokens", "tokens": [4, 5]}, 3) == {"index": 0, "token_ids": [4, 5]}
    done = {"event": "done", "reason": "LENGTH", "usage": {"completion_tokens": 2, "cached_tokens": 1}}
    assert chunk_of(done, 3) == {"index": 0, "token_ids": [], "finish_reason": "length", "completion_usage": {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}}
    for ev in ({"event": "done", "reason": "ENGINE_ERROR", "detail": "gone", "usage": {}},
               {"event": "error", "code": "NODE_UNREACHABLE", "detail": "silent"}):
        with pytest.raises(WorkerError, match="the node ended the request"):
            chunk_of(ev, 3)


class _Up:
    """The node's connection as the worker sees it: each session's events from a script."""

    def __init__(self, *events):
        self.events, self.finished_ids, self.abandoned = list(events), [], []

    def open(self, sub):
        import asyncio

        q = asyncio.Queue()
        for ev in self.events:
            q.put_nowait(ev)
        return q

    def finished(self, sid):
        self.finished_ids.append(sid)

    def abandon(self, sid):
        self.abandoned.append(sid)


class Moved(Exception):
    pass


def _drain(worker) -> list:
    import asyncio

    async def run():
        return [c async for c in worker.generate({"token_ids": [1, 2]})]
    return asyncio.run(run())


def test_a_node_that_cannot_serve_now_makes_the_request_migratable_and_a_bad_one_does_not():
    from meshnode.mesh.dynamo_worker import Worker

    ok = _Up({"event": "admitted"}, {"event": "tokens", "tokens": [7]},
             {"event": "done", "reason": "EOS", "usage": {"completion_tokens": 1}})
    assert [c["token_ids"] for c in _drain(Worker(ok, Moved))] == [[7], []] and len(ok.finished_ids) == 1
    gone = []
    for events, raised, left in (
            (({"event": "admitted"}, {"event": "error", "code": "NODE_UNREACHABLE", "detail": "silent"}), Moved, True),
            (({"event": "rejected", "reason": "REJECTED_DRAINING", "detail": "draining"},), Moved, False),
            (({"event": "admitted"}, {"event": "done", "reason": "ENGINE_ERROR", "usage": {}}), Moved, False),
            (({"event": "rejected", "reason": "REJECTED_BAD_REQUEST", "detail": "no"},), WorkerError, False)):
        gone.clear()
        with pytest.raises(raised):
            _drain(Worker(_Up(*events), Moved, lambda: gone.append(1)))
        assert bool(gone) == left
