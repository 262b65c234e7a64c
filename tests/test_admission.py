from actors.admission import AdmissionPolicy, Decision
from protocol.messages import CompletionRequest, SamplingParams


def req(i):
    return CompletionRequest(request_id=f"r{i}", prompt="x", sampling=SamplingParams(max_tokens=1))


def test_runs_then_queues_then_rejects():
    policy = AdmissionPolicy(max_running=2, max_waiting=1)
    assert [policy.admit(req(i)) for i in range(4)] == [
        Decision.RUN,
        Decision.RUN,
        Decision.QUEUE,
        Decision.REJECT,
    ]


def test_release_hands_slot_to_oldest_waiter():
    policy = AdmissionPolicy(max_running=1, max_waiting=3)
    for i in range(3):
        policy.admit(req(i))
    assert [r.request_id for r in policy.release("r0")] == ["r1"]
    assert policy.running == {"r1"}
    assert list(policy.waiting) == ["r2"]


def test_release_of_waiting_request_frees_its_place():
    policy = AdmissionPolicy(max_running=1, max_waiting=1)
    policy.admit(req(0))
    policy.admit(req(1))
    assert policy.admit(req(2)) is Decision.REJECT
    assert policy.release("r1") == []
    assert policy.admit(req(2)) is Decision.QUEUE


def test_new_arrival_does_not_jump_the_queue():
    policy = AdmissionPolicy(max_running=1, max_waiting=2)
    policy.admit(req(0))
    policy.admit(req(1))
    policy.running.clear()  # a slot frees without a release having run yet
    assert policy.admit(req(2)) is Decision.QUEUE
