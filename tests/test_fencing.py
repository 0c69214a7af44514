"""Faults that spare what they can (issue 19): the protocol cores fed directly.

A dead prefill worker ends only the requests still in their handoff; a quiet worker is suspected before it is
declared dead; a worker declared dead is fenced (its epoch moves on, nothing it sends under the old one reaches a
client, and when it comes back it drops what it held, pages under L6); a request with no token yet is retried once.
The same behaviours through real processes: tests/test_faults_server.py.
"""

import pytest

from kvfence.core import Request, SamplingParams
from kvfence.kvcache.pages import PageState
from kvfence.protocol.actions import Deliver, Send, StartPrefill, StopDecode, StopPrefill
from kvfence.protocol.messages import (
    Abort,
    AbortAck,
    Admit,
    Cancel,
    Dest,
    Done,
    Fenced,
    Hello,
    Output,
    Prefill,
    WorkerDown,
)
from kvfence.protocol.router import RouterCore, retry_rid
from tests.sides import side
from tests.test_protocol import RID, SAFE, D, P, R, admit, decode_core, prefill, prefill_core, unsafe

pytestmark = pytest.mark.fast


def hello(worker: str, role: str, pid: int = 0) -> Hello:
    return Hello(worker, "tcp://x", side(role), 1000, 64, free_pages=100, total_pages=100, pid=pid)


def two_pairs() -> RouterCore:
    core = RouterCore(R, max_context=64, safety=SAFE)
    for w, role in ((P, "prefill"), ("prefill-1", "prefill"), (D, "decode"), ("decode-1", "decode")):
        core.worker_up(hello(w, role))
    return core


def request(rid: int = RID, n: int = 6) -> Request:
    return Request(list(range(1, n + 1)), SamplingParams(8), "tenant-a", rid=rid)


def admits(actions) -> list[tuple[str, int]]:
    return [(a.to, a.msg.rid) for a in actions if isinstance(a, Send) and isinstance(a.msg, Admit)]


def delivered(actions) -> list[Deliver]:
    return [a for a in actions if isinstance(a, Deliver)]


def token(rid: int, n: int, finish: str | None = None) -> Output:
    """The ``n``-th token of ``rid``."""
    return Output(rid, [7], "x", finish, completion_tokens=n)


# -- a prefill worker's death ---------------------------------------------------------------------------------


def test_a_dead_prefill_worker_spares_requests_whose_kv_has_landed():
    """Before: ``worker_down`` ended every request naming the dead worker, streams on a healthy decode included."""
    core = two_pairs()
    core.submit(request(RID))
    decode = core.reqs[RID].decode
    assert core.handle(decode, token(RID, 1)) == [Deliver(RID, output=token(RID, 1))]  # its KV has landed
    core.submit(request(RID + 1))  # on the same prefill worker, still in its handoff
    assert core.reqs[RID].prefill == core.reqs[RID + 1].prefill == P
    out = core.worker_down(P)
    assert delivered(out) == [] and Send(decode, Cancel(RID)) not in out
    assert admits(out) == [(core.reqs[retry_rid(RID + 1)].decode, retry_rid(RID + 1))]
    assert core.reqs[RID].prefill == ""
    end = token(RID, 2, "length")
    assert core.handle(decode, end) == [Deliver(RID, output=end)]
    assert RID not in core.reqs


def test_a_request_in_its_handoff_with_a_dead_prefill_is_retried_on_another_pair_under_a_fresh_id():
    core = two_pairs()
    first = admits(core.submit(request()))
    [(decode, _)] = first
    prefill_worker = core.reqs[RID].prefill
    out = core.worker_down(prefill_worker)
    assert Send(decode, Cancel(RID)) in out  # decode drops the first attempt (its pages under L6)
    [(_, rid2)] = admits(out)
    assert rid2 == retry_rid(RID) != RID and core.reqs[rid2].prefill != prefill_worker
    reply = token(rid2, 1, "stop")
    [d] = core.handle(core.reqs[rid2].decode, reply)
    assert d.rid == RID and d.output == reply  # the client hears under its own id
    assert core.reqs == {} and core.retried == set()


def test_a_request_that_has_streamed_is_never_retried():
    core = two_pairs()
    core.submit(request())
    decode = core.reqs[RID].decode
    core.handle(decode, token(RID, 1))
    out = core.worker_down(decode)
    [d] = delivered(out)
    assert d.rid == RID and d.error.status == 503 and "died" in d.error.message
    assert admits(out) == [] and core.queued() == 0 and core.reqs == {}


