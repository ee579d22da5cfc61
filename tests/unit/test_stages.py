"""TransferStage: the hand-off stage the engine loop polls (no processes: a real one-thread executor)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from kvferry.worker.stages import TransferStage


@pytest.fixture
def executor():
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        yield ex


def poll_until(stage: TransferStage, count: int, timeout_s: float = 5.0):
    """Poll like the engine loop does until `count` items came back (finished + abandoned)."""
    finished, abandoned = [], []
    deadline = time.monotonic() + timeout_s
    while len(finished) + len(abandoned) < count:
        assert time.monotonic() < deadline, f"only {len(finished) + len(abandoned)} of {count} came back"
        f, a = stage.poll()
        finished += f
        abandoned += a
        if len(finished) + len(abandoned) < count:
            threading.Event().wait(0.001)
    return finished, abandoned


def test_finished_items_come_back_in_order_with_their_values(executor):
    woken = threading.Event()
    stage: TransferStage[str] = TransferStage("t", executor, woken.set)
    for i in range(3):
        stage.start(f"r{i}", f"item{i}", lambda i=i: i * 10)
    assert len(stage) == 3 and "r1" in stage
    finished, abandoned = poll_until(stage, 3)
    assert [(d.request_id, d.item, d.value) for d in finished] == [
        ("r0", "item0", 0),
        ("r1", "item1", 10),
        ("r2", "item2", 20),
    ]
    assert not abandoned and len(stage) == 0 and woken.is_set()


def test_discarded_item_comes_back_abandoned(executor):
    gate = threading.Event()
    stage: TransferStage[str] = TransferStage("t", executor, lambda: None)
    stage.start("a", "held blocks", gate.wait)
    assert stage.discard("a") == "held blocks"
    assert stage.discard("a") is None  # once
    gate.set()
    finished, abandoned = poll_until(stage, 1)
    assert not finished and [d.item for d in abandoned] == ["held blocks"]


def test_a_new_item_under_the_same_id_is_not_taken_for_the_old_one(executor):
    gate = threading.Event()
    stage: TransferStage[str] = TransferStage("t", executor, lambda: None)
    stage.start("a", "old", gate.wait)
    stage.discard("a")
    stage.start("a", "new", lambda: "second")
    gate.set()
    finished, abandoned = poll_until(stage, 2)
    assert [d.item for d in abandoned] == ["old"] and [(d.item, d.value) for d in finished] == [
        ("new", "second")
    ]


def test_errors_are_returned_not_raised(executor):
    stage: TransferStage[str] = TransferStage("t", executor, lambda: None)

    def boom():
        raise ConnectionError("pool node gone")

    stage.start("a", "x", boom)
    (done,), _ = poll_until(stage, 1)
    assert isinstance(done.error, ConnectionError) and done.value is None


def test_future_work_finishes_with_its_future_and_on_done_runs_at_once(executor):
    answered = []
    stage: TransferStage[str] = TransferStage("t", executor, lambda: None, on_done=answered.append)
    reply: concurrent.futures.Future = concurrent.futures.Future()
    sent = threading.Event()

    def send():
        sent.set()
        return reply

    stage.start("a", "write", send)
    assert sent.wait(5)
    assert stage.poll() == ([], []) and not answered  # sent, but the reply is not back
    reply.set_result(["loc"])
    assert [d.value for d in answered] == [["loc"]]  # on the thread that completed the future
    (done,), _ = poll_until(stage, 1)
    assert done.value == ["loc"] and "a" not in stage
