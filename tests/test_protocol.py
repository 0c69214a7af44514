"""The sans-IO protocol cores, fed messages directly; each test asserts the exact messages and actions out."""

import pytest

from kvfence.core import ContextLengthExceeded, Request, SamplingParams, TokenLogprob
from kvfence.kvcache.pages import PageGrant, PageState, PageTable
from kvfence.protocol.actions import Deliver, Send, StartDecode, StartPrefill, StopDecode, StopPrefill
from kvfence.protocol.decode import DecodeCore, DecodeLimits
from kvfence.protocol.messages import (
    Abort,
    AbortAck,
    Admit,
    Cancel,
    Dest,
    Done,
    ErrorInfo,
    Fail,
    Fenced,
    Hello,
    Output,
    Params,
    Peers,
    Prefill,
    PrefillSide,
    Progress,
    Reject,
    WorkerDown,
    decode_message,
    encode_message,
)
from kvfence.protocol.prefill import PrefillCore, PrefillLimits
from kvfence.protocol.router import RouterCore, retry_rid
from kvfence.safety import Safety
from tests.sides import side, target

pytestmark = pytest.mark.fast


R, P, D = "router", "prefill-0", "decode-0"
RID = 0xFEED_0000_0000_0000_0000_0000_0000_0001
SAFE = Safety()


def unsafe(*layers: str) -> Safety:
    return Safety.from_env(",".join(layers))


# -- decode ------------------------------------------------------------------------


def decode_core(pages: int = 4, safety: Safety = SAFE, verdict: str | None = None) -> DecodeCore:
    limits = DecodeLimits(max_context=64, page_size=4, handoff_timeout=30, abort_timeout=10)
    return DecodeCore(D, R, PageTable(pages), limits, safety, verify=lambda rid, grants, expected, checksum: verdict)


def admit(n: int = 6, max_tokens: int = 2, rid: int = RID, tenant: str = "tenant-a", weight: float = 1.0) -> Admit:
    return Admit(rid, tenant, list(range(1, n + 1)), Params(max_tokens), P, weight)


def test_decode_happy_path_grants_exact_pages_then_starts_decoding():
    core = decode_core()
    assert core.handle(R, admit(6), now=0) == [Send(P, Dest(RID, [(0, 1), (1, 1)], 6))]
    assert core.pages.state[:2].tolist() == [PageState.WRITING] * 2
    done = Done(RID, tokens=6, checksum=1, first_token=42)
    out = core.handle(P, done, now=1)
    assert out == [StartDecode(admit(6), [PageGrant(0, 1), PageGrant(1, 1)], done)]
    assert core.pages.state[:2].tolist() == [PageState.READY] * 2


def test_decode_knows_when_a_prefill_may_be_working_for_it():
    """Waiting for pages, granted and awaiting Done, aborting: a prefill may be busy; decoding only: none is."""
    core = decode_core(pages=2)
    assert not core.prefill_pending()
    core.handle(R, admit(6), now=0)  # granted both pages, awaiting Done
    core.handle(R, admit(6, rid=RID + 1), now=0)  # waits for pages
    assert core.prefill_pending()
    core.handle(P, Done(RID, tokens=6, checksum=1, first_token=42), now=1)
    assert core.prefill_pending()  # the second still waits
    core.handle(R, Cancel(RID + 1), now=2)
    assert not core.prefill_pending()


def test_decode_rejects_over_length_before_any_grant():
    core = decode_core()
    out = core.handle(R, admit(60, max_tokens=10), now=0)
    assert [type(a.msg) for a in out] == [Reject, Fail] and [a.to for a in out] == [R, P]
    assert out[0].msg.error.code == "context_length_exceeded"
    assert core.pages.num_free == 4 and core.reqs == {}


def test_decode_admission_off_lets_over_length_through():
    core = decode_core(pages=16, safety=unsafe("admission"))
    out = core.handle(R, admit(60, max_tokens=10), now=0)
    assert [type(a.msg) for a in out] == [Dest]


