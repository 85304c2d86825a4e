"""`distributed.attempt_store`: every start of a group of ranks gets its own prefix of the
store torchrun keeps for the whole job, so a restarted rank never reads what the ranks of
a failed attempt wrote (torchrun --max-restarts; pytorch/pytorch#135712)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from frawdllm.train.distributed import RankLost, attempt_store


@pytest.fixture
def agent_store(monkeypatch):
    """A store server standing for torchrun's agent, and the environment its workers get."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return server


def start(world: int, ranks: list[int] | None = None, timeout: float = 10) -> list[dist.Store]:
    """The prefixed stores of ranks (default: all) starting side by side, as one attempt."""
    ranks = list(range(world)) if ranks is None else ranks
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda r: attempt_store(r, world, timedelta(seconds=timeout)), ranks))


def test_each_attempt_sees_only_its_own_keys(agent_store):
    first = start(3)
    for rank, store in enumerate(first):
        store.set(f"address/{rank}", f"old-{rank}")  # what gloo writes: each rank's address
    second = start(3)
    assert not second[0].check(["address/1"])  # the dead attempt's keys are out of sight
    second[1].set("address/1", "new-1")
    assert second[2].get("address/1") == b"new-1"
    assert first[0].get("address/1") == b"old-1"


def test_a_rank_that_died_before_joining_does_not_shift_the_attempts(agent_store):
    start(2)
    agent_store.add("frawdllm/attempts/starts/1", 1)  # rank 1 of an attempt registered, then died
    stores = start(2)
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"  # rank 1 still joined rank 0's attempt


def test_rank_0_gives_up_on_a_rank_that_never_comes(agent_store):
    with pytest.raises(RankLost, match=r"ranks \[1\] did not join"):
        start(2, ranks=[0], timeout=1)
