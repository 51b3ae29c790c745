"""AsyncEngine on the real model: concurrent asyncio streams equal HF, aborts, cancellation, the
thread/callback API (Triton), bad input raised to the caller, shutdown."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_helpers import exported, greedy, hf_reference, random_requests
from toy_backend import ToyBackend

from octavo.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, UnknownRequestError
from octavo.runtime.async_engine import AsyncEngine
from octavo.runtime.engine_args import EngineArgs


@pytest.fixture(scope="module")
def model(hf_model_dir):  # noqa: ANN001, ANN201
    hf = hf_model_dir("llama")
    return hf, exported(hf)


def test_concurrent_streams_abort_and_cancel(model) -> None:  # noqa: ANN001
    hf, folder = model
    reqs = random_requests(6, seed=21, max_prompt=80, max_gen=16)

    async def main() -> None:
        eng = AsyncEngine(EngineArgs(model=str(folder), num_blocks=64, max_num_batched_tokens=32))
        await eng.start()

        async def consume(i: int, p: list[int], m: int) -> list:
            return [o async for o in eng.generate({"prompt_token_ids": p}, greedy(m), f"r{i}")]

        async def abort_later() -> list:
            outs = []
            async for o in eng.generate({"prompt_token_ids": reqs[0][0]}, greedy(200), "victim"):
                outs.append(o)
                if len(outs) == 3:
                    await eng.abort("victim")
            return outs

        async def cancel_early() -> None:
            async for _ in eng.generate({"prompt_token_ids": reqs[1][0]}, greedy(200), "gone"):
                break  # the consumer leaves: the request must be aborted, not left running

        results = await asyncio.gather(*[consume(i, p, m) for i, (p, m) in enumerate(reqs)], abort_later(), cancel_early())
        for (p, m), outs in zip(reqs, results):
            assert outs[-1].finished and sum(o.finished for o in outs) == 1
            toks = [len(o.outputs[0].token_ids) for o in outs]
            assert toks == sorted(toks)  # cumulative
            assert outs[-1].outputs[0].token_ids == hf_reference(hf, p, m)
        victim = results[len(reqs)]
        assert victim[-1].finished and victim[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(PromptTooLongError):
            async for _ in eng.generate({"prompt_token_ids": [5] * 2000}, greedy(4), "too-long"):
                pass
        with pytest.raises(UnknownRequestError):
            await eng.abort("nobody")
        for _ in range(100):
            if eng.stats().num_running == 0 and eng.stats().num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        st = eng.stats()
        assert st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks
        await eng.shutdown()
        with pytest.raises(EngineDeadError):
            eng.submit("hello", greedy(2), "late", lambda o: None)

    asyncio.run(main())


def test_thread_callback_api(model) -> None:  # noqa: ANN001
    hf, folder = model
    eng = AsyncEngine(EngineArgs(model=str(folder), num_blocks=64))
    reqs = random_requests(4, seed=22, max_prompt=40, max_gen=10)
    done = threading.Event()
    got: dict[str, list] = {}
    lock = threading.Lock()

    def cb(out) -> None:  # noqa: ANN001
        with lock:
            got.setdefault(out.request_id, []).append(out)
            if sum(1 for v in got.values() if v[-1].finished) == len(reqs):
                done.set()

    threads = [threading.Thread(target=eng.submit, args=({"prompt_token_ids": p}, greedy(m), f"t{i}", cb))
               for i, (p, m) in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = greedy(2)
    bad.top_p = 2.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        eng.submit("x", bad, "bad", cb)
    assert done.wait(60)
    for i, (p, m) in enumerate(reqs):
        assert got[f"t{i}"][-1].outputs[0].token_ids == hf_reference(hf, p, m)
    eng.shutdown_sync()


def test_submit_and_abort_do_not_wait_for_a_running_step(model) -> None:  # noqa: ANN001
    from octavo.export.manifest import Manifest
    from octavo.runtime.backends.onnxruntime import OnnxRuntimeBackend

    hf, folder = model

    class Slow:
        def __init__(self) -> None:
            self.inner = OnnxRuntimeBackend(folder, Manifest.load(folder), 64, 16)
            self.num_blocks, self.block_size, self.vocab_size = 64, 16, self.inner.vocab_size
            self.running, self.release = threading.Event(), threading.Event()

        def run(self, inputs):  # noqa: ANN001, ANN201 - the first step is held until the test releases it
            self.running.set()
            assert self.release.wait(60)
            return self.inner.run(inputs)

        def close(self) -> None:
            self.inner.close()

    backend = Slow()
    eng = AsyncEngine(EngineArgs(model=str(folder), num_blocks=64), backend)
    finals: dict[str, object] = {}
    done = threading.Event()

    def cb(out) -> None:  # noqa: ANN001
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == 2:
                done.set()

    eng.submit({"prompt_token_ids": [5, 6, 7]}, greedy(3), "a", cb)
    assert backend.running.wait(10)
    # a state, not a duration: both calls return while the step is still held (if either waited for the step
    # it could not return before the release below, and the join's deadline fails the test)
    calls = threading.Thread(target=lambda: (eng.submit({"prompt_token_ids": [8, 9]}, greedy(2), "b", cb),
                                             eng.abort_nowait("a")))
    calls.start()
    calls.join(60)
    returned_during_the_step = not calls.is_alive()
    backend.release.set()
    assert returned_during_the_step, "submit/abort_nowait waited for the running step"
    assert done.wait(30)
    assert finals["a"].outputs[0].finish_reason == "abort"
    assert finals["b"].outputs[0].token_ids == hf_reference(hf, [8, 9], 2)
    eng.shutdown_sync()


def test_many_threads_submitting_and_aborting_at_random(tmp_path) -> None:  # noqa: ANN001
    """Every request gets exactly one final output, finished ones equal the oracle, no block leaks."""
    import random

    from toy_backend import ToyBackend, make_toy_model_dir, toy_greedy

    folder = make_toy_model_dir(tmp_path / "toy")
    eng = AsyncEngine(EngineArgs(model=str(folder), block_size=4, max_num_batched_tokens=16, max_num_seqs=6),
                      ToyBackend(24, 4))
    finals: dict[str, list] = {}
    prompts: dict[str, list[int]] = {}
    lock = threading.Lock()

    def cb(out) -> None:  # noqa: ANN001
        if out.finished:
            with lock:
                finals.setdefault(out.request_id, []).append(out)

    def worker(w: int) -> None:
        rng = random.Random(w)
        for k in range(15):
            rid = f"w{w}-{k}"
            p = [rng.randrange(5, 300) for _ in range(rng.randrange(1, 30))]
            prompts[rid] = p
            eng.submit({"prompt_token_ids": p}, greedy(rng.randrange(1, 12)), rid, cb)
            time.sleep(rng.random() * 0.005)
            if rng.random() < 0.3:
                try:
                    eng.abort_nowait(rid)
                except UnknownRequestError:
                    pass  # already finished

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 60
    while len(finals) < len(prompts) and time.time() < deadline:
        time.sleep(0.01)
    assert set(finals) == set(prompts)
    for rid, outs in finals.items():
        assert len(outs) == 1
        c = outs[0].outputs[0]
        ref = toy_greedy(prompts[rid], len(c.token_ids))
        assert c.token_ids == ref and c.finish_reason in ("length", "abort")
    time.sleep(0.05)
    st = eng.stats()
    assert st.num_free_blocks == st.num_total_blocks and st.num_running == st.num_waiting == 0
    eng.shutdown_sync()


class SlowToyBackend(ToyBackend):
    """The toy backend with a 0.3 s step that says when a step has started (`running`)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.running = threading.Event()

    def run(self, inputs):  # noqa: ANN001, ANN201
        self.running.set()
        time.sleep(0.3)
        return super().run(inputs)