def test_decode_coverage_mismatch_quarantines_and_fails_with_500():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    out = core.handle(P, Done(RID, tokens=1, checksum=0, first_token=7), now=1)
    assert len(out) == 2 and out[0].to == R and out[0].msg.error.status == 500
    assert out[1] == Send(P, Abort(RID))  # the writer must confirm that nothing more lands
    reason = "coverage: 1 tokens written, 6 expected"
    assert core.pages.quarantine_reason == {0: reason, 1: reason}
    core.pages.check_integrity()


def test_decode_pages_of_a_failed_landing_come_back_once_the_writer_acks_the_abort():
    """A failed verification must not cost the pool its pages for good: AbortAck (or death) releases them."""
    core = decode_core(verdict="checksum: page 0: checksum mismatch")
    core.handle(R, admit(6), now=0)
    core.handle(P, Done(RID, 6, 0, 7), now=1)
    assert core.pages.num_quarantined == 2
    assert core.handle(D, AbortAck(RID), now=2) == [] and core.pages.num_quarantined == 2  # not from the writer
    assert core.handle(P, AbortAck(RID), now=2) == []
    assert core.pages.num_free == 4 and core.pages.num_quarantined == 0 and core.held == {}
    core.pages.check_integrity()
    core.handle(R, admit(14, rid=RID + 1), now=3)  # the whole pool again; the released pages' epochs move on
    assert core.reqs[RID + 1].grants == [PageGrant(2, 1), PageGrant(3, 1), PageGrant(0, 2), PageGrant(1, 2)]

    core = decode_core(verdict="tags: page 1: owner mismatch")
    core.handle(R, admit(6), now=0)
    core.handle(P, Done(RID, 6, 0, 7), now=1)
    core.peer_down(P, now=2)  # a dead writer writes nothing either
    assert core.pages.num_free == 4 and core.held == {}


def test_decode_coverage_off_decodes_a_short_transfer():
    core = decode_core(safety=unsafe("coverage"))
    core.handle(R, admit(6), now=0)
    out = core.handle(P, Done(RID, tokens=1, checksum=0, first_token=7), now=1)
    assert isinstance(out[0], StartDecode)


def test_decode_verifier_failure_blocks_decoding():
    core = decode_core(verdict="page 1: owner mismatch")
    core.handle(R, admit(6), now=0)
    out = core.handle(P, Done(RID, 6, 0, 7), now=1)
    assert out[0].msg.error.code == "kv_integrity" and "owner mismatch" in out[0].msg.error.message
    assert not any(isinstance(a, StartDecode) for a in out) and core.pages.num_quarantined == 2


def test_decode_cancel_mid_transfer_waits_for_abort_ack():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    assert core.handle(R, Cancel(RID), now=1) == [Send(P, Abort(RID))]
    assert core.pages.num_free == 2  # still held: a write may land
    assert core.handle(P, AbortAck(RID), now=2) == []
    assert core.pages.num_free == 4 and core.reqs == {}


def test_decode_deferred_release_off_frees_pages_while_write_may_land():
    core = decode_core(safety=unsafe("deferred_release"))
    core.handle(R, admit(6), now=0)
    core.handle(R, Cancel(RID), now=1)
    assert core.pages.num_free == 4


def test_decode_done_racing_abort_also_ends_it():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    core.handle(R, Cancel(RID), now=1)
    assert core.handle(P, Done(RID, 6, 0, 7), now=2) == []
    assert core.pages.num_free == 4
    assert core.handle(P, AbortAck(RID), now=3) == []  # the ack that follows is harmless


def test_decode_silent_writer_pages_are_quarantined_until_it_answers():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    out = core.tick(now=31)
    assert out[0].to == R and out[0].msg.error.status == 503 and out[1] == Send(P, Abort(RID))
    assert core.tick(now=42) == []
    assert core.pages.num_quarantined == 2 and core.reqs == {}
    core.pages.check_integrity()
    core.handle(P, AbortAck(RID), now=50)  # the writer finally speaks: pages come back
    assert core.pages.num_free == 4 and core.pages.num_quarantined == 0