def test_a_request_whose_client_left_is_not_retried():
    core = two_pairs()
    core.submit(request())
    core.client_gone(RID)  # during the handoff: the cancel waits (L7)
    out = core.worker_down(core.reqs[RID].decode)
    assert delivered(out) == [] and admits(out) == [] and core.reqs == {} and core.queued() == 0


def test_a_client_that_leaves_while_its_retry_runs_cancels_the_retry():
    core = two_pairs()
    core.submit(request())
    core.worker_down(core.reqs[RID].prefill)
    retry = retry_rid(RID)
    core.handle(core.reqs[retry].decode, token(retry, 1))
    decode = core.reqs[retry].decode
    assert core.client_gone(RID) == [Send(decode, Cancel(retry))]
    assert core.reqs == {} and core.retried == set()


# -- suspicion --------------------------------------------------------------------------------------------


def test_a_suspected_worker_gets_no_new_request_but_keeps_its_own():
    core = two_pairs()
    core.submit(request())
    decode = core.reqs[RID].decode
    other = "decode-1" if decode == D else D
    core.set_suspected(decode, True)
    assert [d for d, _ in admits(core.submit(request(RID + 1)))] == [other]
    assert core.handle(decode, token(RID, 1)) == [Deliver(RID, output=token(RID, 1))]  # still its request
    core.set_suspected(other, True)
    assert core.submit(request(RID + 2)) == [] and core.queued() == 1  # waits; no 503 for a quiet worker
    assert admits(core.set_suspected(other, False)) == [(other, RID + 2)]


# -- fencing ----------------------------------------------------------------------------------------------


def test_a_fenced_worker_is_heard_no_more_under_its_old_epoch_and_rejoins_under_the_new_one():
    """Before: a worker declared dead that came back (SIGCONT) kept streaming the requests it held, and said Hello
    as if nothing had happened; with a retry under the same id its tokens would have reached a client."""
    core = RouterCore(R, max_context=64, safety=SAFE)
    core.worker_up(hello(P, "prefill"))
    core.worker_up(hello(D, "decode"))
    core.submit(request())
    out = core.worker_down(D, fenced=True)
    assert Send(P, WorkerDown(D, fenced=True)) in out and core.epochs[D] == 1
    assert delivered(out) == [] and core.queued() == 1  # no token yet: waits for a decode worker, to retry
    # Back from SIGSTOP: its stale output and heartbeat are dropped and answered with Fenced.
    assert core.handle(D, token(RID, 1), epoch=0) == [Send(D, Fenced(1))]
    assert core.handle(D, hello(D, "decode"), epoch=0) == [Send(D, Fenced(1))]
    assert D not in core.workers
    # It drops what it held and says Hello under epoch 1: the retry goes to it, under the retry's id.
    out = core.handle(D, hello(D, "decode"), epoch=1)
    assert admits(out) == [(D, retry_rid(RID))]
    assert core.handle(D, token(RID, 1), epoch=0) == [Send(D, Fenced(1))]  # the old attempt: still nothing
    reply = token(retry_rid(RID), 1, "stop")
    assert core.handle(D, reply, epoch=1) == [Deliver(RID, output=reply)]


def test_without_epochs_a_fenced_workers_late_output_would_reach_the_client():
    """The harm fencing prevents: the same late output, checked with the epoch it was sent under and without."""
    core = RouterCore(R, max_context=64, safety=SAFE)
    core.worker_up(hello(P, "prefill"))
    core.worker_up(hello(D, "decode"))
    core.submit(request())
    core.worker_down(D, fenced=True)
    core.handle(D, hello(D, "decode"), epoch=1)  # back, retry sent to it under retry_rid(RID)
    late = token(retry_rid(RID), 1)  # as if the old incarnation had computed it (ids collide only by mistake)
    assert core.handle(D, late, epoch=0) == [Send(D, Fenced(1))]
    assert delivered(core.handle(D, late, epoch=1)) == [Deliver(RID, output=late)]  # what an unfenced one would do


def test_a_fenced_worker_that_turns_out_to_have_exited_is_announced_again():
    """Decode keeps a fenced prefill's pages quarantined; once the process is known gone they can be freed."""
    core = RouterCore(R, max_context=64, safety=SAFE)
    for w, role in ((P, "prefill"), (D, "decode")):
        core.worker_up(hello(w, role, pid=41))
    core.worker_down(P, fenced=True)
    assert core.worker_down(P) == [Send(D, WorkerDown(P))]  # the supervisor saw it exit
    assert core.worker_down(P) == []
    core.worker_down(D, fenced=True)
    core.worker_up(hello(P, "prefill", pid=41))
    out = core.handle(D, hello(D, "decode", pid=42), epoch=1)  # a new process under the fenced id
    assert Send(P, WorkerDown(D)) in out


