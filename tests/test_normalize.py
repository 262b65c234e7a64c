import pytest
from mlxd.actors.normalize import NormalizeError, normalize_messages
from mlxd.protocol.messages import ImagePart, Message, TextPart


def msgs(*pairs):
    return [Message(role=r, content=c) for r, c in pairs]


def test_developer_becomes_system():
    out = normalize_messages(msgs(("developer", "be brief"), ("user", "hi")))
    assert out == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_system_system_user_user_merge():
    out = normalize_messages(msgs(("system", "a"), ("system", "b"), ("user", "c"), ("user", "d")))
    assert out == [{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "c\n\nd"}]


def test_system_mid_conversation_moves_to_front():
    out = normalize_messages(
        msgs(("user", "q1"), ("assistant", "a1"), ("system", "late rule"), ("user", "q2"))
    )
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "late rule"


def test_system_merged_into_first_and_users_joined_across_removed_system():
    out = normalize_messages(
        msgs(("system", "s1"), ("user", "u1"), ("system", "s2"), ("user", "u2"))
    )
    assert out == [
        {"role": "system", "content": "s1\n\ns2"},
        {"role": "user", "content": "u1\n\nu2"},
    ]


def test_list_content_flattened_for_text_models():
    parts = (TextPart(text="one"), TextPart(text="two"))
    out = normalize_messages([Message(role="user", content=parts)])
    assert out == [{"role": "user", "content": "one\ntwo"}]


def test_list_content_kept_for_multimodal():
    parts = (TextPart(text="look"), ImagePart(url="x"))
    a = normalize_messages([Message(role="user", content=parts)], text_only=False)
    assert a == [{"role": "user", "content": list(parts)}]
    b = normalize_messages(
        [Message(role="user", content=parts), Message(role="user", content="more")], text_only=False
    )
    assert b[0]["content"] == [*parts, TextPart(text="more")]


def test_image_part_for_text_model_is_an_error():
    parts = (ImagePart(url="x"),)
    with pytest.raises(NormalizeError, match="image_url"):
        normalize_messages([Message(role="user", content=parts)])


def test_none_content_and_tool_role_kept():
    out = normalize_messages(msgs(("user", "q"), ("assistant", None), ("tool", "r"), ("tool", "s")))
    assert out[1] == {"role": "assistant", "content": ""}
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool"]


def test_empty_is_an_error():
    with pytest.raises(NormalizeError):
        normalize_messages([])