def test_decode_waits_for_pages_then_grants_in_order():
    core = decode_core(pages=2)
    other = RID + 1
    core.handle(R, admit(6, rid=RID), now=0)  # 2 pages: the whole pool
    assert core.handle(R, admit(4, rid=other), now=0) == []  # pool full: waits
    core.handle(P, Fail(RID, ErrorInfo(400, "invalid_request_error", "no")), now=1)
    assert core.reqs[other].grants == [PageGrant(0, 2)]


def test_decode_fail_from_prefill_is_forwarded_and_frees_pages():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    err = ErrorInfo(400, "invalid_request_error", "too long", "context_length_exceeded")
    assert core.handle(P, Fail(RID, err), now=1) == [Send(R, Reject(RID, err, D))]
    assert core.pages.num_free == 4


def test_decode_ignores_done_from_a_stranger():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    assert core.handle("prefill-9", Done(RID, 6, 0, 7), now=1) == []
    assert core.reqs[RID].grants


def test_decode_cancel_while_decoding_stops_the_engine():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    core.handle(P, Done(RID, 6, 0, 7), now=1)
    assert core.handle(R, Cancel(RID), now=2) == [StopDecode(RID)]


def test_decode_prefill_death_releases_and_reports():
    core = decode_core()
    core.handle(R, admit(6), now=0)
    out = core.peer_down(P, now=1)
    assert out[0].msg.error.status == 503 and core.pages.num_free == 4


# -- prefill ------------------------------------------------------------------------


def prefill_core(safety: Safety = SAFE, incident: bool = False, pool: int = 32) -> PrefillCore:
    return PrefillCore(P, R, PrefillLimits(max_context=64, pool_tokens=pool, page_size=4), safety, incident)


def prefill(n: int = 6, max_tokens: int = 2) -> Prefill:
    return Prefill(RID, "tenant-a", list(range(1, n + 1)), Params(max_tokens), D)


def test_prefill_happy_path_in_either_order():
    for first, second in ((prefill(), Dest(RID, [(0, 1), (1, 1)], 6)), (Dest(RID, [(0, 1), (1, 1)], 6), prefill())):
        core = prefill_core()
        sender = lambda m: R if isinstance(m, Prefill) else D  # noqa: E731
        assert core.handle(sender(first), first, now=0) == []
        start = StartPrefill(RID, [1, 2, 3, 4, 5, 6], [(0, 1), (1, 1)], D)
        assert core.handle(sender(second), second, now=0) == [start]
        assert core.computed(RID, 6, 99, 42) == [Send(D, Done(RID, 6, 99, 42))]
        assert core.reqs == {}


def test_prefills_done_carries_every_choices_first_token_for_decode_to_fork():
    core = prefill_core()
    core.handle(R, Prefill(RID, "tenant-a", [1, 2, 3, 4, 5, 6], Params(2, n=3), D), now=0)
    core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    lp = [TokenLogprob(-0.5), TokenLogprob(-1.5), TokenLogprob(-2.5)]
    [send] = core.computed(RID, 6, 99, 42, lp[0], None, [(43, lp[1]), (44, lp[2])])
    assert send == Send(D, Done(RID, 6, 99, 42, lp[0], None, [43, 44], lp[1:]))
    assert send.msg.firsts() == [(42, lp[0]), (43, lp[1]), (44, lp[2])]
    assert decode_message(encode_message(P, send.msg)).msg == send.msg
    assert Done(RID, 6, 99, 42, more_tokens=[43]).firsts() == [(42, None), (43, None)]  # no logprobs asked


def test_prefill_rejects_prompt_over_its_pool_before_compute():
    core = prefill_core(pool=4)
    out = core.handle(R, prefill(6), now=0)
    assert [(a.to, type(a.msg)) for a in out] == [(R, Reject), (D, Fail)]
    assert out[0].msg.error.message.startswith("This model's maximum prefill KV pool is 4 tokens")


