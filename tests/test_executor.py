"""The executor's contracts (protocol/executor.py), with the real cores and a recording environment."""

import pytest

from kvfence.kvcache.pages import PageTable
from kvfence.protocol.actions import StartDecode, StartPrefill
from kvfence.protocol.decode import DecodeCore, DecodeLimits
from kvfence.protocol.executor import Computed, DecodeExecutor, PrefillExecutor
from kvfence.protocol.messages import (
    AbortAck,
    Admit,
    Dest,
    Done,
    Fail,
    Fenced,
    Hello,
    Message,
    Output,
    Params,
    Peers,
    Prefill,
    Reject,
    WorkerDown,
)
from kvfence.protocol.prefill import PrefillCore, PrefillLimits
from kvfence.safety import Safety
from tests.sides import side, target

pytestmark = pytest.mark.fast

R, P, D = "router", "prefill-0", "decode-0"
RID = 7


class Env:
    """A network, a runner and an engine that record what the executor does with them."""

    def __init__(self, me: str) -> None:
        self.me, self.epoch = me, 0
        self.sent: list[tuple[str, Message]] = []
        self.peers = Peers({})
        self.started: list[object] = []
        self.stopped: list[int] = []
        self.done: list[Computed] = []

    def send(self, to: str, msg: Message) -> None:
        self.sent.append((to, msg))

    def hello(self) -> Hello:
        return Hello(self.me, self.me, side("prefill"), 64, 64)

    def start(self, start: StartPrefill | StartDecode) -> list[Output | Reject]:
        self.started.append(start)
        return [Output(RID, [5], "x")] if isinstance(start, StartDecode) else []

    def stop(self, rid: int) -> None:
        self.stopped.append(rid)

    def finished(self) -> list[Computed]:
        done, self.done = self.done, []
        return done


def prefill() -> tuple[PrefillExecutor, Env]:
    env = Env(P)
    core = PrefillCore(P, R, PrefillLimits(max_context=64, pool_tokens=64, page_size=4), Safety())
    return PrefillExecutor(core, env, env, lambda: 0.0), env


def test_prefill_starts_only_towards_a_decode_it_still_knows():
    ex, env = prefill()
    ex.receive(R, Peers({D: target()}))
    ex.receive(D, WorkerDown(D))  # forgotten before the core hears of the death
    assert env.peers.decodes == {}
    ex.receive(R, Prefill(RID, "t", [1, 2, 3], Params(2), "decode-1"))
    ex.receive("decode-1", Dest(RID, [(0, 1)], 3))
    assert env.started == [] and [type(m) for _, m in env.sent] == [Fail, Reject]


def test_prefill_reports_what_the_runner_finished_and_stops_on_request():
    ex, env = prefill()
    ex.receive(R, Peers({D: target()}))
    ex.receive(R, Prefill(RID, "t", [1, 2, 3], Params(2), D))
    ex.receive(D, Dest(RID, [(0, 1)], 3))
    assert [type(s) for s in env.started] == [StartPrefill]
    env.done.append(Computed(RID, 3, 99, [(42, None)]))
    ex.collect()
    assert env.sent == [(D, Done(RID, 3, 99, 42))]


def test_fenced_drops_everything_then_says_hello_under_the_new_epoch_once():
    ex, env = prefill()
    ex.receive(R, Peers({D: target()}))
    ex.receive(R, Prefill(RID, "t", [1, 2, 3], Params(2), D))
    ex.receive(D, Dest(RID, [(0, 1)], 3))
    ex.receive(R, Fenced(2))
    assert env.stopped == [RID] and env.epoch == 2 and env.sent[-1] == (R, env.hello())
    env.done.append(Computed(RID, 3, 0))
    ex.collect()
    assert env.sent[-1] == (D, AbortAck(RID))  # only once no write can land
    sent = len(env.sent)
    ex.receive(R, Fenced(2))  # a repeat for the epoch it already left
    assert len(env.sent) == sent


def test_decode_feeds_the_engines_first_outputs_back_to_its_core():
    env = Env(D)
    limits = DecodeLimits(max_context=64, page_size=4)
    core = DecodeCore(D, R, PageTable(4), limits, Safety(), verify=lambda *args: None)
    ex = DecodeExecutor(core, env, env, lambda: 0.0)
    ex.receive(R, Admit(RID, "t", [1, 2, 3], Params(2), P))
    ex.receive(P, Done(RID, 3, 0, 5))
    assert [type(s) for s in env.started] == [StartDecode]
    assert env.sent[-1] == (R, Output(RID, [5], "x"))