def test_abort_and_shutdown_in_the_same_drain_still_end_the_request(tmp_path) -> None:  # noqa: ANN001
    """An abort queued while a step runs, then shutdown: the callback still gets exactly one final output
    (it was dropped: the aborted group left engine.groups before the shutdown ended the rest), and the
    blocks are freed."""
    from toy_backend import make_toy_model_dir

    folder = make_toy_model_dir(tmp_path / "toy")
    backend = SlowToyBackend(24, 4)
    eng = AsyncEngine(EngineArgs(model=str(folder), block_size=4), backend)
    finals: list = []
    eng.submit({"prompt_token_ids": [5, 6, 7]}, greedy(50), "a", lambda o: finals.append(o) if o.finished else None)
    assert backend.running.wait(10)
    eng.abort_nowait("a")  # queued behind the running step ...
    eng.shutdown_sync()  # ... and the stop drained with it
    assert len(finals) == 1 and finals[0].outputs[0].finish_reason == "abort"
    st = eng.engine.stats()  # shutdown aborts through the engine: no blocks left allocated
    assert st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks


def test_abort_drained_just_before_the_loop_dies_still_gets_its_final_output(tmp_path) -> None:  # noqa: ANN001
    """An abort drained together with the step that kills the loop (the scheduler raises): the aborted request
    still gets exactly one final output ("abort"; it used to get none: it had left engine.groups, so the
    failure handler never saw it), the request added in the same drain ends with "error"."""
    from toy_backend import make_toy_model_dir

    folder = make_toy_model_dir(tmp_path / "toy")
    backend = SlowToyBackend(24, 4)
    eng = AsyncEngine(EngineArgs(model=str(folder), block_size=4), backend)
    real_schedule = eng.engine.scheduler.schedule
    broken = threading.Event()

    def schedule():  # noqa: ANN202 - fault injection: the engine loop itself fails (a bug outside the backend)
        if broken.is_set():
            raise RuntimeError("injected scheduler bug")
        return real_schedule()

    eng.engine.scheduler.schedule = schedule
    finals: dict[str, list] = {}
    lock = threading.Lock()

    def cb(out) -> None:  # noqa: ANN001
        if out.finished:
            with lock:
                finals.setdefault(out.request_id, []).append(out)

    eng.submit({"prompt_token_ids": [5, 6, 7]}, greedy(50), "a", cb)
    assert backend.running.wait(10)
    broken.set()
    eng.abort_nowait("a")  # queued behind the running step, drained right before the failing one
    eng.submit({"prompt_token_ids": [8, 9]}, greedy(5), "b", cb)
    deadline = time.monotonic() + 10
    while eng.dead_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.dead_reason is not None and "injected scheduler bug" in eng.dead_reason
    time.sleep(0.05)
    assert set(finals) == {"a", "b"}, finals
    assert [len(v) for v in finals.values()] == [1, 1]
    assert finals["a"][0].outputs[0].finish_reason == "abort"
    b = finals["b"][0].outputs[0]
    assert b.finish_reason == "error" and "injected scheduler bug" in (b.error or "")
    with pytest.raises(EngineDeadError):
        eng.submit("x", greedy(2), "late", cb)
    assert eng.shutdown_sync() is True