def test_prefill_incident_emulation_rejects_yet_sends_a_placeholder():
    """As in the incident: the router hears the rejection, yet a 1-token placeholder is computed and "completed"."""
    core = prefill_core(safety=unsafe("all"), incident=True, pool=4)
    [reject] = core.handle(R, prefill(6), now=0)
    assert reject.to == R and reject.msg.error.code == "context_length_exceeded"
    assert core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0) == [StartPrefill(RID, [0], [(0, 1), (1, 1)], D)]


def test_prefill_incident_emulation_is_caught_by_coverage_alone():
    core = prefill_core(safety=unsafe("admission"), incident=True, pool=4)
    core.handle(R, prefill(6), now=0)
    out = core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    assert [(a.to, type(a.msg)) for a in out] == [(D, Fail), (R, Reject)]


def test_prefill_abort_mid_compute_acks_only_after_the_runner_stops():
    core = prefill_core()
    core.handle(R, prefill(), now=0)
    core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    assert core.handle(D, Abort(RID), now=1) == [StopPrefill(RID)]
    assert core.computed(RID, 6, 0, 1) == [Send(D, AbortAck(RID))]


def test_prefill_deferred_release_off_acks_while_writing():
    core = prefill_core(safety=unsafe("deferred_release"))
    core.handle(R, prefill(), now=0)
    core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    assert core.handle(D, Abort(RID), now=1) == [StopPrefill(RID), Send(D, AbortAck(RID))]
    assert core.computed(RID, 6, 0, 1) == []


def test_prefill_unknown_abort_is_acked_and_orphan_dest_fails():
    core = prefill_core()
    assert core.handle(D, Abort(RID + 5), now=0) == [Send(D, AbortAck(RID + 5))]
    core.handle(D, Dest(RID, [(0, 1)], 3), now=0)
    out = core.tick(now=6)
    assert [(a.to, type(a.msg)) for a in out] == [(D, Fail)] and core.reqs == {}


def test_prefill_wrong_dest_length_is_refused():
    core = prefill_core()
    core.handle(R, prefill(6), now=0)
    out = core.handle(D, Dest(RID, [(0, 1)], 1), now=0)
    assert [(a.to, type(a.msg)) for a in out] == [(D, Fail), (R, Reject)]


# -- router -------------------------------------------------------------------------


def hello(worker: str, role: str, pool: int = 1000, free: int = 10, queued: int = 0) -> Hello:
    return Hello(worker, "tcp://x", side(role), pool, 64, free_pages=free, queued_tokens=queued)


def router_core(safety: Safety = SAFE) -> RouterCore:
    core = RouterCore(R, max_context=64, safety=safety)
    for h in (hello(P, "prefill"), hello("prefill-1", "prefill", queued=500), hello(D, "decode"),
              hello("decode-1", "decode", free=2)):
        core.worker_up(h)
    return core


def request(n: int = 6, max_tokens: int = 2) -> Request:
    return Request(list(range(1, n + 1)), SamplingParams(max_tokens), "tenant-a", rid=RID)


def test_router_tells_prefills_about_decode_targets_first():
    core = RouterCore(R, max_context=64, safety=SAFE)
    assert core.worker_up(hello(D, "decode")) == []
    out = core.worker_up(hello(P, "prefill"))
    assert out == [Send(P, Peers({D: target()}))]
    holding = Hello(P, "tcp://x", PrefillSide(Peers({D: target()}).digest()), 1000, 64)
    assert core.worker_up(holding) == []  # heartbeat of a prefill that holds the Peers: nothing new
    h = Hello("decode-1", "tcp://y", target("x"), 100, 64)
    assert core.worker_up(h) == [Send(P, Peers({D: target(), "decode-1": target("x")}))]


