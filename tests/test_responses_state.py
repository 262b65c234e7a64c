"""Responses API state: the bounded store (previous_response_id, GET / DELETE) and the
signed ``encrypted_content`` of reasoning items, by hand and over the fake runner."""

from __future__ import annotations

import json

from mlxd.daemon.api.reasoning_seal import ReasoningSeal
from mlxd.daemon.api.response_store import ResponseStore

from tests.conftest import settings_with
from tests.test_responses import RESP, post
from tests.test_responses_tools import THINKING, THOUGHT, client, prompt_of, recording

# ---- the store by hand ----------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_expires_entries_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=60, clock=clock)
    store.put("a", b"{}", [])
    clock.now = 30
    store.put("b", b"{}", [])
    clock.now = 61
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 91
    assert store.get("b") is None and len(store) == 0 and store.bytes == 0


def test_store_evicts_the_oldest_past_either_cap():
    store = ResponseStore(max_entries=2, max_bytes=10_000, ttl_s=0)
    for rid in "abc":
        store.put(rid, b"{}", [])
    assert list(store.entries) == ["b", "c"]
    small = ResponseStore(max_entries=10, max_bytes=100, ttl_s=0)
    small.put("a", b"x" * 40, [])
    small.put("b", b"x" * 40, [])
    small.put("c", b"x" * 40, [])
    assert list(small.entries) == ["b", "c"] and small.bytes == 80 + 2 * len(b"[]")
    assert not small.put("huge", b"x" * 101, [])  # alone over the cap: not kept
    assert list(small.entries) == ["b", "c"]


def test_store_delete_and_replace_keep_the_byte_count():
    store = ResponseStore(max_entries=10, max_bytes=10_000, ttl_s=0)
    store.put("a", b"12345", [{"type": "message"}])
    store.put("a", b"1", [])
    assert store.bytes == 1 + 2 and len(store) == 1
    assert store.delete("a") and not store.delete("a") and store.bytes == 0


# ---- the seal by hand -------------------------------------------------------------------------


def test_seal_round_trip_and_refusals():
    seal = ReasoningSeal(b"k" * 32)
    token = seal.seal("I think, therefore. ünïcode")
    assert seal.open(token) == "I think, therefore. ünïcode"
    assert "think" not in token  # opaque to a glance (signed, not encrypted)
    payload, _, signature = token.rpartition(".")
    forged = ReasoningSeal(b"x" * 32).seal("other")
    for bad in (
        token[:-2] + ("AA" if token[-2:] != "AA" else "BB"),  # signature changed
        payload[:-3] + "abc." + signature,  # payload changed
        forged,  # another key
        "",
        "mlxd1.",
        "not base64 at all ✓",
        "mlxd1.!!!." + seal._sign("mlxd1.!!!"),  # signed garbage
    ):
        assert seal.open(bad) is None, bad


def test_seal_key_file_keeps_the_key(tmp_path):
    path = tmp_path / "sub" / "reasoning.key"
    first = ReasoningSeal.from_key_file(str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    again = ReasoningSeal.from_key_file(str(path))
    assert again.open(first.seal("kept")) == "kept"
    fresh = ReasoningSeal.from_key_file("")
    assert fresh.open(first.seal("kept")) is None


# ---- over HTTP ----------------------------------------------------------------------------------


async def test_previous_response_id_continues_the_conversation():
    async with client() as (c, runner):
        seen = recording(runner)
        first = await post(c, {"input": "first question", "instructions": "SYS-ONE"})
        second = await post(c, {"input": "second", "previous_response_id": first["id"]})
        third = await post(c, {"input": "third", "previous_response_id": second["id"]})
    assert first["store"] is True and second["previous_response_id"] == first["id"]
    assert third["output"][0]["content"][0]["text"] == "THIRD"
    prompt = prompt_of(seen[2])
    order = ["first question", "FIRST QUESTION", "second", "SECOND", "third"]
    at = [prompt.index(text) for text in order]
    assert at == sorted(at)
    assert "SYS-ONE" not in prompt  # instructions are not carried over


async def test_get_and_delete_a_stored_response():
    async with client() as (c, _):
        body = await post(c, {"input": "keep me"})
        got = await c.get(f"{RESP}/{body['id']}")
        assert got.status_code == 200 and json.loads(await got.get_data()) == body
        deleted = await c.delete(f"{RESP}/{body['id']}")
        assert json.loads(await deleted.get_data()) == {
            "id": body["id"],
            "object": "response.deleted",
            "deleted": True,
        }
        gone = await c.get(f"{RESP}/{body['id']}")
        again = await c.delete(f"{RESP}/{body['id']}")
        err = await post(c, {"input": "x", "previous_response_id": body["id"]}, 400)
    assert gone.status_code == 404 and again.status_code == 404
    assert json.loads(await gone.get_data())["error"]["type"] == "not_found_error"
    assert err["error"]["code"] == "previous_response_not_found"
    assert err["error"]["param"] == "previous_response_id"
    assert err["error"]["type"] == "invalid_request_error"


async def test_streamed_response_is_stored_and_unstored_is_not():
    from tests.test_openai_features import read_stream
    from tests.test_responses import events

    async with client() as (c, _):
        evs = events(await read_stream(c, RESP, {"input": "streamed"}))
        rid = evs[-1]["response"]["id"]
        got = json.loads(await (await c.get(f"{RESP}/{rid}")).get_data())
        follow = await post(c, {"input": "and then", "previous_response_id": rid})
        unstored = await post(c, {"input": "private", "store": False})
        missing = await c.get(f"{RESP}/{unstored['id']}")
    assert got["output"] == evs[-1]["response"]["output"]
    assert follow["status"] == "completed"
    assert missing.status_code == 404


async def test_store_caps_come_from_the_settings():
    settings = settings_with(responses={"store_max_entries": 1})
    async with client(settings) as (c, _):
        a = await post(c, {"input": "a"})
        b = await post(c, {"input": "b"})
        old = await c.get(f"{RESP}/{a['id']}")
        new = await c.get(f"{RESP}/{b['id']}")
    assert old.status_code == 404 and new.status_code == 200


async def test_encrypted_reasoning_round_trip_and_tampering():
    include = {"include": ["reasoning.encrypted_content"], "store": False}
    async with client(THINKING) as (c, _):
        first = await post(c, {"input": THOUGHT, **include})
        reasoning, message = first["output"]
        token = reasoning["encrypted_content"]
        history = [
            {"role": "user", "content": THOUGHT},
            reasoning,
            message,
            {"role": "user", "content": "next"},
        ]
        ok = await post(c, {"input": history, **include})
        codex_shape = {k: reasoning[k] for k in ("type", "summary", "encrypted_content")}
        ok_bare = await post(c, {"input": [codex_shape, {"role": "user", "content": "x"}]})
        tampered = {**reasoning, "encrypted_content": token[:-4] + "AAAA"}
        err = await post(c, {"input": [tampered, {"role": "user", "content": "x"}]}, 400)
    assert token and ok["status"] == "completed" and ok_bare["status"] == "completed"
    assert ok["output"][-1]["content"][0]["text"] == "NEXT"
    assert err["error"]["code"] == "invalid_encrypted_content"
    assert err["error"]["param"] == "input[0].encrypted_content"


async def test_an_unknown_previous_item_type_names_its_place():
    async with client() as (c, _):
        first = await post(c, {"input": "a"})
        err = await post(
            c, {"input": [{"type": "mystery"}], "previous_response_id": first["id"]}, 400
        )
    assert err["error"]["param"] == "input[0]"
