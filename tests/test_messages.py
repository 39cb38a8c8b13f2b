"""Fixed-value message fields: the sockets' typed decoders reject values outside their sets, and every
value the processes send round-trips."""

from __future__ import annotations

import typing

import msgspec
import pytest
import zmq

from tidal.messages import (
    AbortReason,
    AbortReq,
    Batch,
    ControlInbound,
    Detokenize,
    DetokenizerInbound,
    Drained,
    ExecutorFailed,
    ExecutorInbound,
    FinishReason,
    FrontendInbound,
    Heartbeat,
    MemberState,
    MeshReady,
    Plan,
    PlanMode,
    PromptAdmitted,
    Ready,
    RelayInbound,
    SchedulerInbound,
    SegmentSpec,
    StepOutput,
    TapMessage,
    TextDelta,
    Usage,
    decoder,
    encode,
)
from tidal.runtime.ipc import Pull

# What the processes send, found by reading each field's producers.
FINISH_REASONS = ["stop", "length", "abort", "error"]  # scheduler, detokenizer (stop, error), abort reasons
ABORT_REASONS = ["abort", "stop", "error"]  # frontend, detokenizer (stop string, failure)
PLAN_MODES = ["chunked", "layer_major"]  # scheduler
DETOKENIZE_STATUSES = [400, 500]  # scheduler: refused at admission, failed while running
TEXT_DELTA_STATUSES = [400, 500, 503]  # the above, passed through; 503: the frontend's drain deadline
ROLES = ["scheduler", "detokenizer", "frontend", "executor-0", "executor-7"]  # runtime/roles.py, one per rank
MEMBER_STATES = ["starting", "ready", "leaving", "failed"]  # runtime/supervisor.py's Member


def _segment() -> SegmentSpec:
    return SegmentSpec(rid="r", slot=0, start=0, token_ids=[1, 2, 3])


def _round_trip(msg, union):
    assert decoder(union).decode(encode(msg)) == msg


def test_literal_sets_are_what_the_code_sends():
    assert sorted(typing.get_args(FinishReason)) == sorted(FINISH_REASONS)
    assert sorted(typing.get_args(AbortReason)) == sorted(ABORT_REASONS)
    assert sorted(typing.get_args(PlanMode)) == sorted(PLAN_MODES)
    assert sorted(typing.get_args(MemberState)) == sorted(MEMBER_STATES)


@pytest.mark.parametrize("reason", ABORT_REASONS)
def test_abort_reasons_round_trip(reason):
    _round_trip(AbortReq(rid="r", reason=reason), SchedulerInbound)


@pytest.mark.parametrize("reason", [*FINISH_REASONS, None])
def test_finish_reasons_round_trip(reason):
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    detok = Detokenize(rid="r", token_ids=[5], finished=reason is not None, finish_reason=reason, usage=usage)
    _round_trip(detok, DetokenizerInbound)
    _round_trip(StepOutput(events=[detok]), DetokenizerInbound)
    _round_trip(detok, TapMessage)
    _round_trip(TextDelta(rid="r", text="x", token_ids=[5], finished=reason is not None, finish_reason=reason,
                          usage=usage), FrontendInbound)


@pytest.mark.parametrize("status", [*DETOKENIZE_STATUSES, None])
def test_detokenize_error_statuses_round_trip(status):
    _round_trip(Detokenize(rid="r", token_ids=[], finished=True, finish_reason="error", error="e",
                           error_status=status), DetokenizerInbound)


@pytest.mark.parametrize("status", [*TEXT_DELTA_STATUSES, None])
def test_text_delta_error_statuses_round_trip(status):
    _round_trip(TextDelta(rid="r", text="", token_ids=[], finished=True, finish_reason="error", error="e",
                          error_status=status), FrontendInbound)


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_modes_round_trip(mode):
    admitted = PromptAdmitted(rid="r", prompt_tokens=3, cached_tokens=0,
                              plan=Plan(mode=mode, chunks=[[0, 3]], checkpoints=[2], reason="why"))
    for union in (DetokenizerInbound, FrontendInbound, TapMessage):
        _round_trip(admitted, union)
    _round_trip(Batch(batch_id=1, segments=[_segment()], mode=mode, chunk_size=64 if mode == "layer_major" else 0),
                ExecutorInbound)


@pytest.mark.parametrize("role", ROLES)
def test_roles_round_trip(role):
    _round_trip(Ready(role=role), RelayInbound)
    for state in MEMBER_STATES:
        _round_trip(Heartbeat(role=role, instance="abc-1", state=state, error="x" if state == "failed" else ""),
                    ControlInbound)


def test_lifecycle_messages_round_trip():
    _round_trip(Drained(), RelayInbound)
    _round_trip(ExecutorFailed(rank=-1, error="hung"), ControlInbound)
    _round_trip(ExecutorFailed(rank=0, error="lost"), RelayInbound)
    _round_trip(MeshReady(), FrontendInbound)


# Messages built with a value outside their field's set (a Struct does not validate on construction).
BAD = [
    (AbortReq(rid="r", reason="cancel"), SchedulerInbound),
    (Detokenize(rid="r", token_ids=[], finished=True, finish_reason="timeout"), DetokenizerInbound),
    (StepOutput(events=[Detokenize(rid="r", token_ids=[], finish_reason="STOP")]), DetokenizerInbound),
    (Detokenize(rid="r", token_ids=[], finished=True, finish_reason="error", error_status=503), DetokenizerInbound),
    (Detokenize(rid="r", token_ids=[], finish_reason="stopped"), TapMessage),
    (TextDelta(rid="r", text="", token_ids=[], finished=True, finish_reason="cancelled"), FrontendInbound),
    (TextDelta(rid="r", text="", token_ids=[], finished=True, finish_reason="error", error_status=404),
     FrontendInbound),
    (PromptAdmitted(rid="r", prompt_tokens=1, cached_tokens=0, plan=Plan(mode="bulk", chunks=[[0, 1]])),
     DetokenizerInbound),
    (Batch(batch_id=1, segments=[_segment()], mode="layer-major"), ExecutorInbound),
    (Ready(role="worker"), RelayInbound),
    (Ready(role="executor-"), RelayInbound),
    (Ready(role="mesh"), RelayInbound),
    (Heartbeat(role="executor-1x", instance="a", state="ready"), ControlInbound),
    (Heartbeat(role="frontend", instance="a", state="alive"), ControlInbound),
]


@pytest.mark.parametrize("msg,union", BAD, ids=lambda v: type(v).__name__ if isinstance(v, msgspec.Struct) else "")
def test_out_of_set_values_are_rejected(msg, union):
    with pytest.raises(msgspec.ValidationError):
        decoder(union).decode(encode(msg))


def test_a_socket_drops_an_out_of_set_value():
    ctx = zmq.Context()
    try:
        pull: Pull = Pull(ctx, "inproc://test-messages", SchedulerInbound, bind=True)
        assert pull.decode(encode(AbortReq(rid="r", reason="cancel"))) is None
        assert pull.decode(encode(AbortReq(rid="r", reason="stop"))) == AbortReq(rid="r", reason="stop")
        pull.close()
    finally:
        ctx.term()