def test_router_sends_the_peers_again_to_a_prefill_whose_heartbeat_shows_it_missed_them():
    core = RouterCore(R, max_context=64, safety=SAFE)
    core.worker_up(hello(D, "decode"))
    core.worker_up(hello(P, "prefill"))  # this Peers is lost
    stale = Hello(P, "tcp://x", PrefillSide(Peers({}).digest()), 1000, 64)
    assert core.worker_up(stale) == [Send(P, Peers({D: target()}))]


def test_router_delivers_each_output_once_in_order_and_a_gap_ends_the_request_with_503():
    core = router_core()
    core.submit(request())
    first = Output(RID, [5], "a", completion_tokens=1)
    assert core.handle(D, first) == [Deliver(RID, output=first)]
    assert core.handle(D, first) == []  # duplicated on the way: delivered once
    [cancel, deliver] = core.handle(D, Output(RID, [7], "c", completion_tokens=3))  # token 2 was lost
    assert cancel == Send(D, Cancel(RID)) and deliver.error.status == 503 and deliver.error.code == "output_lost"
    assert core.reqs == {} and core.handle(D, Output(RID, [8], "d", "stop", completion_tokens=4)) == []


def test_router_ends_a_request_that_hears_nothing_for_the_silence_timeout():
    core = router_core()
    core.silence_timeout = 10.0
    core.submit(request())
    assert core.tick(0.0) == [] and core.tick(9.0) == []
    out = Output(RID, [5], "a", completion_tokens=1)
    core.handle(D, out)  # word from decode: the clock starts again
    assert core.tick(15.0) == [] and core.tick(24.0) == []
    [cancel, deliver] = core.tick(25.5)
    assert cancel == Send(D, Cancel(RID)) and deliver.error.status == 503 and deliver.error.code == "worker_silent"
    assert core.reqs == {}


def test_router_sends_admit_and_prefill_to_the_least_loaded_pair():
    out = router_core().submit(request())
    params = Params(2)
    assert out == [Send(D, Admit(RID, "tenant-a", [1, 2, 3, 4, 5, 6], params, P)),
                   Send(P, Prefill(RID, "tenant-a", [1, 2, 3, 4, 5, 6], params, D))]


def test_router_spreads_a_burst_between_heartbeats_over_decode_workers():
    """Free pages come with the 0.5 s Hello; a burst inside one heartbeat counts the prompt pages it already sent
    (4 pages of 16 tokens here), so it splits by projected free pages instead of all going to the worker that
    reported the most, and a new Hello starts the count again."""
    core = RouterCore(R, max_context=4096, safety=SAFE)

    def decode_hello(worker: str, free: int) -> Hello:
        return Hello(worker, "tcp://x", target(), 4096, 4096, free_pages=free, total_pages=256)

    for h in (hello(P, "prefill", pool=4096), decode_hello("decode-a", 256), decode_hello("decode-b", 250)):
        core.worker_up(h)

    def burst(first: int, n: int) -> list[str]:
        return [core.submit(Request(list(range(1, 61)), SamplingParams(4), "t", rid=first + i))[0].to
                for i in range(n)]

    assert burst(1, 6) == ["decode-a", "decode-a", "decode-b", "decode-a", "decode-b", "decode-a"]
    core.worker_up(decode_hello("decode-b", 250))  # b's new Hello: its promises are counted as granted now
    assert burst(100, 2) == ["decode-b", "decode-b"]


def test_router_rejects_over_length_before_sending_anything():
    out = router_core().submit(request(60, 10))
    assert len(out) == 1 and isinstance(out[0].error, ContextLengthExceeded)


def test_router_propagates_a_prefill_reject_and_cancels_decode():
    core = router_core()
    core.submit(request())
    err = ErrorInfo(400, "invalid_request_error", "too long", "context_length_exceeded")
    out = core.handle(P, Reject(RID, err, P))
    assert out[0].rid == RID and out[0].error.status == 400 and out[0].error.code == "context_length_exceeded"
    assert out[1] == Send(D, Cancel(RID))
    assert core.handle(D, Output(RID, [5], "x")) == []  # a rejected request never delivers a token