def test_a_fenced_prefill_coming_back_is_not_announced_as_dead():
    core = RouterCore(R, max_context=64, safety=SAFE)
    for w, role in ((P, "prefill"), (D, "decode")):
        core.worker_up(hello(w, role, pid=41))
    core.worker_down(P, fenced=True)
    out = core.handle(P, hello(P, "prefill", pid=41), epoch=1)  # the same process, back: it answers for itself
    assert not any(isinstance(a.msg, WorkerDown) for a in out if isinstance(a, Send))


# -- the workers' side: decode ------------------------------------------------------------------------------


def test_decode_quarantines_a_fenced_writers_pages_until_it_answers():
    """Before: a writer declared dead had its pages freed at once; a paused prefill that resumed then wrote into
    pages granted to someone else."""
    core = decode_core()
    core.handle(R, admit(6), now=0)
    out = core.peer_down(P, now=1, fenced=True)
    assert [type(a.msg).__name__ for a in out] == ["Reject"]
    assert core.pages.num_free == 2 and core.pages.num_quarantined == 2 and core.reqs == {}
    core.handle(P, AbortAck(RID), now=2)  # the writer, back and fenced itself, stopped writing
    assert core.pages.num_free == 4 and core.pages.num_quarantined == 0


def test_decode_frees_a_fenced_writers_pages_once_it_is_known_to_have_exited():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    core.peer_down(P, now=1, fenced=True)
    core.peer_down(P, now=2)
    assert core.pages.num_free == 4 and core.pages.num_quarantined == 0


def test_without_deferred_release_a_fenced_writers_pages_are_freed_while_it_may_write():
    core = decode_core(safety=unsafe("deferred_release"))
    core.handle(R, admit(6), now=0)
    core.peer_down(P, now=1, fenced=True)
    assert core.pages.num_free == 4  # the harm: a resumed writer lands in pages that are free to grant


def test_a_fenced_decode_drops_every_request_and_frees_pages_under_l6():
    core = decode_core(pages=4)
    core.handle(R, admit(4, rid=1), now=0)  # will decode
    core.handle(P, Done(1, tokens=4, checksum=1, first_token=5), now=0)
    core.handle(R, admit(4, rid=2), now=0)  # granted, writer busy
    core.handle(R, admit(12, rid=3), now=0)  # waits for pages
    out = core.drop_all(now=1)
    assert StopDecode(1) in out and Send(P, Abort(2)) in out
    assert [a.msg.rid for a in out if isinstance(a, Send) and type(a.msg).__name__ == "Fail"] == [3]
    assert not any(type(a.msg).__name__ == "Reject" for a in out if isinstance(a, Send))  # the router knows
    assert core.pages.state[1].item() == PageState.WRITING  # request 2's page waits for its writer (L6)
    core.handle(P, AbortAck(2), now=2)
    assert core.reqs == {} and core.pages.num_quarantined == 0


# -- the workers' side: prefill ------------------------------------------------------------------------------


def test_a_fenced_prefill_stops_and_acks_only_once_its_writes_have_drained():
    core = prefill_core()
    core.handle(R, prefill(6), now=0)
    out = core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    assert [type(a) for a in out] == [StartPrefill]
    core.handle(R, Prefill(RID + 1, "tenant-a", [1, 2], prefill(2).params, D), now=0)  # no Dest yet
    out = core.drop_all()
    assert StopPrefill(RID) in out and Send(D, AbortAck(RID + 1)) in out
    assert Send(D, AbortAck(RID)) not in out  # writes may still be in flight
    assert core.computed(RID, 6, 0, 0) == [Send(D, AbortAck(RID))]
    assert core.reqs == {}


def test_a_prefill_whose_decode_died_acks_a_returning_decodes_abort():
    """A fenced decode that comes back aborts its transfers; the prefill that stopped for it must answer, or the
    decode keeps those pages quarantined for good."""
    core = prefill_core()
    core.handle(R, prefill(6), now=0)
    core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    core.peer_down(D)
    assert core.handle(D, Abort(RID), now=1) == []
    assert core.computed(RID, 6, 0, 0) == [Send(D, AbortAck(RID))]