def test_shutdown_that_times_out_never_closes_the_backend_under_a_running_step(tmp_path) -> None:  # noqa: ANN001
    """shutdown's join gives up while a step runs: the backend must not be freed under that step (it used to
    be); the engine thread releases it once the step is over, and the request still ends with "abort"."""

    from toy_backend import ToyBackend, make_toy_model_dir

    folder = make_toy_model_dir(tmp_path / "toy")

    class SlowToy(ToyBackend):
        running = threading.Event()
        in_run = False
        closed = threading.Event()
        closed_during_run = False
        ran_after_close = False

        def run(self, inputs):  # noqa: ANN001, ANN201
            if self.closed.is_set():
                self.ran_after_close = True
            self.in_run = True
            self.running.set()
            time.sleep(0.5)
            out = super().run(inputs)
            self.in_run = False
            return out

        def close(self) -> None:
            self.closed_during_run = self.closed_during_run or self.in_run
            self.closed.set()

    backend = SlowToy(24, 4)
    eng = AsyncEngine(EngineArgs(model=str(folder), block_size=4), backend)
    finals: list = []
    eng.submit({"prompt_token_ids": [5, 6, 7]}, greedy(50), "a", lambda o: finals.append(o) if o.finished else None)
    assert backend.running.wait(10)
    closed_on_return = eng.shutdown_sync(timeout=0.05)
    assert backend.closed.wait(10), "the engine thread must release the backend once its step ends"
    assert not backend.closed_during_run and not backend.ran_after_close
    assert closed_on_return is False  # the step was still running: shutdown left the closing to the thread
    assert len(finals) == 1 and finals[0].outputs[0].finish_reason == "abort"
    assert eng.shutdown_sync() is True  # a second shutdown is harmless (closes nothing twice)