def test_router_without_propagation_ignores_prefill_errors():
    core = router_core(unsafe("propagation"))
    core.submit(request())
    assert core.handle(P, Reject(RID, ErrorInfo(400, "x", "no"), P)) == []
    leak = Output(RID, [5], "leak", "stop", completion_tokens=1)
    assert core.handle(D, leak) == [Deliver(RID, output=leak)]


def test_router_defers_cancel_until_handoff_ends():
    """L7: decode is cancelled only once the handoff has ended; prefill is told at once, to stop computing."""
    core = router_core()
    core.submit(request())
    assert core.client_gone(RID) == [Send(P, Cancel(RID))]
    assert core.handle(D, Output(RID, [5], "x", completion_tokens=1)) == [Send(D, Cancel(RID))]
    assert core.reqs == {}


def test_router_without_deferred_abort_cancels_mid_transfer():
    core = router_core(unsafe("deferred_abort"))
    core.submit(request())
    assert core.client_gone(RID) == [Send(D, Cancel(RID))]


def test_router_worker_death_retries_a_request_without_tokens_once_then_ends_it_with_503():
    core = router_core()
    core.submit(request())
    out = core.worker_down(P)
    assert [a.to for a in out[:3]] == ["prefill-1", D, "decode-1"] and out[0].msg == WorkerDown(P)
    assert out[3] == Send(D, Cancel(RID))
    retry = retry_rid(RID)
    assert [(a.to, type(a.msg), a.msg.rid) for a in out[4:]] == [(D, Admit, retry), ("prefill-1", Prefill, retry)]
    assert list(core.reqs) == [retry] and P not in core.workers
    out = core.worker_down("prefill-1")  # the second attempt's worker dies too: no third
    assert [a.error.status for a in out if isinstance(a, Deliver)] == [503] and out[-1] == Send(D, Cancel(retry))
    assert core.reqs == {} and core.queued() == 0


def test_router_prefill_reject_after_client_left_still_cancels_decode():
    """Found by `kvfence verify`: with the cancel held back (L7), a prefill Reject used to end the request at the
    router without telling decode, which then kept the request queued for pages that might never come."""
    core = router_core()
    core.submit(request())
    assert core.client_gone(RID) == [Send(P, Cancel(RID))]
    out = core.handle(P, Reject(RID, ErrorInfo(503, "service_unavailable", "no pages"), P))
    assert out == [Send(D, Cancel(RID))]  # no Deliver: the client is gone
    assert core.reqs == {}


def test_router_treats_a_decode_hello_with_a_new_pid_as_a_restart():
    """Found by `kvfence verify --quick-restart`: a decode worker that restarted before the router noticed its death
    (a remote worker back within the heartbeat timeout) used to be taken for the same worker. Its old requests never
    ended, and prefill got the new descriptor without a WorkerDown, so a Dest from the dead incarnation made it write
    into the new pool, whose (page, epoch) pairs start over and belong to other requests. Now the old incarnation
    goes through worker_down, and the new one is told to join under the next membership epoch."""
    core = router_core()
    core.workers[D].hello = Hello(D, "tcp://x", target("old"), 1000, 64, free_pages=10, pid=41)
    core.submit(request())
    restarted = Hello(D, "tcp://x", target("new"), 1000, 64, free_pages=10, pid=42)
    out = core.handle(D, restarted)
    assert [(a.to, a.msg) for a in out if isinstance(a, Send) and not isinstance(a.msg, Admit | Prefill)] == [
        ("prefill-0", WorkerDown(D)), ("prefill-1", WorkerDown(D)), ("decode-1", WorkerDown(D)), (D, Fenced(1))]
    assert [a for a in out if isinstance(a, Deliver)] == []  # no token yet: retried on another pair
    assert list(core.reqs) == [retry_rid(RID)] and core.reqs[retry_rid(RID)].decode == "decode-1"
    assert D not in core.workers
    out = core.handle(D, restarted, epoch=1)
    assert [(a.to, a.msg) for a in out] == [("prefill-0", Peers({"decode-1": target(), D: target("new")})),
                                            ("prefill-1", Peers({"decode-1": target(), D: target("new")}))]
    assert core.workers[D].hello is restarted and core.workers[D].in_flight == 0
    assert core.handle(D, restarted, epoch=1) == []  # its next heartbeat is just a heartbeat


