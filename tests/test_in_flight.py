"""`serve_in_flight` (the offline sweep's driver): at most C requests in an
engine at once, each finished one replaced at once, every request served once.
Engine-free: a stand-in with vLLM's `add_request` / `step` shape that emits one
token per running request and step (tests/engine/test_bench.py runs the real
engine)."""

from types import SimpleNamespace

import pytest

from adaflash_vllm.bench.offline import serve_in_flight


class _Engine:
    """Each step: every running request emits one token (DELTA), and those with
    none left finish."""

    def __init__(self, max_num_seqs: int = 64):
        self.max_num_seqs = max_num_seqs
        self.left: dict[str, int] = {}
        self.added: list[str] = []
        self.batches: list[int] = []  # requests in each step

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.left
        self.added.append(request_id)
        self.left[request_id] = params.max_tokens

    def step(self):
        running = list(self.left)[: self.max_num_seqs]
        self.batches.append(len(running))
        outs = []
        for r in running:
            self.left[r] -= 1
            done = self.left[r] == 0
            if done:
                del self.left[r]
            outs.append(
                SimpleNamespace(
                    request_id=r,
                    finished=done,
                    outputs=[SimpleNamespace(token_ids=[7])],
                )
            )
        return outs


def _params(lengths):
    return [SimpleNamespace(max_tokens=n) for n in lengths]


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_at_most_c_in_flight_and_every_request_once(concurrency):
    lengths = [5, 2, 9, 4, 4, 1, 7, 3, 6, 2]
    engine = _Engine()
    clock = iter(range(1000)).__next__
    tokens, wall = serve_in_flight(
        engine,
        [f"p{i}" for i in range(10)],
        _params(lengths),
        concurrency,
        tag="t",
        clock=clock,
    )
    assert tokens == sum(lengths)
    assert engine.added == [f"t-{i}" for i in range(10)]  # in order, each once
    assert max(engine.batches) == min(concurrency, 10)
    assert not engine.left
    assert wall == 1  # two clock reads: first request in, last one out


def test_a_finished_request_is_replaced_before_the_next_step():
    # C = 2: the 1-token request finishes at step 1 and the third request runs
    # in step 2 beside the long one; the batch never falls while some wait.
    engine = _Engine()
    serve_in_flight(engine, ["a", "b", "c"], _params([4, 1, 2]), 2)
    assert engine.batches == [2, 2, 2, 1]


def test_one_request_at_a_time_serves_in_sequence():
    engine = _Engine()
    tokens, _ = serve_in_flight(engine, ["a", "b"], _params([3, 2]), 1)
    assert engine.batches == [1] * 5 and tokens == 5


def test_concurrency_below_one_is_refused():
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        serve_in_flight(_Engine(), ["a"], _params([1]), 0)


class _LLM:
    """What `SweepLevels` reads of a vLLM `LLM`: its engine and its metrics
    (none here: every counter reads 0)."""

    def __init__(self):
        self.llm_engine = _Engine()

    def get_metrics(self):
        return []


def test_sweep_levels_follow_the_harness_commands():
    """The child side of the interleaved offline sweep: READY, then each
    command done and answered; a level's point is the median of its passes,
    with every request served at that concurrency."""
    from adaflash_vllm.bench.offline import DONE, READY, SweepLevels
    from adaflash_vllm.bench.workloads import output_lengths

    workload = {
        "phases": [{"name": "prose", "prompts": ["a", "b", "c"]}],
        "max_tokens": 6,
        "output_len_spread": 0.5,
        "requests_per_slot": 3,
        "temperature": 0.0,
    }
    result = {"points": []}
    llm, saved, replies = _LLM(), [], []
    levels = SweepLevels(llm, workload, result, lambda: saved.append(1), print)
    commands = [
        '{"op": "warm", "level": 2}',
        '{"op": "pass", "level": 2}',
        "",
        '{"op": "pass", "level": 2}',
        '{"op": "point", "level": 2}',
        '{"op": "end"}',
        '{"op": "pass", "level": 2}',  # after the end: not read
    ]
    levels.run_commands(commands, replies.append)
    assert replies == [READY] + [DONE] * 4
    (point,) = result["points"]
    assert point["key"] == 2 and point["requests"] == 6
    assert point["output_tokens"] == sum(output_lengths(6, 6, 0.5))
    assert len(point["tok_s_runs"]) == 2 and saved == [1]
    assert max(llm.llm_engine.batches) == 2  # never more than C in flight
    # warm-up (2 requests) and two passes of 6
    assert len(llm.llm_engine.added) == 2 + 2 * 6