def test_router_keeps_a_restarted_prefill_and_its_requests():
    """Prefill's queued messages reach its new process, which may act on them: decode must keep its pages."""
    core = router_core()
    core.workers[P].hello = Hello(P, "tcp://x", side("prefill"), 1000, 64, pid=41)
    core.submit(request())
    out = core.worker_up(Hello(P, "tcp://x", side("prefill"), 1000, 64, pid=42))
    assert [(a.to, type(a.msg)) for a in out] == [(P, Peers)]  # the new process holds no Peers yet
    assert RID in core.reqs


def test_decode_gives_up_on_a_request_that_waits_for_pages_past_the_page_wait_timeout():
    """Found by `kvfence verify --quick-restart`: WAITING had no deadline, so a request whose prefill had lost it
    (a prefill restarted before the router noticed) waited forever once the pool stayed short of pages. The wait
    for pages has its own bound (120 s here), not the handoff timeout (30 s): waiting is not the handoff."""
    core = decode_core(pages=2)
    core.handle(R, admit(6), now=0)  # the whole pool
    core.handle(P, Done(RID, 6, 0, 7), now=1)  # decoding: the pages stay taken
    other = RID + 1
    assert core.handle(R, admit(4, rid=other), now=2) == []  # waits for pages
    assert core.tick(now=121) == []
    out = core.tick(now=122)
    assert [(a.to, type(a.msg)) for a in out] == [(R, Reject), (P, Fail)]
    assert out[0].msg.error.status == 503 and out[0].msg.rid == other
    assert other not in core.reqs and list(core.waiting) == []


# -- the handoff timeout measures the handoff; fair grants (issue 19, the workers' part) ----------------------------


def engine_ends(core: DecodeCore, start: StartDecode, now: float) -> list:
    """The engine ends a request it decoded: it frees its pages and reports its last output."""
    rid = start.admit.rid
    core.pages.free(rid, start.grants)
    return core.engine_output(Output(rid, [7], "", "stop", 6, 1), now=now)


def finish_decoding(core: DecodeCore, rid: int, now: float) -> list:
    return engine_ends(core, core.handle(P, Done(rid, 6, 0, 7), now=now)[0], now)


def test_the_handoff_timeout_counts_from_the_grant_not_from_admit():
    """Waiting for pages does not count: a request granted at t=40 (admitted at 0) has until 70 to be Done."""
    core = decode_core(pages=2)
    core.handle(R, admit(6, rid=RID + 1), now=0)  # the whole pool
    start = core.handle(P, Done(RID + 1, 6, 0, 7), now=1)[0]
    assert core.handle(R, admit(6), now=1) == []
    assert core.tick(now=39) == []  # past the handoff timeout while waiting: it waits on
    out = engine_ends(core, start, now=40)  # the pages come free
    assert (out[-1].to, type(out[-1].msg)) == (P, Dest)
    assert core.tick(now=69) == []
    assert [type(a.msg) for a in core.tick(now=70)] == [Reject, Abort]


def test_prefill_progress_keeps_the_handoff_alive():
    """Each Progress from the writer starts the handoff timeout again; one from another worker does not."""
    core = decode_core()
    core.handle(R, admit(6), now=0)
    assert core.handle(P, Progress(RID, 4), now=25) == []
    assert core.handle("prefill-9", Progress(RID, 4), now=50) == []  # not its writer
    assert core.tick(now=54) == []
    out = core.tick(now=55)
    assert [type(a.msg) for a in out] == [Reject, Abort] and out[0].msg.error.status == 503


def test_decode_grants_pages_in_weighted_fair_order_across_tenants():
    """bob's requests wait for pages before alice's; alice's, the latest, is granted first because bob's counter
    already holds the prompt he was granted. Within a tenant, the oldest goes first."""
    core = decode_core(pages=2)
    core.handle(R, admit(6, rid=1, tenant="bob"), now=0)  # the whole pool
    for rid, tenant in ((2, "bob"), (3, "bob"), (4, "alice")):
        core.handle(R, admit(6, rid=rid, tenant=tenant), now=1)
    granted, decoding = [], 1
    while decoding:
        dests = [a.msg.rid for a in finish_decoding(core, decoding, now=2) if isinstance(a.msg, Dest)]
        granted += dests
        decoding = dests[0] if dests else None
    assert granted == [4, 2, 3]


def test_a_tenants_weight_divides_what_decode_charges_it():
    core = decode_core(pages=8)
    core.handle(R, admit(8, rid=1, tenant="heavy", weight=2.0), now=0)
    core.handle(R, admit(8, rid=2, tenant="light"), now=0)
    assert core.shares.served == {"heavy": 4.0, "light": 8.0}


def test_prefill_reports_progress_only_while_computing():
    core = prefill_core()
    core.handle(R, prefill(6), now=0)
    assert core.progress(RID, 4) == []  # no Dest yet: nothing is computing
    core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    assert core.progress(RID, 4) == [Send(D, Progress(RID, 4))]
    core.handle(D, Abort(RID), now=1)
    assert core.progress(RID, 6) == []


def test_prefill_stops_a_cancelled_prompt_and_ends_the_handoff_once_its_writes_drained():
    """The router's Cancel (the client left mid-handoff, L7): stop between chunks; Fail (no write follows) and
    Reject only once the runner has drained, so decode frees nothing a write may still hit."""
    core = prefill_core()
    core.handle(R, prefill(6), now=0)
    core.handle(D, Dest(RID, [(0, 1), (1, 1)], 6), now=0)
    assert core.handle("decode-9", Cancel(RID), now=1) == []  # only the router may cancel
    assert core.handle(R, Cancel(RID), now=1) == [StopPrefill(RID)]
    assert core.progress(RID, 4) == []
    out = core.computed(RID, 6, 0, 7)  # the runner drained (here: it had finished anyway)
    assert [(a.to, type(a.msg)) for a in out] == [(D, Fail), (R, Reject)] and core.reqs == {}


def test_prefill_drops_a_cancelled_prompt_still_waiting_for_its_dest():
    core = prefill_core()
    core.handle(R, prefill(6), now=0)
    out = core.handle(R, Cancel(RID), now=1)
    assert [(a.to, type(a.msg)) for a in out] == [(R, Reject)] and core.reqs == {}
    # decode, told by the router, aborts; a Dest that crossed the Cancel is answered as any unknown one
    assert core.handle(D, Abort(RID), now=2) == [Send(D, AbortAck(RID))]


def test_the_router_sends_the_tenants_weight_to_both_workers():
    from kvfence.protocol.capacity import QueuePolicy, TenantQuota

    core = RouterCore(R, max_context=64, safety=SAFE, policy=QueuePolicy({"tenant-a": TenantQuota(weight=3.0)}))
    for h in (hello(P, "prefill"), hello(D, "decode")):
        core.worker_up(h)
    sent = [a.msg for a in core.submit(request()) if isinstance(a, Send)]
    assert [(type(m), m.weight) for m in sent] == [(Admit, 3.0), (Prefill, 3.0)]


def test_every_timeout_derives_from_the_handoff_timeout():
    from kvfence.config import Timeouts

    assert (Timeouts().abort, Timeouts().orphan_dest, Timeouts().silence, Timeouts().wait) == (10.0, 5.0, 120.0, 120.0)
    short = Timeouts(handoff=3.0)
    assert (short.abort, short.orphan_dest, short.silence) == (1.0, 0.5, 12.0)
